"""Where a result came from: the git commit of the code that ran and whether its tracked files
differed from that commit (``git_state``). `tether demo` stamps its result with it; the
benchmarks (``bench.provenance``) stamp theirs with the same function."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

# the checkout this package runs from (an installed wheel has no .git: no commit)
CODE_ROOT = Path(__file__).resolve().parents[2]


def git_state(clone: Path = CODE_ROOT) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` (None outside a git checkout)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(clone), *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}
