"""The disk under the learner's checkpoints: leftovers of saves that did not finish, and a save
that finds no room.

A save killed mid-way leaves ``tmp-<N>-<pid>/`` (and, rarely, ``trash-*`` or ``latest.tmp-*``)
next to the complete ``step-<N>/`` directories; ``remove_leftovers`` removes them when the learner
starts and after every save, so a crash loop does not fill the disk with them.

A save that fails with ``ENOSPC``/``EDQUOT`` on any rank raises ``DiskFull`` on every rank
(``checkpoint.start_checkpoint`` and ``PendingCheckpoint``), whose message names the directory, the bytes a save needs and
those free, and the settings that help. The learner then stops with exit code 2: retrying would
retrain the same steps into the same full disk; its scored groups stay pending in Redis (no
acknowledgement without a checkpoint), so ``tether train --resume`` continues from the last good
checkpoint once there is room, with nothing lost or trained twice.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any


def remove_leftovers(root: Path) -> int:
    """Remove what saves killed (or failed) mid-way left in ``root``: ``tmp-*`` directories,
    ``trash-*`` and ``latest.tmp-*``. Returns how many were removed."""
    removed = 0
    for path in root.iterdir() if root.exists() else []:
        if path.name.startswith(("tmp-", "trash-", "latest.tmp-")):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed += 1
    return removed


class DiskFull(RuntimeError):
    """A checkpoint could not be written for lack of space; the previous one stands."""


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # errnos that mean "no room"


def disk_full(
    root: Path, step: int, exc: OSError | None, *, states: tuple[dict[str, Any], ...]
) -> DiskFull:
    """The error every rank raises: ``exc`` where this rank ran out of room, None where another
    did; ``states`` (the gathered model and optimizer state) say how many bytes a save needs."""
    needed = _nbytes(*states)
    try:
        free = f"{shutil.disk_usage(root).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    why = f" ({exc.strerror})" if exc is not None else ""
    return DiskFull(
        f"checkpoint step-{step} could not be written to {root}{why}: it needs about "
        f"{needed / 2**20:.1f} MiB (keep_checkpoints of them, plus one while a save runs), "
        f"{free}. The half-written directory was removed and the previous checkpoint stands. "
        "Free space there (learner.keep_checkpoints keeps fewer), or move the run to a larger "
        "disk (run.run_dir; checkpoints/ may be a mount of its own), then `tether train --resume "
        "RUN_DIR` (or restart the learner): it continues from the last good checkpoint."
    )


def _nbytes(*states: dict[str, Any]) -> int:
    import torch

    total = 0
    for state in states:
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
            elif isinstance(value, dict):
                total += _nbytes(value)
    return total


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def as_os_error(exc: Exception, path: Path) -> OSError | None:
    """safetensors reports I/O errors as ``SafetensorError("... (os error 28)")``, not
    ``OSError``: the ``OSError`` it stands for, or None when it names no OS error."""
    match = _RUST_OS_ERROR.search(str(exc))
    if match is None:
        return None
    code = int(match.group(1))
    return OSError(code, os.strerror(code), str(path))


def no_room(exc: BaseException) -> OSError | None:
    """The ``OSError`` meaning "no room" behind ``exc``, or None: ``exc`` itself, its causes,
    a DCP ``CheckpointException``'s per-rank failures, or safetensors' ``SafetensorError`` (whose
    I/O errors are not ``OSError``s; ``as_os_error``)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in NO_SPACE:
            return e
        if isinstance(e, Exception) and type(e).__name__ == "SafetensorError":
            os_error = as_os_error(e, Path(""))
            if os_error is not None and os_error.errno in NO_SPACE:
                return os_error
        failures = getattr(e, "failures", None)  # DCP's per rank: (exception, its traceback)
        if isinstance(failures, dict):
            for failure in failures.values():
                first = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(first, BaseException):
                    todo.append(first)
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None
