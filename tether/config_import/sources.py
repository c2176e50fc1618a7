"""A peer's settings as a flat table: reading a YAML config (verl's tree, ROLL's pipeline file)
with its ``${...}`` interpolations, and typing values the way the peers' parsers do."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Source:
    """The peer's settings as a flat ``normalized key -> (key as written, value)`` table."""

    flat: dict[str, tuple[str, Any]]
    unresolved: set[str]
    unknown: list[str]
    env: dict[str, str] = field(default_factory=dict)
    entry: str = ""
    problems: list[str] = field(default_factory=list)


def coerce(value: Any) -> Any:
    """Types a string as the peers' parsers would: bools, null, ints, floats, ``[a,b]`` lists."""
    if isinstance(value, list):
        return [coerce(v) for v in value]
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
        return [coerce(x.strip().strip("'\"")) for x in inner.split(",")] if inner else []
    return value


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def read_yaml(text: str, variables: Mapping[str, str], path: Path) -> Source:
    import yaml  # noqa: PLC0415 - only the importer reads YAML

    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(
            f"{path} is not valid YAML ({exc}); fix the file or pass a launch script."
        ) from None
    if not isinstance(tree, dict):
        raise ValueError(f"{path} holds no YAML mapping at its top level; pass the run's config.")
    flat = _flatten(tree)
    src = Source({k: (k, v) for k, v in flat.items()}, set(), [])

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


def device_count(value: Any) -> int | None:
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
        parsed = coerce(value)
        if isinstance(parsed, list):
            return len(parsed)
    return None
