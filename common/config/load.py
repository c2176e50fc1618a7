"""Load a ``TetherConfig`` from its sources, lowest precedence first:

1. defaults (``common.config``);
2. a TOML file (``--config FILE``);
3. environment variables ``TETHER_<SECTION>__<KEY>`` (e.g. ``TETHER_LEARNER__LR=1e-6``);
4. command-line flags (``--prompts-per-cycle 30``) and ``--set section.key=value``.

The cycle knobs (``prompts_per_cycle`` … ``max_staleness``) may sit in any table of the file or
at its top level: they are all moved to ``[run]``; two different values for one knob are refused.
slime's old names are accepted with one deprecation warning each; a Tether setting that was
renamed (``RENAMED_KEYS``) is refused with its new name. Unknown keys are refused with a
"did you mean" suggestion. Every problem becomes one ``ConfigError`` paragraph.
"""

from __future__ import annotations

import difflib
import logging
import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from common.config.errors import ConfigError
from common.config.schema import (
    CYCLE_KEYS,
    DEPRECATED_ALIASES,
    RENAMED_KEYS,
    SECTIONS,
    TetherConfig,
)

log = logging.getLogger(__name__)

ENV_PREFIX = "TETHER_"


@dataclass
class Loaded:
    config: TetherConfig
    warnings: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # "section.key" -> where it came from


def _suggest(word: str, candidates: Iterable[str]) -> str:
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" Did you mean '{match[0]}'?" if match else ""


def _renamed(section: str, key: str, value: Any, source: str) -> str:
    """One paragraph for a renamed setting: the new key, why, and how to write it."""
    new, why = RENAMED_KEYS[f"{section}.{key}"]
    new_section, _, new_key = new.partition(".")
    shown = _toml_value(value)
    return (
        f"'{section}.{key}' ({source}) was renamed to '{new}': {why}. Fix: write "
        f"{new_key} = {shown} under [{new_section}] (--set {new}={shown}, or "
        f"TETHER_{new_section.upper()}__{new_key.upper()}={shown})."
    )


def _toml_value(value: Any) -> str:
    """``value`` as it would be written in TOML (numbers, booleans, strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def _all_dotted_keys() -> list[str]:
    return [f"{s}.{k}" for s, model in SECTIONS.items() for k in model.model_fields]


class _Builder:
    """Accumulates raw values per section with their sources, applying aliases and hoisting."""

    def __init__(self) -> None:
        self.raw: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        self.sources: dict[str, str] = {}
        self.warnings: list[str] = []
        self.errors: list[str] = []
        self._warned_aliases: set[str] = set()

    def _canonical(self, key: str, source: str) -> str:
        key = key.replace("-", "_")
        if key in DEPRECATED_ALIASES:
            new = DEPRECATED_ALIASES[key]
            if key not in self._warned_aliases:
                self._warned_aliases.add(key)
                self.warnings.append(
                    f"'{key}' ({source}) is slime's deprecated name; use '{new}' "
                    f"(--{new.replace('_', '-')}) instead."
                )
            return new
        return key

    def put(
        self, section: str | None, key: str, value: Any, source: str, *, layer_wins: bool
    ) -> None:
        """Set ``section.key``; a cycle knob goes to ``run`` whichever table held it."""
        key = self._canonical(key, source)
        if key in CYCLE_KEYS:
            section = "run"
        if section is None:
            self.errors.append(
                f"'{key}' ({source}) is not a cycle knob, so it must sit in a section such as "
                f"[learner]; top-level keys may only be {', '.join(CYCLE_KEYS)}.{_suggest(key, CYCLE_KEYS)}"
            )
            return
        if section not in SECTIONS:
            self.errors.append(
                f"unknown section [{section}] ({source}).{_suggest(section, SECTIONS)} Sections: {', '.join(SECTIONS)}."
            )
            return
        if f"{section}.{key}" in RENAMED_KEYS:
            self.errors.append(_renamed(section, key, value, source))
            return
        fields = SECTIONS[section].model_fields
        if key not in fields:
            cands = list(fields) + [k for k in _all_dotted_keys()]
            hint = _suggest(key, fields) or _suggest(f"{section}.{key}", cands)
            self.errors.append(f"unknown setting '{section}.{key}' ({source}).{hint}")
            return
        dotted = f"{section}.{key}"
        prev = self.sources.get(dotted)
        if prev is not None and not layer_wins and self.raw[section][key] != value:
            self.errors.append(
                f"'{key}' is given twice with different values: {self.raw[section][key]!r} ({prev}) and "
                f"{value!r} ({source}). Fix: keep one."
            )
            return
        self.raw[section][key] = value
        self.sources[dotted] = source

    def add_file(self, path: Path) -> None:
        try:
            doc = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(
                f"config file {path} does not exist. Fix: check the path given to --config."
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(
                f"config file {path} is not valid TOML: {exc}. Fix the line it names."
            ) from None
        for top_key, value in doc.items():
            if isinstance(value, dict):
                for key, inner in value.items():
                    self.put(top_key, key, inner, f"{path} [{top_key}]", layer_wins=False)
            else:
                self.put(None, top_key, value, f"{path} top level", layer_wins=False)

    def add_env(self, env: Mapping[str, str]) -> None:
        for name, text in sorted(env.items()):
            if not name.startswith(ENV_PREFIX) or "__" not in name:
                continue
            section, _, key = name[len(ENV_PREFIX) :].partition("__")
            self.put(
                section.lower(),
                key.lower(),
                parse_scalar(text),
                f"environment {name}",
                layer_wins=True,
            )

    def add_override(self, text: str, source: str) -> None:
        dotted, sep, value = text.partition("=")
        if not sep:
            self.errors.append(
                f"{source} '{text}' must look like section.key=value (e.g. learner.lr=1e-6)."
            )
            return
        section, _, key = dotted.strip().rpartition(".")
        self.put(section or None, key, parse_scalar(value.strip()), source, layer_wins=True)


def parse_scalar(text: str) -> Any:
    """Parse an env/CLI value as a TOML value (numbers, booleans, lists); else keep the string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _format_validation(exc: ValidationError, sources: Mapping[str, str]) -> str:
    parts = []
    for err in exc.errors():
        loc = [str(x) for x in err["loc"]]
        dotted = ".".join(loc[:2])
        src = sources.get(dotted, "default")
        value = err.get("input")
        parts.append(f"{dotted} = {value!r} ({src}): {err['msg']}")
    return (
        "Invalid settings: "
        + "; ".join(parts)
        + ". See `tether config explain` or the README's config reference."
    )


def load_config(
    *,
    config_file: str | os.PathLike[str] | None = None,
    overrides: Iterable[str] = (),
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Loaded:
    """Build the config from all sources; raise ``ConfigError`` with every problem found."""
    b = _Builder()
    if config_file:
        b.add_file(Path(config_file))
    b.add_env(os.environ if env is None else env)
    for dotted, value in (flags or {}).items():
        if value is None:
            continue
        section, _, key = dotted.rpartition(".")
        b.put(section or None, key, value, f"--{key.replace('_', '-')}", layer_wins=True)
    for text in overrides:
        b.add_override(text, "--set")
    for w in b.warnings:
        log.warning(w)
    if b.errors:
        raise ConfigError(" ".join(b.errors))
    try:
        cfg = TetherConfig.model_validate(b.raw)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc, b.sources)) from None
    return Loaded(config=cfg, warnings=b.warnings, sources=b.sources)
