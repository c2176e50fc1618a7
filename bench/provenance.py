"""Where a benchmark result came from: the clone's git commit and whether its tracked files
differed from it (``dirty``; the runner stamps every result JSON with it, ``stamp``), and the
device it ran on."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tether.runs.provenance import git_state

CLONE = Path(__file__).resolve().parents[1]
__all__ = ["CLONE", "device_name", "git_state", "stamp"]


def stamp(
    path: Path, state: dict[str, Any], *, command: str | None = None,
    machine: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """Add ``"git": state`` to the result JSON at ``path`` (a dict), and the ``command`` that
    made it and the ``machine`` it ran on (its load average when it started), unless it has
    them: every result records where it came from (tests/unit/test_results_provenance.py)."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    add = {"git": state, "command": command, "machine": machine}
    missing = {k: v for k, v in add.items() if v is not None and k not in result}
    if isinstance(result, dict) and missing:
        result.update(missing)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(path)


def device_name() -> str:
    """The device torch computes on: the GPU's name, or the CPU's cores and threads."""
    import torch

    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)}"
    return f"cpu: {os.cpu_count()} cores, {torch.get_num_threads()} threads"
