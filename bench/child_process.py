"""Child processes of a benchmark (`tether train`, `tether demo`, a TRL run), run so that a
benchmark stopped half-way stops them too: ``run`` is ``subprocess.run`` whose child, on any
exception in the parent (a timeout, Ctrl-C, the runner's ``Interrupted`` on SIGTERM), is asked
to stop with SIGTERM (`tether train` then stops its services and its Redis server), and its
whole process group is SIGKILLed after ``grace_s``."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence


def stop(proc: subprocess.Popen, *, grace_s: float) -> None:
    """SIGTERM the child, wait up to ``grace_s``, then SIGKILL its process group."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything of its group still there
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run(
    cmd: Sequence[str],
    *,
    timeout_s: float,
    env: dict[str, str] | None = None,
    grace_s: float = 30.0,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` to the end with its output captured (text), in a process group of its own."""
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,  # its group is ours to kill; a terminal's Ctrl-C reaches us only
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except BaseException:
        stop(proc, grace_s=grace_s)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
