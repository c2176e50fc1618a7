"""A small TOML writer for the flat, two-level documents Tether emits (resolved configs, imports).

Tether configs are at most ``[section] key = scalar | list of scalars | inline table of
scalars``; this writes exactly that shape and refuses anything else, so no third-party writer is
needed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


def toml_value(value: Any) -> str:
    """One TOML value: bool, int, float, str, a list of those, or an inline table of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        # JSON string escaping is valid TOML basic-string escaping for everything JSON emits.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as a TOML value: {value!r}")


def dumps(
    doc: Mapping[str, Mapping[str, Any]],
    *,
    header: str = "",
    comments: Mapping[str, str] | None = None,
) -> str:
    """Write ``{section: {key: value}}``; ``None`` values are written as comments (unset).

    ``comments`` maps ``"section.key"`` to a trailing comment.
    """
    comments = comments or {}
    lines: list[str] = []
    if header:
        lines += [f"# {line}" if line else "#" for line in header.splitlines()]
        lines.append("")
    for section, table in doc.items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            note = comments.get(f"{section}.{key}")
            tail = f"  # {note}" if note else ""
            if value is None:
                lines.append(f"# {key} = (unset){tail}")
            else:
                lines.append(f"{key} = {toml_value(value)}{tail}")
        lines.append("")
    return "\n".join(lines)
