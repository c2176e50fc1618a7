"""Where a result came from: the git commit of the code that ran and whether its tracked files
differed from that commit (``git_state``). `tether demo` stamps its result with it; the
benchmarks (``bench.provenance``) stamp theirs with the same function."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

# the checkout this package runs from (an installed wheel has no .git: no commit)
CODE_ROOT = Path(__file__).resolve().parents[2]
# what the benchmarks write into the clone: a result one of them wrote is not a change to the
# code the next one runs (else every benchmark after the first of `tether bench all`, or the
# second demo kind of a sitting, would be stamped dirty)
OUTPUTS = ("bench/results", "bench/README.md")


def git_state(clone: Path = CODE_ROOT) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` (None outside a git checkout);
    ``dirty``: a tracked file other than the benchmarks' ``OUTPUTS`` differs from the commit."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(clone), *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        outputs = [f":(exclude){path}" for path in OUTPUTS]
        dirty = bool(
            git("status", "--porcelain", "--untracked-files=no", "--", ".", *outputs).strip()
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}
