"""Reads a launch script: the training command's words, with the script's variables applied.

A small bash-like lexer (quotes, ``\\`` continuations, comments, ``NAME=value`` / ``export``,
arrays ``A=( ... )`` and ``${A[@]}``, ``${V:-default}``, integer ``$(( ))``); it never runs
anything. Full-line comments inside a continued command are skipped, as the script's author
meant, although bash itself would end the command there.

Why not a library: ``bashlex`` (0.18) refuses the peers' own scripts, which use bash arrays
(slime's ``ARGS=( ... )``: "unexpected token '('"), integer arithmetic (``$(( ))``:
NotImplementedError) and a command substitution nested in double quotes (the first line of
slime's examples), and it expands nothing (``${V:-d}`` comes back as text). ``shlex`` in POSIX
mode removes the quotes while it splits, so ``'$X'`` (literal), ``"$X"`` (one word) and ``$X``
(split into words) can no longer be told apart when the variables are expanded. In non-POSIX
mode (``shlex.shlex(text, posix=False, punctuation_chars=True)``) it keeps the quotes and knows
``&&``, ``|`` and ``;``, but it recognises quotes only at the start of a word: ``--x="a b"``
comes back as the two words ``--x="a`` and ``b"``, and a quoted command substitution with quotes
inside (``"$(date "+%s")"``) fails with "No closing quotation". Peers' scripts are full of both
(``tests/unit/test_config_import_slime_roll.py`` checks them). What is left to write either way
is this scanner.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tether.config_import.sources import Source

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"


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


def parse_flags(args: list[str], *, max_values: int | None = None) -> dict[str, tuple[str, Any]]:
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


def read_script(peer: str, text: str, variables: Mapping[str, str]) -> Source:
    shell = _Shell(text, variables)
    commands = shell.commands()
    pattern = re.compile(_ENTRY.get(peer, r"$^"))
    found: list[tuple[int, str, list[str]]] = []
    for words in commands:
        for k, w in enumerate(words):
            if pattern.search(w) and words[0] != "echo":
                found.append((len(words) - k, w, words[k + 1 :]))
                break
    src = Source({}, shell.unresolved, [], shell.env)
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
        src.flat = parse_flags([a for a in args if a.startswith("--")], max_values=0)
        for a in args:
            m = re.fullmatch(r"(\+\+|\+|~)?([A-Za-z_][\w.\-]*)=(.*)", a, re.S)
            if m and not a.startswith("--"):
                src.flat[m[2]] = (a.split("=", 1)[0], m[3])
    else:
        src.flat = parse_flags(args)
    return src
