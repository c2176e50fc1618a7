"""`tether config import`: translate a peer framework's run configuration into Tether's.

Reads a launch script (verl Hydra overrides ``key=value``, OpenRLHF/slime ``--flag value``) or a
YAML config (verl's nested tree, ROLL's pipeline YAML) and maps the batch knobs and the common
settings onto Tether's sections. The peers count their batches in different units; the comments at
each mapper say which unit each peer key is in. Nothing is guessed: a key we cannot translate goes
to ``unmapped`` with the reason, a ``$VAR`` we cannot resolve goes to ``unknown_variables``, and a
peer configuration that Tether cannot reproduce (uneven batch division, a critic-based estimator)
goes to ``problems``, which the CLI turns into exit status 2.

Shell scripts are read with a small bash-like lexer (quotes, ``\\`` continuations, comments,
``NAME=value`` / ``export``, arrays ``A=( ... )`` and ``${A[@]}``, ``${V:-default}``, integer
``$(( ))``); it never runs anything. Full-line comments inside a continued command are skipped,
as the script's author meant, although bash itself would end the command there.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PEERS = ("verl", "openrlhf", "slime", "roll")
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"


@dataclass(frozen=True)
class MappedKey:
    """One translated setting: ``peer_key`` (several joined by ``+``) became ``tether_key``."""

    peer_key: str
    peer_value: Any
    tether_key: str
    tether_value: Any
    note: str = ""


@dataclass(frozen=True)
class ImportProblem:
    """A peer setting Tether cannot reproduce; the message says why and how to fix it."""

    message: str


@dataclass
class ImportResult:
    peer: str
    source: str
    tether: dict[str, dict[str, Any]] = field(default_factory=dict)
    mapping: list[MappedKey] = field(default_factory=list)
    unmapped: list[tuple[str, Any, str]] = field(default_factory=list)
    unknown_variables: list[str] = field(default_factory=list)
    problems: list[ImportProblem] = field(default_factory=list)


# --------------------------------------------------------------------------- shell lexer


class _Op(str):
    """A shell operator or a newline (command separator)."""


@dataclass
class _ArrayAssign:
    name: str
    items: list[str]


class _Shell:
    """Expands and splits a bash script into simple commands, tracking variables as it goes."""

    def __init__(self, text: str, env: Mapping[str, str]) -> None:
        lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
        self.s = "\n".join(lines) + "\n"
        self.i = 0
        self.env: dict[str, str] = dict(env)
        self.arrays: dict[str, list[str]] = {}
        self.unknown: dict[str, set[str]] = {}  # name -> the literal texts left in words
        self.unresolved: set[str] = set()

    def commands(self) -> list[list[str]]:
        """Runs through the script; returns its commands with assignments applied in order."""
        out: list[list[str]] = []
        words: list[str] = []
        skip_next = False
        while (tok := self._token()) is not None:
            if isinstance(tok, _ArrayAssign):
                if not words:
                    self.arrays[tok.name] = tok.items
            elif isinstance(tok, _Op):
                if tok in (">", ">>", "<", ">&", "&>"):
                    skip_next = True
                else:
                    self._finish(words, out)
                    words = []
            elif tok:
                if skip_next:
                    tok, skip_next = tok[1:], False
                words.extend(tok)
        self._finish(words, out)
        return out

    def _finish(self, words: list[str], out: list[list[str]]) -> None:
        if words and words[0] in ("export", "declare", "local", "readonly"):
            words = [w for w in words[1:] if not w.startswith("-")]
            words = [w for w in words if "=" in w]
        while words and re.match(_NAME + r"=", words[0]):
            name, value = words.pop(0).split("=", 1)
            self.env[name] = value
        if words:
            out.append(words)

    def _unknown(self, name: str, literal: str) -> str:
        self.unknown.setdefault(name, set()).add(literal)
        self.unresolved.add(literal)
        return literal

    def _token(self) -> list[str] | _Op | _ArrayAssign | None:
        s = self.s
        while self.i < len(s) and (s[self.i] in " \t" or s.startswith("\\\n", self.i)):
            self.i += 2 if s[self.i] == "\\" else 1
        if self.i >= len(s):
            return None
        c = s[self.i]
        if c == "#":
            self.i = s.index("\n", self.i)
            return self._token()
        if c in "\n|&;<>()":
            for op in ("&&", "||", ";;", ">>", ">&", "&>", c):
                if s.startswith(op, self.i):
                    self.i += len(op)
                    return _Op(op)
        return self._word()

    def _word(self) -> list[str] | _ArrayAssign:
        s, words, buf, has = self.s, [], "", False
        while self.i < len(s):
            c = s[self.i]
            if c in " \t\n|&;()<>":
                if c == "(" and re.fullmatch(_NAME + r"\+?=", buf):
                    return self._array(buf.rstrip("+="))
                if c in "<>" and buf.isdigit():
                    buf, has = "", False  # a file descriptor number, as in 2>&1
                break
            if c == "\\":
                if s[self.i + 1] != "\n":
                    buf += s[self.i + 1]
                    has = True
                self.i += 2
            elif c == "'":
                end = s.find("'", self.i + 1)
                end = len(s) if end < 0 else end
                buf, has, self.i = buf + s[self.i + 1 : end], True, end + 1
            elif c == '"':
                fields = self._double_quoted()
                buf, has = buf + fields[0], True
                for f in fields[1:]:
                    words.append(buf)
                    buf = f
            elif c == "$":
                value, self.i = self._expand(s, self.i)
                fields = value if isinstance(value, list) else _split_fields(value)
                if fields and fields[0] is None:  # leading blank ends the word
                    fields = fields[1:]
                    if buf or has:
                        words.append(buf)
                    buf, has = "", False
                for k, f in enumerate(fields):
                    if k:
                        words.append(buf)
                        buf, has = "", False
                    buf += f
                    has = has or bool(f)
            elif c == "`":
                end = _matching(s, self.i)
                buf, has = buf + self._unknown(s[self.i : end + 1], s[self.i : end + 1]), True
                self.i = end + 1
            else:
                buf, has = buf + c, True
                self.i += 1
        if buf or has:
            words.append(buf)
        return words

    def _array(self, name: str) -> _ArrayAssign:
        self.i += 1  # the "("
        items: list[str] = []
        while (tok := self._token()) is not None and tok != ")":
            if isinstance(tok, list):
                items.extend(tok)
        return _ArrayAssign(name, items)

    def _double_quoted(self) -> list[str]:
        s, self.i, fields = self.s, self.i + 1, [""]
        while self.i < len(s) and s[self.i] != '"':
            c = s[self.i]
            if c == "\\" and s[self.i + 1] in '$`"\\\n':
                fields[-1] += "" if s[self.i + 1] == "\n" else s[self.i + 1]
                self.i += 2
            elif c == "$":
                value, self.i = self._expand(s, self.i)
                if isinstance(value, list):  # "${A[@]}": one word per element
                    fields[-1] += value[0] if value else ""
                    fields.extend(value[1:])
                else:
                    fields[-1] += value
            else:
                fields[-1] += c
                self.i += 1
        self.i += 1
        return fields

    def _expand(self, s: str, i: int) -> tuple[str | list[str], int]:
        """Expands the ``$...`` at ``s[i]``; returns (value or array elements, index after it)."""
        if s.startswith("$((", i):
            end = s.find("))", i)
            end = len(s) - 2 if end < 0 else end
            expr = self._expand_text(s[i + 3 : end])
            literal = s[i : end + 2]
            value = _arith(expr, self.env)
            return (self._unknown(literal, literal) if value is None else str(value)), end + 2
        if s.startswith("$(", i) or s[i + 1 : i + 2] == "`":
            end = _matching(s, i + 1)
            literal = s[i : end + 1]
            return self._unknown(literal, literal), end + 1
        if s.startswith("${", i):
            end = _matching(s, i + 1)
            return self._braced(s[i + 2 : end], s[i : end + 1]), end + 1
        m = re.compile(_NAME + r"|[0-9@*#?$!]").match(s, i + 1)
        if not m:
            return "$", i + 1
        name, literal = m.group(), s[i : m.end()]
        if name in ("@", "*"):
            return [], m.end()  # the script's own arguments: none when we read it
        if name in self.arrays:
            return self.arrays[name][0] if self.arrays[name] else "", m.end()
        if name in self.env:
            return self.env[name], m.end()
        return self._unknown(name, literal), m.end()

    def _braced(self, inner: str, literal: str) -> str | list[str]:
        m = re.fullmatch(rf"({_NAME})(\[[@*]\])?(?:(:?[-=+])(.*))?", inner, re.S)
        if not m:
            return self._unknown(literal, literal)
        name, subscript, op, default = m.groups()
        if subscript:
            if name in self.arrays:
                return list(self.arrays[name])
            return self._unknown(name, literal)
        value = self.env.get(name)
        if op and op.endswith(("-", "=")) and (value is None or (op[0] == ":" and not value)):
            value = self._expand_text(default or "")
            if op.endswith("="):
                self.env[name] = value
        elif op and op.endswith("+"):
            return self._expand_text(default or "") if value else ""
        if value is None:
            return self._unknown(name, literal)
        return value

    def _expand_text(self, text: str) -> str:
        out, i = "", 0
        while i < len(text):
            if text[i] == "$":
                value, i = self._expand(text, i)
                out += " ".join(value) if isinstance(value, list) else value
            else:
                out, i = out + text[i], i + 1
        return out.strip("\"'")


def _split_fields(value: str) -> list[Any]:
    """Word-splits an unquoted expansion; a leading ``None`` means it began with a blank."""
    fields: list[Any] = value.split()
    if value[:1].isspace():
        fields.insert(0, None)
    if value[-1:].isspace() and fields:
        fields.append("")
    return fields


def _matching(s: str, i: int) -> int:
    """Index of the bracket closing the one at ``s[i]`` (``(``, ``{`` or a backtick)."""
    opener = s[i]
    if opener == "`":
        end = s.find("`", i + 1)
        return len(s) - 1 if end < 0 else end
    closer, depth = {"(": ")", "{": "}"}[opener], 0
    for j in range(i, len(s)):
        depth += (s[j] == opener) - (s[j] == closer)
        if depth == 0:
            return j
    return len(s) - 1


def _arith(expr: str, env: Mapping[str, str]) -> int | None:
    """Integer arithmetic of ``$(( ))`` on literals and known variables, or None."""
    expr = re.sub(_NAME, lambda m: env.get(m.group(), m.group()), expr)
    try:
        tree = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError:
        return None
    ops = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__}
    ops |= {ast.Div: int.__floordiv__, ast.FloorDiv: int.__floordiv__, ast.Mod: int.__mod__}

    def walk(node: ast.AST) -> int | None:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            v = walk(node.operand)
            return None if v is None else -v
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            a, b = walk(node.left), walk(node.right)
            if a is None or b is None or (b == 0 and type(node.op) is not ast.Mult):
                return None
            return ops[type(node.op)](a, b)
        return None

    return walk(tree)


# --------------------------------------------------------------------------- reading sources


@dataclass
class _Source:
    """The peer's settings as a flat ``normalized key -> (key as written, value)`` table."""

    flat: dict[str, tuple[str, Any]]
    unresolved: set[str]
    unknown: list[str]
    env: dict[str, str] = field(default_factory=dict)
    entry: str = ""
    problems: list[str] = field(default_factory=list)


_ENTRY = {
    "verl": r"(^|[./])main_\w+(\.py)?$",
    "openrlhf": r"openrlhf\.cli\.train_\w+$|(^|/)train_ppo\w*\.py$",
    "slime": r"(^|/)train(_async)?\.py$",
}
_ENTRY_EXAMPLE = {
    "verl": "python3 -m verl.trainer.main_ppo key=value ...",
    "openrlhf": "python3 -m openrlhf.cli.train_ppo_ray --flag value ...",
    "slime": "python3 train.py --flag value ...",
}


def _coerce(value: Any) -> Any:
    """Types a string as the peers' parsers would: bools, null, ints, floats, ``[a,b]`` lists."""
    if isinstance(value, list):
        return [_coerce(v) for v in value]
    if not isinstance(value, str):
        return value
    v = value.strip()
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    if v.lower() in ("null", "none", "~"):
        return None
    if re.fullmatch(r"[+-]?\d+", v):
        return int(v)
    if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", v):
        return float(v)
    if v.startswith("[") and v.endswith("]"):
        inner = v[1:-1].strip()
        return [_coerce(x.strip().strip("'\"")) for x in inner.split(",")] if inner else []
    return value


def _flags(args: list[str], *, max_values: int | None = None) -> dict[str, tuple[str, Any]]:
    """``--flag value``, ``--flag=value``, ``--flag v1 v2`` (a list) and bare ``--flag`` (True)."""
    out: dict[str, tuple[str, Any]] = {}
    i = 0
    while i < len(args):
        word = args[i]
        if not word.startswith("--") or word == "--":
            i += 1
            continue
        if "=" in word:
            key, given = word[2:].split("=", 1)
            values, i = [given], i + 1
        else:
            key, j = word[2:], i + 1
            while j < len(args) and not args[j].startswith("--"):
                j += 1
            if max_values is not None:
                j = min(j, i + 1 + max_values)
            values, i = args[i + 1 : j], j
        value = True if not values else values[0] if len(values) == 1 else values
        out[key.replace("-", "_")] = ("--" + key, value)
    return out


def _read_script(peer: str, text: str, variables: Mapping[str, str]) -> _Source:
    shell = _Shell(text, variables)
    commands = shell.commands()
    pattern = re.compile(_ENTRY.get(peer, r"$^"))
    found: list[tuple[int, str, list[str]]] = []
    for words in commands:
        for k, w in enumerate(words):
            if pattern.search(w) and words[0] != "echo":
                found.append((len(words) - k, w, words[k + 1 :]))
                break
    src = _Source({}, shell.unresolved, [], shell.env)
    if not found:
        example = _ENTRY_EXAMPLE.get(peer, "")
        hint = f" (expected a command like `{example}`)" if example else ""
        if peer == "roll":
            hint = "; ROLL is configured by YAML: pass the pipeline's .yaml file instead"
        src.problems.append(f"no {peer} training command found in the script{hint}.")
        return src
    _, src.entry, args = max(found, key=lambda f: f[0])
    joined = "\n".join(args)  # report only the unknowns the training command depends on
    src.unknown = [
        name for name, lits in shell.unknown.items() if any(lit in joined for lit in lits)
    ]
    if peer == "verl":
        src.flat = _flags([a for a in args if a.startswith("--")], max_values=0)
        for a in args:
            m = re.fullmatch(r"(\+\+|\+|~)?([A-Za-z_][\w.\-]*)=(.*)", a, re.S)
            if m and not a.startswith("--"):
                src.flat[m[2]] = (a.split("=", 1)[0], m[3])
    else:
        src.flat = _flags(args)
    return src


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _read_yaml(text: str, variables: Mapping[str, str], path: Path) -> _Source:
    import yaml  # only the importer needs it

    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(
            f"{path} is not valid YAML ({exc}); fix the file or pass a launch script."
        ) from None
    if not isinstance(tree, dict):
        raise ValueError(f"{path} holds no YAML mapping at its top level; pass the run's config.")
    flat = _flatten(tree)
    src = _Source({k: (k, v) for k, v in flat.items()}, set(), [])

    def resolve(ref: str, literal: str, depth: int) -> Any:
        ref = ref.strip()
        if ref.startswith("oc.env:") or ref.startswith("oc.select:"):
            name, _, default = ref.split(":", 1)[1].partition(",")
            if ref.startswith("oc.env:") and name.strip() in variables:
                return variables[name.strip()]
            if ref.startswith("oc.select:") and name.strip() in flat:
                return interpolate(flat[name.strip()], depth + 1)
            if default:
                return default.strip().strip("'\"")
            ref = name.strip()
        elif ref in flat and depth < 8:
            return interpolate(flat[ref], depth + 1)
        if ref not in src.unknown:
            src.unknown.append(ref)
        src.unresolved.add(literal)
        return literal

    def interpolate(value: Any, depth: int = 0) -> Any:
        if not isinstance(value, str) or "${" not in value:
            return value
        whole = re.fullmatch(r"\$\{([^${}]+)\}", value.strip())
        if whole:
            return resolve(whole[1], value.strip(), depth)
        return re.sub(r"\$\{([^${}]+)\}", lambda m: str(resolve(m[1], m[0], depth)), value)

    src.flat = {k: (k, interpolate(v)) for k, v in flat.items()}
    return src


def _device_count(value: Any) -> int | None:
    """Number of devices in a ROLL ``device_mapping``: a list or ``list(range(a, b[, step]))``."""
    if isinstance(value, list):
        return len(value)
    if isinstance(value, str):
        m = re.fullmatch(
            r"\s*list\(\s*range\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?(?:,\s*(\d+)\s*)?\)\s*\)\s*", value
        )
        if m:
            a, b, step = m[1], m[2], m[3] or "1"
            start, stop = (0, int(a)) if b is None else (int(a), int(b))
            return len(range(start, stop, int(step)))
        parsed = _coerce(value)
        if isinstance(parsed, list):
            return len(parsed)
    return None


# --------------------------------------------------------------------------- mapping core


class _Skip(Exception):
    """Raised by a value converter: the peer value has no Tether equivalent (message: why)."""


_NOT_SET = object()


class _Map:
    """Reads peer keys (marking them used) and records Tether values with where they came from."""

    def __init__(self, peer: str, src: _Source, result: ImportResult) -> None:
        self.peer, self.src, self.res = peer, src, result
        self.used: set[str] = set()
        self.dropped: set[str] = set()

    def name(self, key: str) -> str:
        if key in self.src.flat:
            return self.src.flat[key][0]
        if self.peer == "slime":
            return "--" + key.replace("_", "-")
        return "--" + key if self.peer == "openrlhf" else key

    def given(self, key: str) -> bool:
        """Set in the peer config to a value we can read (``null`` means the peer's default)."""
        if key not in self.src.flat:
            return False
        raw = self.src.flat[key][1]
        return not self._unresolved(raw) and _coerce(raw) is not None

    def _unresolved(self, value: Any) -> bool:
        text = json.dumps(value, default=str) if not isinstance(value, str) else value
        return any(lit in text for lit in self.src.unresolved)

    def get(self, key: str, default: Any = None) -> Any:
        """The peer's value (typed), or ``default`` when absent or unresolvable."""
        if key not in self.src.flat:
            return default
        if key not in self.used:
            self.used.add(key)
            raw = self.src.flat[key][1]
            if self._unresolved(raw):
                names = [n for n in self.src.unknown if n in str(raw)] or self.src.unknown
                why = f"depends on unknown variable(s) {', '.join(names)}; give their values to map it"
                self.res.unmapped.append((self.name(key), raw, why))
        raw = self.src.flat[key][1]
        value = None if self._unresolved(raw) else _coerce(raw)
        return default if value is None else value

    def put(self, tether_key: str, value: Any, keys: str | tuple[str, ...], note: str = "") -> None:
        keys = (keys,) if isinstance(keys, str) else keys
        shown = [self.get(k, _NOT_SET) for k in keys]
        shown = ["(not set)" if v is _NOT_SET else v for v in shown]
        section, key = tether_key.split(".")
        self.res.tether.setdefault(section, {})[key] = value
        peer_value = shown[0] if len(shown) == 1 else tuple(shown)
        peer_key = " + ".join(self.name(k) for k in keys)
        self.res.mapping.append(MappedKey(peer_key, peer_value, tether_key, value, note))

    def drop(self, key: str, why: str) -> None:
        """Lists a peer key as not mapped, with the reason (once; absent keys are ignored)."""
        if key not in self.src.flat or key in self.dropped:
            return
        self.get(key)
        self.dropped.add(key)
        if not self._unresolved(self.src.flat[key][1]):
            self.res.unmapped.append((self.name(key), self.src.flat[key][1], why))

    def problem(self, message: str) -> None:
        self.res.problems.append(ImportProblem(message))

    def simple(self, table: list[tuple[Any, ...]]) -> None:
        """Maps ``(peer key, tether key[, converter[, note]])`` rows whose peer key is set."""
        for peer_key, tether_key, *rest in table:
            convert: Callable[[Any], Any] | None = rest[0] if rest else None
            note = rest[1] if len(rest) > 1 else ""
            if not self.given(peer_key) or peer_key in self.dropped:
                self.get(peer_key)
                continue
            value = self.get(peer_key)
            try:
                value = convert(value) if convert else value
            except _Skip as why:
                self.drop(peer_key, str(why))
                continue
            self.put(tether_key, value, peer_key, note)

    def finish(self, why: Callable[[str], str]) -> None:
        for key in self.src.flat:
            if key not in self.used and self.src.flat[key][1] is not None:
                self.drop(key, why(key))  # null keys only restate the peer's default


_WHY = [
    (
        r"(^|\.)ref\.|^reference\.|^ref_",
        "reference-model placement; Tether's learner holds the frozen reference",
    ),
    (
        r"^actor_infer\.|(^|\.)rollout\.|^vllm_|^sglang_|^rollout_",
        "the peer's inference-engine settings; Tether's generator configures vLLM itself",
    ),
    (
        r"fsdp|megatron|strategy|zero_stage|offload|sequence_parallel|ulysses|_parallel_size$|"
        r"ring_attn|flash_attn|bf16|deepspeed|liger|remove_padding|fused",
        "the peer trainer's sharding/kernel settings; Tether's learner uses FSDP2 with its own",
    ),
    (
        r"(^|\.)ref\.|^reference\.|^ref_",
        "reference-model placement; Tether's learner holds the frozen reference",
    ),
    (r"critic|value_", "Tether has no critic (value model)"),
    (
        r"log_prob_|logprob",
        "log-prob recomputation batching; Tether's learner sizes it from its micro-batches",
    ),
    (
        r"logger|wandb|tensorboard|project_name|swanlab|tracker|log_",
        "experiment tracking; Tether exports Prometheus metrics",
    ),
    (
        r"reward_model|custom_reward|reward_fn|remote_rm|reward_pretrain|rm_",
        "reward set-up; choose Tether's [scorer] mode (rule or solver) instead",
    ),
    (
        r"ray|colocate|num_cpus|placement|vllm_sync|vllm_enable_sleep|hybrid_engine|sleep",
        "process placement of the peer; Tether runs generators, scorer and learner as separate services",
    ),
    (
        r"^defaults$|^hydra|config_(path|name)$",
        "Hydra composition: base configs are not read; import the composed YAML",
    ),
    (
        r"(^|_)save|ckpt|checkpoint|load_|resume|default_local_dir|output_dir",
        "checkpoint paths; set Tether's paths yourself",
    ),
]


def _why(key: str) -> str:
    for pattern, why in _WHY:
        if re.search(pattern, key):
            return why
    return "no Tether equivalent"


def _fixes(prompts: int, n: int, step: int, passes: int, knob: Callable[[int], str]) -> list[str]:
    """Valid Tether settings near the peer's: a step size dividing the cycle, or a matching cycle."""
    cycle = prompts * n
    sizes = [d for d in range(n, cycle + 1, n) if cycle % d == 0]  # whole prompt groups per step
    out = []
    for d in (
        min((d for d in sizes if d > step), default=None),
        max((d for d in sizes if d < step), default=None),
    ):
        if d:
            steps = cycle // d * passes
            out.append(
                f"train_batch_size = {d} with train_steps_per_cycle = {steps}, "
                f"prompts_per_cycle = {prompts} ({knob(d)})"
            )
    if step % n == 0:
        per_step = step // n
        low = prompts // per_step * per_step
        keep = [
            f"{k} ({k // per_step * passes} step{'s' if k // per_step * passes > 1 else ''})"
            for k in (low, low + per_step)
            if k
        ]
        out.append(
            f"keep train_batch_size = {step} and set prompts_per_cycle = " + " or ".join(keep)
        )
    return out


def _check_division(
    m: _Map,
    *,
    prompts: int,
    n: int,
    step: int,
    passes: int,
    cycle_text: str,
    step_text: str,
    behaviour: str,
    knob: Callable[[int], str],
) -> int | None:
    """Optimizer steps per cycle, or None (and a problem) when the peer's steps are unequal."""
    cycle = prompts * n
    if step > 0 and cycle % step == 0:
        return cycle // step * passes
    fixes = _fixes(prompts, n, step, passes, knob)
    listed = "; ".join(f"({chr(97 + i)}) {f}" for i, f in enumerate(fixes))
    m.problem(
        f"{m.peer}'s batch sizes do not divide evenly: {cycle_text} = {cycle} responses per cycle, "
        f"but one optimizer step takes {step_text} = {step} responses, and {cycle} is not a multiple "
        f"of {step}. {behaviour} Tether needs equal steps: prompts_per_cycle × responses_per_prompt "
        f"× passes_per_cycle = train_batch_size × train_steps_per_cycle. Valid settings: {listed}."
    )
    return None


def _per_cycle(m: _Map, key: str, tether_key: str, steps: int | None, unit: str) -> None:
    """Maps a peer "every N cycles" setting onto Tether's optimizer-step count."""
    if not m.given(key):
        return
    value = m.get(key)
    if not isinstance(value, int) or value <= 0:
        m.drop(key, "disabled in the peer config; Tether's default applies")
    elif steps is None:
        m.drop(
            key, f"counts {unit}; needs the optimizer steps per cycle, which could not be derived"
        )
    else:
        m.put(
            tether_key,
            value * steps,
            key,
            f"the peer counts {unit}; × {steps} optimizer steps per cycle",
        )


def _lr_schedule(value: Any) -> str:
    if value in ("constant", "cosine"):
        return value
    if value in ("cosine_with_min_lr", "cosine_with_warmup"):
        return "cosine"
    if value in ("constant_with_warmup",):
        return "constant"
    raise _Skip(f"Tether's lr_schedule is constant or cosine; {value!r} has no equivalent")


_KL = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
}


def _kl_type(value: Any) -> str:
    if value not in _KL:
        raise _Skip(f"Tether's kl_type is k1, k2, k3 or abs; {value!r} has no equivalent")
    return _KL[value]


def _loss_agg(value: Any) -> str:
    if value in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        return value
    raise _Skip(
        f"Tether's loss_agg is token-mean, seq-mean-token-sum or seq-mean-token-mean; "
        f"{value!r} has no equivalent"
    )


def _one_path(value: Any) -> str:
    if isinstance(value, list):
        if len(value) != 1:
            raise _Skip("Tether reads one data file per split; merge the files first")
        value = value[0]
    return str(value)


def _estimator(m: _Map, key: str, table: dict[str, str], default: str) -> str | None:
    value = m.get(key, default)
    if value in table:
        return table[value]
    origin = (
        f"{m.name(key)}={value}"
        if m.given(key)
        else f"{m.name(key)} is not set and defaults to {value}"
    )
    if value in ("gae", "ppo"):
        m.problem(
            f"{origin}: PPO with a learned critic (GAE). Tether has no critic; choose a "
            f"critic-free estimator ({', '.join(sorted(set(table.values())))}) in the peer "
            "config or set learner.advantage_estimator."
        )
    else:
        m.problem(
            f"{origin}: Tether has no such advantage estimator; choose one of "
            f"{', '.join(sorted(set(table.values())))}."
        )
    return None


def _knob(m: _Map, key: str, default: Any) -> Any:
    """A batch knob: its value, the peer's default when absent, None when unresolvable."""
    if key in m.src.flat and m._unresolved(m.src.flat[key][1]):
        m.get(key)
        return None
    return m.get(key, default)


def _default_note(m: _Map, key: str, default: Any, note: str = "") -> str:
    return note if m.given(key) else f"not set; {m.peer}'s default is {default}"


def _staleness(m: _Map, steps: int, keys: tuple[str, ...], why: str) -> None:
    m.put(
        "run.max_staleness",
        max(steps - 1, 0),
        keys,
        f"{why}: a cycle's last step trains on data {max(steps - 1, 0)} steps old; the smallest "
        "value Tether accepts. Raise it to let generation overlap training",
    )


def _kl(
    m: _Map,
    *,
    coef: str,
    kind: str | None,
    in_reward: bool,
    coef_default: float,
    kind_default: str,
    keys: tuple[str, ...],
    k3_clamp: float | None = None,
    reward_note: str = "",
) -> None:
    """Puts Tether's single KL term (coefficient, estimator, loss or reward). ``k3_clamp``: the
    bound the peer clamps its k3 estimate to (Tether's is unclamped unless kl_clamp is set)."""
    value = m.get(coef, coef_default)
    m.put("learner.kl_coef", value, (coef, *keys), _default_note(m, coef, coef_default))
    m.put("learner.kl_in_reward", in_reward, keys, reward_note if in_reward else "")
    if kind:
        try:
            kl_type = _kl_type(m.get(kind, kind_default))
            m.put("learner.kl_type", kl_type, kind, _default_note(m, kind, kind_default))
        except _Skip as why:
            m.drop(kind, str(why))
            return
        if kl_type == "k3" and k3_clamp is not None:
            m.put(
                "learner.kl_clamp",
                k3_clamp,
                kind,
                f"{m.peer} clamps its k3 (low_var_kl) estimate to [−{k3_clamp:g}, {k3_clamp:g}]",
            )


# --------------------------------------------------------------------------- verl

_A, _R, _O = (
    "actor_rollout_ref.actor.",
    "actor_rollout_ref.rollout.",
    "actor_rollout_ref.actor.optim.",
)


def _verl_world(m: _Map) -> int | None:
    if not m.given("trainer.n_gpus_per_node"):
        return None
    return m.get("trainer.n_gpus_per_node") * m.get("trainer.nnodes", 1)


def _verl_remainder(cycle: int, step: int, world: int | None) -> str:
    rem = cycle % step
    if world and cycle % world == 0 and step % world == 0:
        share, mini = cycle // world, step // world
        parts = [str(mini)] * (share // mini) + [str(share % mini)]
        split = (
            f"each of its {world} data-parallel ranks gets {share} responses and cuts them "
            f"(DataProto.split) into mini-batches of ppo_mini_batch_size × n / {world} = {mini}: "
            + " + ".join(parts)
        )
    else:
        split = (
            f"it cuts the {cycle} responses (DataProto.split) into mini-batches of {step}: "
            + " + ".join([str(step)] * (cycle // step) + [str(rem)])
        )
    return (
        f"What verl does (it raises no error): {split}; so each epoch runs {cycle // step + 1} optimizer "
        f"steps of unequal size, {step} responses then the {rem} left over, and the short step's loss "
        f"is still normalised by the full mini-batch size, so it weighs only {rem}/{step} of a full step."
    )


def _verl_batch(m: _Map) -> int | None:
    pk, nk, mk, ek = (
        "data.train_batch_size",
        _R + "n",
        _A + "ppo_mini_batch_size",
        _A + "ppo_epochs",
    )
    prompts, n, mini, passes = (
        _knob(m, pk, 1024),
        _knob(m, nk, 1),
        _knob(m, mk, 256),
        _knob(m, ek, 1),
    )
    if prompts is not None:
        m.put(
            "run.prompts_per_cycle",
            prompts,
            pk,
            _default_note(
                m, pk, 1024, "verl's data.train_batch_size counts prompts per training step"
            ),
        )
    if n is not None:
        m.put("run.responses_per_prompt", n, nk, _default_note(m, nk, 1))
    if passes is not None:
        m.put(
            "run.passes_per_cycle",
            passes,
            ek,
            _default_note(m, ek, 1, "ppo_epochs over each cycle's data"),
        )
    if None in (prompts, n, mini, passes):
        return None
    m.put(
        "run.train_batch_size",
        mini * n,
        (mk, nk),
        f"ppo_mini_batch_size counts prompts: {mini} × {n} responses",
    )
    if prompts < mini:
        m.problem(
            f"verl refuses this run: data.train_batch_size={prompts} is smaller than "
            f"ppo_mini_batch_size={mini}; lower ppo_mini_batch_size to at most {prompts}."
        )
        return None
    steps = _check_division(
        m,
        prompts=prompts,
        n=n,
        step=mini * n,
        passes=passes,
        cycle_text=f"data.train_batch_size={prompts} prompts × rollout.n={n}",
        step_text=f"ppo_mini_batch_size={mini} prompts × {n}",
        behaviour=_verl_remainder(prompts * n, mini * n, _verl_world(m)),
        knob=lambda d: f"verl: ppo_mini_batch_size={d // n}",
    )
    if steps:
        m.put(
            "run.train_steps_per_cycle",
            steps,
            (pk, mk, ek),
            f"({prompts} / {mini}) mini-batches × {passes} epochs",
        )
        _staleness(m, steps, (pk, mk, ek), "verl is synchronous")
    return steps


def _verl_micro(m: _Map) -> None:
    dyn, tok, micro, old = (
        _A + "use_dynamic_bsz",
        _A + "ppo_max_token_len_per_gpu",
        _A + "ppo_micro_batch_size_per_gpu",
        _A + "ppo_micro_batch_size",
    )
    if m.get(dyn, False):
        m.put(
            "learner.max_tokens_per_micro_batch",
            m.get(tok, 16384),
            (dyn, tok),
            _default_note(
                m, tok, 16384, "dynamic batch size: micro-batches cut by a token budget per GPU"
            ),
        )
        for key in (micro, old):
            m.drop(key, "verl ignores it when use_dynamic_bsz=True")
        return
    m.drop(tok, "only used when use_dynamic_bsz=True")
    world = _verl_world(m)
    if m.given(micro):
        m.put(
            "learner.micro_batch_size",
            m.get(micro),
            micro,
            "responses per GPU per forward/backward",
        )
    elif m.given(old) and world:
        m.put(
            "learner.micro_batch_size",
            m.get(old) // world,
            old,
            f"deprecated global size ÷ {world} GPUs",
        )


_VERL_KL_REWARD_NOTE = (
    "both subtract kl_coef × KL(sampling policy ‖ reference) from each token's reward before the "
    "estimator; reinforce_plus_plus matches, but for grpo, rloo and reinforce_plus_plus_baseline "
    "verl sums a response's penalised rewards into one score for the group rule, while Tether "
    "applies the group rule to the outcome reward and charges each token its KL-to-go "
    "(per-token advantages), so those numbers differ"
)


def _verl_algorithm(m: _Map) -> None:
    table = {
        "grpo": "grpo",
        "rloo": "rloo",
        "reinforce_plus_plus": "reinforce_pp",
        "reinforce_plus_plus_baseline": "reinforce_pp_baseline",
    }
    ek, nk = "algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo"
    est = _estimator(m, ek, table, "gae")
    norm = m.get(nk, True)
    if est == "grpo" and norm is False:
        m.put(
            "learner.advantage_estimator",
            "drgrpo",
            (ek, nk),
            "GRPO without std normalisation is Dr.GRPO",
        )
    elif est:
        m.put("learner.advantage_estimator", est, ek)
    if m.given(nk) and est == "grpo":
        m.put("learner.norm_adv_by_std", norm, nk)
    elif est:
        m.drop(nk, "verl only applies it to grpo")
    if (est == "grpo" and norm is not False) or est in ("reinforce_pp", "reinforce_pp_baseline"):
        why = "verl divides by the unbiased (n − 1) std: torch.std of each group in GRPO"
        if est != "grpo":
            why = (
                "verl divides by the unbiased (n − 1) std: masked_whiten over tokens in REINFORCE++ "
                "(Tether whitens over sequences unless KL is in the reward, then over tokens)"
            )
        m.put("learner.std_estimator", "unbiased", ek, why)
    low, high, base = _A + "clip_ratio_low", _A + "clip_ratio_high", _A + "clip_ratio"
    for key, tkey in ((low, "learner.clip_low"), (high, "learner.clip_high")):
        src = key if m.given(key) else base
        if m.given(src):
            m.put(tkey, m.get(src), src)
    m.simple(
        [
            (
                _A + "clip_ratio_c",
                "learner.dual_clip",
                None,
                "verl always applies dual clip (default 3.0)",
            ),
            (_A + "entropy_coeff", "learner.entropy_coef"),
            (_A + "loss_agg_mode", "learner.loss_agg", _loss_agg),
        ]
    )
    loss, reward = m.get(_A + "use_kl_loss", False), m.get("algorithm.use_kl_in_reward", False)
    reward_keys = (
        "algorithm.use_kl_in_reward",
        "algorithm.kl_ctrl.kl_coef",
        "algorithm.kl_penalty",
        "algorithm.kl_ctrl.type",
    )
    if loss:
        _kl(
            m,
            coef=_A + "kl_loss_coef",
            kind=_A + "kl_loss_type",
            in_reward=False,
            coef_default=0.001,
            kind_default="low_var_kl",
            keys=(_A + "use_kl_loss",),
            k3_clamp=10.0,
        )
        for key in reward_keys:
            m.drop(
                key,
                "verl also subtracts a KL penalty from the reward; Tether applies KL one way "
                "only, so the KL loss was kept and this reward penalty dropped",
            )
    elif reward:
        _kl(
            m,
            coef="algorithm.kl_ctrl.kl_coef",
            kind="algorithm.kl_penalty",
            in_reward=True,
            coef_default=0.001,
            kind_default="kl",
            keys=("algorithm.use_kl_in_reward",),
            k3_clamp=10.0,
            reward_note=_VERL_KL_REWARD_NOTE,
        )
        m.drop(
            "algorithm.kl_ctrl.type", "Tether's KL coefficient is fixed (no adaptive controller)"
        )
    elif m.given(_A + "use_kl_loss") or m.given("algorithm.use_kl_in_reward"):
        m.put(
            "learner.kl_coef",
            0.0,
            (_A + "use_kl_loss", "algorithm.use_kl_in_reward"),
            "no KL term in verl",
        )


def _verl_data(m: _Map) -> None:
    m.simple(
        [
            ("data.train_files", "data.train_path", _one_path),
            ("data.val_files", "data.eval_path", _one_path),
            ("data.prompt_key", "data.prompt_key"),
            ("data.max_prompt_length", "run.max_prompt_tokens"),
            ("data.max_response_length", "run.max_response_tokens"),
            ("data.seed", "run.seed"),
            ("trainer.experiment_name", "run.name", str),
            ("actor_rollout_ref.model.path", "run.model", str),
        ]
    )
    fk, tk = "data.filter_overlong_prompts", "data.truncation"
    if m.get(fk, False):
        m.put(
            "data.overlong_prompt_policy",
            "drop",
            (fk, tk),
            "over-long prompts are filtered out when the data is loaded, so truncation never fires",
        )
    elif m.get(tk, "error") == "error" and (m.given(fk) or m.given(tk)):
        m.put("data.overlong_prompt_policy", "error", (fk, tk))
    else:
        for key in (fk, tk):
            m.drop(
                key, "verl truncates over-long prompts; Tether never does: choose 'drop' or 'error'"
            )


def _verl_rest(m: _Map, steps: int | None) -> None:
    m.simple(
        [
            (_O + "lr", "learner.lr"),
            (_O + "weight_decay", "learner.weight_decay"),
            (_O + "lr_warmup_steps_ratio", "learner.warmup_ratio"),
            (_O + "min_lr_ratio", "learner.min_lr_ratio"),
            (_O + "warmup_style", "learner.lr_schedule", _lr_schedule),
            (_O + "lr_scheduler_type", "learner.lr_schedule", _lr_schedule),
            (_A + "grad_clip", "learner.grad_clip"),
            (
                "actor_rollout_ref.model.enable_gradient_checkpointing",
                "learner.gradient_checkpointing",
                bool,
            ),
            (_R + "temperature", "generator.temperature"),
            (_R + "top_p", "generator.top_p"),
            (_R + "top_k", "generator.top_k", None, "-1 disables top-k"),
            (_R + "gpu_memory_utilization", "generator.gpu_memory_utilization"),
            ("trainer.nnodes", "learner.nnodes"),
            (
                "trainer.n_gpus_per_node",
                "learner.nproc_per_node",
                None,
                "verl's hybrid engine also runs rollout here",
            ),
        ]
    )
    _per_cycle(
        m,
        _O + "lr_warmup_steps",
        "learner.warmup_steps",
        steps,
        "LR-scheduler steps, one per cycle",
    )
    tp, world = _R + "tensor_model_parallel_size", _verl_world(m)
    if m.given(tp):
        m.put("generator.tensor_parallel_size", m.get(tp), tp)
        m.put("generator.gpus_per_replica", m.get(tp), tp)
        if world:
            m.put(
                "generator.replicas",
                world // m.get(tp),
                (tp, "trainer.n_gpus_per_node", "trainer.nnodes"),
                "verl time-shares the training GPUs with rollout; Tether generators need GPUs of their own",
            )
    dk, vk = _R + "val_kwargs.do_sample", _R + "val_kwargs.temperature"
    if m.given(dk) or m.given(vk):
        greedy = not m.get(dk, False)
        m.put(
            "generator.eval_temperature",
            0.0 if greedy else m.get(vk, 0),
            (dk, vk),
            "val_kwargs.do_sample is False (verl's default): validation is greedy"
            if greedy
            else "",
        )
    total, epochs = "trainer.total_training_steps", "trainer.total_epochs"
    if m.given(total):
        m.put("run.num_cycles", m.get(total), total, "verl's training steps are cycles")
        m.drop(
            epochs,
            "verl stops at total_training_steps or after total_epochs passes over the data, "
            "whichever comes first; the step count was kept",
        )
    m.drop(
        epochs,
        "num_cycles = total_epochs × ⌊dataset prompts / data.train_batch_size⌋ depends on the "
        "dataset size; set run.num_cycles",
    )
    _per_cycle(m, "trainer.test_freq", "learner.eval_every_steps", steps, "training steps (cycles)")
    _per_cycle(
        m, "trainer.save_freq", "learner.checkpoint_every_steps", steps, "training steps (cycles)"
    )
    for name, value in m.src.env.items():
        if name.endswith("SOLVER_MODEL") and value:
            m.src.flat["$" + name] = ("$" + name, value)
            m.put(
                "scorer.mode",
                "solver",
                "$" + name,
                "the script's solver-reward variable (not a verl key)",
            )
            m.put("scorer.solver_model", value, "$" + name)


def _map_verl(m: _Map) -> None:
    steps = _verl_batch(m)
    _verl_micro(m)
    _verl_algorithm(m)
    _verl_data(m)
    _verl_rest(m, steps)


# --------------------------------------------------------------------------- OpenRLHF


def _map_openrlhf(m: _Map) -> None:
    pk, nk, tk, ek = "rollout_batch_size", "n_samples_per_prompt", "train_batch_size", "max_epochs"
    prompts, n, step, passes = (
        _knob(m, pk, 1024),
        _knob(m, nk, 1),
        _knob(m, tk, 128),
        _knob(m, ek, 1),
    )
    for key, tkey, value, default, note in (
        (pk, "run.prompts_per_cycle", prompts, 1024, "prompts per rollout batch"),
        (nk, "run.responses_per_prompt", n, 1, ""),
        (
            tk,
            "run.train_batch_size",
            step,
            128,
            "OpenRLHF's --train_batch_size counts responses (all GPUs)",
        ),
        (ek, "run.passes_per_cycle", passes, 1, ""),
    ):
        if value is not None:
            m.put(tkey, value, key, _default_note(m, key, default, note))
    steps = None
    if None not in (prompts, n, step, passes):
        micro = m.get("micro_train_batch_size", 8)
        behaviour = (
            f"What OpenRLHF does: each GPU walks its share in micro-batches of {micro} and DeepSpeed steps "
            f"the optimizer every {step} responses, counting micro-batches across epochs and cycles, so the "
            f"{prompts * n % step} responses left over are accumulated into the first step of the next epoch "
            "or cycle (mixing two batches) and step boundaries drift (with --use_dynamic_batch they are "
            "dropped instead)."
        )
        steps = _check_division(
            m,
            prompts=prompts,
            n=n,
            step=step,
            passes=passes,
            cycle_text=f"--rollout_batch_size {prompts} × --n_samples_per_prompt {n}",
            step_text="--train_batch_size",
            behaviour=behaviour,
            knob=lambda d: f"OpenRLHF: --train_batch_size {d}",
        )
    if steps:
        m.put(
            "run.train_steps_per_cycle",
            steps,
            (pk, nk, tk, ek),
            f"{prompts} × {n} / {step} × {passes} epochs",
        )
    if m.get("async_train", False):
        queue = m.get("async_queue_size", 1)
        bound = (
            f"{queue * steps + steps - 1}"
            if steps
            else f"{queue} × train_steps_per_cycle + train_steps_per_cycle − 1"
        )
        m.drop(
            "async_train",
            f"OpenRLHF keeps up to {queue} rollout batch(es) queued ahead of training; "
            f"the matching Tether setting is run.max_staleness ≥ {bound}",
        )
        m.drop("async_queue_size", "see --async_train")
    elif steps:
        _staleness(m, steps, (pk, tk), "OpenRLHF (without --async_train) is synchronous")
    _openrlhf_rest(m, steps)


def _openrlhf_rest(m: _Map, steps: int | None) -> None:
    m.simple(
        [
            ("pretrain", "run.model", str),
            ("prompt_data", "data.train_path", _one_path),
            ("eval_dataset", "data.eval_path", _one_path),
            ("input_key", "data.prompt_key"),
            ("label_key", "data.answer_key"),
            ("seed", "run.seed"),
            ("prompt_max_len", "run.max_prompt_tokens"),
            ("generate_max_len", "run.max_response_tokens"),
            ("max_new_tokens", "run.max_response_tokens"),
            ("temperature", "generator.temperature"),
            ("top_p", "generator.top_p"),
            ("top_k", "generator.top_k"),
            ("eval_temperature", "generator.eval_temperature"),
            ("vllm_num_engines", "generator.replicas"),
            ("vllm_tensor_parallel_size", "generator.tensor_parallel_size"),
            ("vllm_gpu_memory_utilization", "generator.gpu_memory_utilization"),
            ("actor_num_nodes", "learner.nnodes"),
            ("actor_num_gpus_per_node", "learner.nproc_per_node"),
            ("actor_learning_rate", "learner.lr"),
            ("l2", "learner.weight_decay"),
            ("lr_warmup_ratio", "learner.warmup_ratio"),
            ("max_norm", "learner.grad_clip"),
            ("micro_train_batch_size", "learner.micro_batch_size", None, "responses per GPU"),
            ("gradient_checkpointing", "learner.gradient_checkpointing", bool),
            ("entropy_loss_coef", "learner.entropy_coef"),
            ("dual_clip", "learner.dual_clip"),
        ]
    )
    if m.given("vllm_tensor_parallel_size"):
        m.put(
            "generator.gpus_per_replica",
            m.get("vllm_tensor_parallel_size"),
            "vllm_tensor_parallel_size",
        )
    if m.given("actor_learning_rate"):
        sched = m.get("lr_scheduler", "cosine_with_min_lr")
        try:
            m.put(
                "learner.lr_schedule",
                _lr_schedule(sched),
                "lr_scheduler",
                _default_note(m, "lr_scheduler", "cosine_with_min_lr"),
            )
            if sched == "cosine_with_min_lr":
                m.put(
                    "learner.min_lr_ratio",
                    0.1,
                    "lr_scheduler",
                    "OpenRLHF decays to 0.1 × the learning rate",
                )
        except _Skip as why:
            m.drop("lr_scheduler", str(why))
    pair = m.get("eps_clip_low_high")
    if isinstance(pair, list) and len(pair) == 2:
        m.put("learner.clip_low", _coerce(pair[0]), "eps_clip_low_high")
        m.put("learner.clip_high", _coerce(pair[1]), "eps_clip_low_high")
        m.drop("eps_clip", "overridden by --eps_clip_low_high")
    elif m.given("eps_clip"):
        m.put("learner.clip_low", m.get("eps_clip"), "eps_clip")
        m.put("learner.clip_high", m.get("eps_clip"), "eps_clip")
    if m.given("init_kl_coef") or m.given("use_kl_loss") or m.given("kl_estimator"):
        loss = bool(m.get("use_kl_loss", False))
        _kl(
            m,
            coef="init_kl_coef",
            kind="kl_estimator",
            in_reward=not loss,
            coef_default=0.01,
            kind_default="k1",
            keys=("use_kl_loss",),
        )
    table = {
        "reinforce": "reinforce_pp",
        "rloo": "rloo",
        "reinforce_baseline": "reinforce_pp_baseline",
        "group_norm": "grpo",
        "dr_grpo": "drgrpo",
    }
    est = _estimator(m, "advantage_estimator", table, "gae")
    if est:
        m.put("learner.advantage_estimator", est, "advantage_estimator")
    if est == "grpo":
        m.put(
            "learner.std_estimator",
            "unbiased",
            "advantage_estimator",
            "OpenRLHF's group_norm divides by the unbiased (n − 1) std of each group",
        )
    if m.get("use_dynamic_batch", False) and m.given("train_max_tokens_per_gpu"):
        m.put(
            "learner.max_tokens_per_micro_batch",
            m.get("train_max_tokens_per_gpu"),
            ("use_dynamic_batch", "train_max_tokens_per_gpu"),
        )
    m.drop(
        "packing_samples",
        "Tether packs sequences itself; size micro-batches by tokens with "
        "learner.max_tokens_per_micro_batch",
    )
    m.drop(
        "num_episodes",
        "num_cycles = num_episodes × ⌊dataset prompts / --rollout_batch_size⌋ depends on "
        "the dataset size; set run.num_cycles",
    )
    _per_cycle(m, "save_steps", "learner.checkpoint_every_steps", steps, "rollout batches (cycles)")
    _per_cycle(m, "eval_steps", "learner.eval_every_steps", steps, "rollout batches (cycles)")


# --------------------------------------------------------------------------- slime

_SLIME_NEW = {
    "prompts_per_cycle": "rollout_batch_size",
    "responses_per_prompt": "n_samples_per_prompt",
    "train_batch_size": "global_batch_size",
    "train_steps_per_cycle": "num_steps_per_rollout",
    "num_cycles": "num_rollout",
}


def _map_slime(m: _Map) -> None:
    for new, old in _SLIME_NEW.items():  # slime's proposed names, should a script already use them
        if new in m.src.flat and old not in m.src.flat:
            m.src.flat[old] = m.src.flat.pop(new)
    pk, nk, gk, sk = (
        "rollout_batch_size",
        "n_samples_per_prompt",
        "global_batch_size",
        "num_steps_per_rollout",
    )
    prompts, n = _knob(m, pk, None), _knob(m, nk, 1)
    if prompts is not None:
        m.put("run.prompts_per_cycle", prompts, pk)
    if n is not None:
        m.put("run.responses_per_prompt", n, nk, _default_note(m, nk, 1))
    m.put("run.passes_per_cycle", 1, (), "slime passes over a cycle's data once")
    step, steps = None, None
    if prompts is not None and n is not None and m.given(sk):
        step = prompts * n // m.get(sk)
        if m.given(gk) and m.get(gk) != step:
            m.problem(
                f"slime refuses this run: --global-batch-size {m.get(gk)} is not "
                f"--rollout-batch-size {prompts} × --n-samples-per-prompt {n} // "
                f"--num-steps-per-rollout {m.get(sk)} = {step}; drop one of the two."
            )
            return _slime_rest(m, None)
    elif m.given(gk):
        step = m.get(gk)
    if step:
        m.put(
            "run.train_batch_size",
            step,
            gk if m.given(gk) else (pk, nk, sk),
            "responses per optimizer step",
        )
    if step and prompts is not None and n is not None:
        rem, q = prompts * n % step, prompts * n // step
        behaviour = (
            f"What slime does: it runs ⌊{prompts * n}/{step}⌋ = {q} optimizer step(s) of {step} "
            f"responses and drops the {rem} trailing responses of every cycle: they are generated "
            "and scored but never trained on."
        )
        steps = _check_division(
            m,
            prompts=prompts,
            n=n,
            step=step,
            passes=1,
            cycle_text=f"--rollout-batch-size {prompts} × --n-samples-per-prompt {n}",
            step_text="--global-batch-size",
            behaviour=behaviour,
            knob=lambda d: f"slime: --global-batch-size {d}",
        )
    if steps:
        m.put("run.train_steps_per_cycle", steps, sk if m.given(sk) else (pk, nk, gk))
        if "async" in m.src.entry:
            m.res.unmapped.append(
                (
                    m.src.entry,
                    "(entry point)",
                    "generates the next cycle while training "
                    f"on this one; set run.max_staleness ≥ {2 * steps - 1} to match",
                )
            )
        else:
            _staleness(m, steps, (pk, gk), "slime's train.py is synchronous")
    return _slime_rest(m, steps)


def _slime_rest(m: _Map, steps: int | None) -> None:
    m.simple(
        [
            ("hf_checkpoint", "run.model", str),
            ("prompt_data", "data.train_path", _one_path),
            ("input_key", "data.prompt_key"),
            ("label_key", "data.answer_key"),
            ("seed", "run.seed"),
            ("num_rollout", "run.num_cycles", None, "slime's rollouts are cycles"),
            ("rollout_max_prompt_len", "run.max_prompt_tokens"),
            ("rollout_max_response_len", "run.max_response_tokens"),
            ("rollout_temperature", "generator.temperature"),
            ("rollout_top_p", "generator.top_p"),
            ("rollout_top_k", "generator.top_k"),
            ("eval_temperature", "generator.eval_temperature"),
            ("rollout_num_gpus_per_engine", "generator.tensor_parallel_size"),
            (
                "sglang_mem_fraction_static",
                "generator.gpu_memory_utilization",
                None,
                "SGLang's static memory fraction",
            ),
            ("actor_num_nodes", "learner.nnodes"),
            ("actor_num_gpus_per_node", "learner.nproc_per_node"),
            ("lr", "learner.lr"),
            ("weight_decay", "learner.weight_decay"),
            (
                "lr_warmup_iters",
                "learner.warmup_steps",
                None,
                "Megatron iterations are optimizer steps",
            ),
            ("lr_warmup_fraction", "learner.warmup_ratio"),
            ("lr_decay_style", "learner.lr_schedule", _lr_schedule),
            ("clip_grad", "learner.grad_clip"),
            ("micro_batch_size", "learner.micro_batch_size"),
            ("entropy_coef", "learner.entropy_coef"),
            ("eps_clip_c", "learner.dual_clip"),
        ]
    )
    gpe = m.get("rollout_num_gpus_per_engine", 1)
    if m.given("rollout_num_gpus_per_engine") or m.given("rollout_num_gpus"):
        m.put(
            "generator.gpus_per_replica",
            gpe,
            "rollout_num_gpus_per_engine",
            _default_note(m, "rollout_num_gpus_per_engine", 1),
        )
    if m.given("rollout_num_gpus"):
        m.put(
            "generator.replicas",
            m.get("rollout_num_gpus") // gpe,
            ("rollout_num_gpus", "rollout_num_gpus_per_engine"),
        )
    if m.given("min_lr") and m.given("lr") and m.get("lr"):
        m.put(
            "learner.min_lr_ratio",
            m.get("min_lr") / m.get("lr"),
            ("min_lr", "lr"),
            "--min-lr / --lr",
        )
    eval_data = m.get("eval_prompt_data")
    if isinstance(eval_data, list) and len(eval_data) == 2:
        m.put(
            "data.eval_path",
            str(eval_data[1]),
            "eval_prompt_data",
            f"the {eval_data[0]!r} eval set",
        )
    if m.given("eps_clip") or m.given("eps_clip_high"):
        low = m.get("eps_clip", 0.2)
        m.put("learner.clip_low", low, "eps_clip", _default_note(m, "eps_clip", 0.2))
        m.put(
            "learner.clip_high",
            m.get("eps_clip_high", low),
            "eps_clip_high" if m.given("eps_clip_high") else "eps_clip",
        )
    if m.get("use_kl_loss", False):
        _kl(
            m,
            coef="kl_loss_coef",
            kind="kl_loss_type",
            in_reward=False,
            coef_default=0.0,
            kind_default="k1",
            keys=("use_kl_loss",),
        )
        if m.get("kl_coef", 0.0):
            m.drop(
                "kl_coef",
                "slime also puts a KL penalty in the reward; Tether applies KL one way only, "
                "so the KL loss was kept",
            )
    elif m.get("kl_coef", 0.0):
        _kl(
            m,
            coef="kl_coef",
            kind=None,
            in_reward=True,
            coef_default=0.0,
            kind_default="k1",
            keys=(),
        )
    table = {
        "grpo": "grpo",
        "reinforce_plus_plus": "reinforce_pp",
        "reinforce_plus_plus_baseline": "reinforce_pp_baseline",
    }
    est = _estimator(m, "advantage_estimator", table, "grpo")
    no_std = m.get("disable_grpo_std_normalization", False)
    if est == "grpo" and no_std:
        m.put(
            "learner.advantage_estimator",
            "drgrpo",
            ("advantage_estimator", "disable_grpo_std_normalization"),
        )
        m.put("learner.norm_adv_by_std", False, "disable_grpo_std_normalization")
    elif est:
        m.put(
            "learner.advantage_estimator",
            est,
            "advantage_estimator",
            _default_note(m, "advantage_estimator", "grpo"),
        )
    if m.get("use_dynamic_batch_size", False) and m.given("max_tokens_per_gpu"):
        m.put(
            "learner.max_tokens_per_micro_batch",
            m.get("max_tokens_per_gpu"),
            ("use_dynamic_batch_size", "max_tokens_per_gpu"),
        )
    if m.given("recompute_granularity"):
        m.put(
            "learner.gradient_checkpointing",
            True,
            "recompute_granularity",
            "Megatron activation recompute",
        )
    m.drop(
        "num_epoch",
        "num_cycles from dataset epochs depends on the dataset size; set run.num_cycles",
    )
    _per_cycle(m, "save_interval", "learner.checkpoint_every_steps", steps, "rollouts (cycles)")
    _per_cycle(m, "eval_interval", "learner.eval_every_steps", steps, "rollouts (cycles)")


# --------------------------------------------------------------------------- ROLL

_T = "actor_train."


def _roll_step(m: _Map) -> tuple[int | None, str, tuple[str, ...]]:
    """ROLL's responses per optimizer step: per_device × grad_accum × world / (tp × pp × cp × ulysses)."""
    sc = _T + "strategy_args.strategy_config."
    pd_k, ga_k, dm_k = (
        _T + "training_args.per_device_train_batch_size",
        _T + "training_args.gradient_accumulation_steps",
        _T + "device_mapping",
    )
    split_keys = (
        sc + "tensor_model_parallel_size",
        sc + "pipeline_model_parallel_size",
        sc + "context_parallel_size",
        _T + "model_args.ulysses_size",
    )
    pd, ga = _knob(m, pd_k, 8), _knob(m, ga_k, 1)
    world = _device_count(m.get(dm_k))
    splits = [_knob(m, k, 1) for k in split_keys]
    keys = (pd_k, ga_k, dm_k) + tuple(k for k in split_keys if m.given(k))
    if world is None:
        m.drop(dm_k, "could not count its devices; write it as a list or list(range(a, b))")
    if None in (pd, ga, world, *splits):
        return None, "", keys
    denom = splits[0] * splits[1] * splits[2] * splits[3]
    text = (
        f"per_device_train_batch_size {pd} × gradient_accumulation_steps {ga} × {world} GPUs / "
        f"(tp {splits[0]} × pp {splits[1]} × cp {splits[2]} × ulysses {splits[3]})"
    )
    if pd * ga * world % denom:
        m.problem(
            f"ROLL's global train batch {text} = {pd * ga * world / denom:g} is not a whole number; "
            "make the device count a multiple of the model-parallel sizes."
        )
        return None, text, keys
    return pd * ga * world // denom, text, keys


def _map_roll(m: _Map) -> None:
    pk, nk, ek = "rollout_batch_size", "num_return_sequences_in_group", "ppo_epochs"
    prompts, n, passes = _knob(m, pk, 128), _knob(m, nk, 1), _knob(m, ek, 1)
    for key, tkey, value, default in (
        (pk, "run.prompts_per_cycle", prompts, 128),
        (nk, "run.responses_per_prompt", n, 1),
        (ek, "run.passes_per_cycle", passes, 1),
    ):
        if value is not None:
            m.put(tkey, value, key, _default_note(m, key, default))
    step, text, keys = _roll_step(m)
    steps = None
    if step:
        m.put("run.train_batch_size", step, keys, f"{text} = {step} responses")
    if step and None not in (prompts, n, passes):
        behaviour = (
            "What ROLL does: each rank's share must divide by per_device_train_batch_size × "
            "gradient_accumulation_steps (DataProto.make_iterator asserts it), so this run stops with "
            "an AssertionError at its first training step."
        )
        steps = _check_division(
            m,
            prompts=prompts,
            n=n,
            step=step,
            passes=passes,
            cycle_text=f"rollout_batch_size {prompts} × num_return_sequences_in_group {n}",
            step_text=text,
            behaviour=behaviour,
            knob=lambda d: f"ROLL: gradient_accumulation_steps giving {d} responses per step",
        )
    if steps:
        m.put("run.train_steps_per_cycle", steps, (pk, nk, ek, *keys[:2]))
        ratio = m.get("async_generation_ratio", 0)
        if ratio:
            m.drop(
                "async_generation_ratio",
                f"ROLL generates up to {ratio} cycle(s) ahead of training; set "
                f"run.max_staleness ≥ {int(-(-ratio // 1)) * steps + steps - 1} to match",
            )
        else:
            _staleness(m, steps, (pk, nk), "ROLL without async_generation_ratio is synchronous")
    _roll_rest(m, steps)


def _roll_rest(m: _Map, steps: int | None) -> None:
    ta, gen, infer = _T + "training_args.", "actor_infer.generating_args.", "actor_infer."
    m.simple(
        [
            ("pretrain", "run.model", str),
            (_T + "model_args.model_name_or_path", "run.model", str),
            ("seed", "run.seed"),
            ("exp_name", "run.name", str),
            ("max_steps", "run.num_cycles", None, "ROLL's pipeline steps are cycles"),
            ("prompt_length", "run.max_prompt_tokens"),
            ("response_length", "run.max_response_tokens"),
            (_T + "data_args.file_name", "data.train_path", _one_path),
            (_T + "data_args.prompt", "data.prompt_key"),
            ("validation.data_args.file_name", "data.eval_path", _one_path),
            (gen + "temperature", "generator.temperature"),
            (gen + "top_p", "generator.top_p"),
            (gen + "top_k", "generator.top_k"),
            ("validation.generating_args.temperature", "generator.eval_temperature"),
            (
                infer + "strategy_args.strategy_config.gpu_memory_utilization",
                "generator.gpu_memory_utilization",
            ),
            (ta + "learning_rate", "learner.lr"),
            (ta + "weight_decay", "learner.weight_decay"),
            (ta + "warmup_steps", "learner.warmup_steps"),
            (ta + "warmup_ratio", "learner.warmup_ratio"),
            (ta + "lr_scheduler_type", "learner.lr_schedule", _lr_schedule),
            (ta + "max_grad_norm", "learner.grad_clip"),
            (
                ta + "per_device_train_batch_size",
                "learner.micro_batch_size",
                None,
                "responses per GPU",
            ),
            ("entropy_loss_coef", "learner.entropy_coef"),
            ("loss_agg_mode", "learner.loss_agg", _loss_agg),
        ]
    )
    m.drop(
        "actor_infer.generating_args.max_new_tokens",
        "Tether uses run.max_response_tokens (ROLL's response_length)",
    )
    gc = _T + "model_args.disable_gradient_checkpointing"
    if m.given(gc):
        m.put("learner.gradient_checkpointing", not m.get(gc), gc)
    world, gpn = _device_count(m.get(_T + "device_mapping")), m.get("num_gpus_per_node", 8)
    if world:
        nnodes = -(-world // gpn)
        m.put(
            "learner.nnodes",
            nnodes,
            (_T + "device_mapping", "num_gpus_per_node"),
            f"{world} GPUs, {gpn} per node",
        )
        m.put(
            "learner.nproc_per_node", min(world, gpn), (_T + "device_mapping", "num_gpus_per_node")
        )
    infer_n, gpw = (
        _device_count(m.get(infer + "device_mapping")),
        m.get(infer + "num_gpus_per_worker", 1),
    )
    if infer_n:
        m.put(
            "generator.gpus_per_replica",
            gpw,
            infer + "num_gpus_per_worker",
            _default_note(m, infer + "num_gpus_per_worker", 1),
        )
        m.put("generator.tensor_parallel_size", gpw, infer + "num_gpus_per_worker")
        m.put(
            "generator.replicas",
            infer_n // gpw,
            (infer + "device_mapping", infer + "num_gpus_per_worker"),
        )
    low, high = (
        ("pg_clip_low", "pg_clip_high")
        if m.get("use_pg_clip_range", False)
        else ("pg_clip", "pg_clip")
    )
    if m.given(low) or m.given(high):
        m.put("learner.clip_low", m.get(low, 0.2), low)
        m.put("learner.clip_high", m.get(high, 0.2), high)
    if m.get("use_kl_loss", False):
        _kl(
            m,
            coef="kl_loss_coef",
            kind="kl_penalty",
            in_reward=False,
            coef_default=0.0,
            kind_default="kl",
            keys=("use_kl_loss",),
        )
    elif m.get("add_token_level_kl", False):
        _kl(
            m,
            coef="init_kl_coef",
            kind="kl_penalty",
            in_reward=True,
            coef_default=0.2,
            kind_default="kl",
            keys=("add_token_level_kl",),
        )
    est = _estimator(m, "adv_estimator", {"grpo": "grpo"}, "gae")
    if est:
        m.put("learner.advantage_estimator", est, "adv_estimator")
    _per_cycle(m, "save_steps", "learner.checkpoint_every_steps", steps, "pipeline steps (cycles)")
    _per_cycle(m, "eval_steps", "learner.eval_every_steps", steps, "pipeline steps (cycles)")


# --------------------------------------------------------------------------- public API

_MAPPERS = {"verl": _map_verl, "openrlhf": _map_openrlhf, "slime": _map_slime, "roll": _map_roll}


def import_peer_config(
    peer: str, path: str | Path, *, variables: Mapping[str, str] | None = None
) -> ImportResult:
    """Reads a peer's launch script or YAML config at ``path`` and maps it onto Tether's keys.

    ``variables`` are the shell/``oc.env`` variables known to the caller (the script's own
    assignments override them, as bash would). Raises ValueError for an unknown peer or an
    unreadable file; everything about the config itself is reported in the result.
    """
    if peer not in _MAPPERS:
        raise ValueError(
            f"unknown peer {peer!r} for config import; choose one of {', '.join(PEERS)}."
        )
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(
            f"cannot read {path}: {exc.strerror}; check the path given to --from {peer}."
        ) from None
    variables = dict(variables or {})
    if path.suffix in (".yaml", ".yml"):
        src = _read_yaml(text, variables, path)
    else:
        src = _read_script(peer, text, variables)
    result = ImportResult(peer=peer, source=str(path), unknown_variables=list(src.unknown))
    result.problems.extend(ImportProblem(p) for p in src.problems)
    if not src.problems:
        mapper = _Map(peer, src, result)
        _MAPPERS[peer](mapper)
        mapper.finish(_why)
    return result


_ORDER = {
    "run": [
        "name",
        "seed",
        "model",
        "prompts_per_cycle",
        "responses_per_prompt",
        "train_batch_size",
        "train_steps_per_cycle",
        "num_cycles",
        "passes_per_cycle",
        "max_staleness",
        "max_prompt_tokens",
        "max_response_tokens",
    ],
    "data": ["train_path", "eval_path", "prompt_key", "answer_key", "overlong_prompt_policy"],
    "generator": [
        "replicas",
        "gpus_per_replica",
        "tensor_parallel_size",
        "temperature",
        "top_p",
        "top_k",
        "gpu_memory_utilization",
        "eval_temperature",
    ],
    "scorer": ["mode", "solver_model"],
    "learner": [
        "nnodes",
        "nproc_per_node",
        "lr",
        "weight_decay",
        "warmup_steps",
        "warmup_ratio",
        "lr_schedule",
        "min_lr_ratio",
        "grad_clip",
        "micro_batch_size",
        "max_tokens_per_micro_batch",
        "gradient_checkpointing",
        "advantage_estimator",
        "norm_adv_by_std",
        "std_estimator",
        "clip_low",
        "clip_high",
        "dual_clip",
        "loss_agg",
        "entropy_coef",
        "kl_coef",
        "kl_type",
        "kl_in_reward",
        "kl_clamp",
        "eval_every_steps",
        "checkpoint_every_steps",
    ],
}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # Python's float repr (1e-06, inf, nan) is valid TOML
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)


def render_toml(result: ImportResult) -> str:
    """The mapped settings as a Tether TOML file, with a header saying where they came from."""
    lines = [
        f"# Tether config imported from {result.peer}: {result.source}",
        "# by `tether config import`; the mapping table lists what was not mapped and why.",
    ]
    lines += [f"# PROBLEM: {p.message}" for p in result.problems]
    if result.unknown_variables:
        lines.append(
            "# unknown variables (their settings were not mapped): "
            + ", ".join(result.unknown_variables)
        )
    for section in _ORDER:
        values = {k: v for k, v in result.tether.get(section, {}).items() if v is not None}
        if not values:
            continue
        keys = [k for k in _ORDER[section] if k in values] + [
            k for k in values if k not in _ORDER[section]
        ]
        lines += ["", f"[{section}]"] + [f"{k} = {_toml_value(values[k])}" for k in keys]
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def render_mapping_table(result: ImportResult) -> str:
    """Plain text: each peer key and value → the Tether key and value, with a note; then the rest."""
    lines = [
        f"{result.peer} → Tether ({result.source})",
        "Mapped (peer key = value → Tether key = value):",
    ]
    for r in result.mapping:
        note = f"   ({r.note})" if r.note else ""
        lines.append(f"  {r.peer_key} = {_cell(r.peer_value)}" if r.peer_key else "  (no peer key)")
        lines.append(f"      → {r.tether_key} = {_cell(r.tether_value)}{note}")
    if result.unmapped:
        lines += ["", "Not mapped:"] + [
            f"  {k} = {_cell(v)}: {why}" for k, v, why in result.unmapped
        ]
    if result.unknown_variables:
        lines += [
            "",
            "Unknown variables (give their values to map the settings that use them): "
            + ", ".join(result.unknown_variables),
        ]
    if result.problems:
        lines += ["", "Problems:"] + [f"  - {p.message}" for p in result.problems]
    return "\n".join(lines) + "\n"
