"""Child processes of a benchmark (`tether train`, `tether demo`, a TRL run), run so that a
benchmark stopped half-way stops them too: ``run`` is ``subprocess.run`` whose child, on any
exception in the parent (a timeout, Ctrl-C, the runner's ``Interrupted`` on SIGTERM), is asked
to stop with SIGTERM (`tether train` then stops its services and its Redis server), and its
whole process group is SIGKILLed after ``grace_s``.

``grace_s`` defaults to the launcher's own shutdown (``GRACE_S``): the learner's drain, then the
other services', then their SIGKILL. The former 30 s grace would kill `tether demo` half-way
through its shutdown (its learner first finishes a step, about a minute on the real model), as a
second Ctrl-C did once by hand: its services, each in a session of its own, outlived it; the
kernel's parent-death SIGTERM reached them, but with the run's Redis server gone the learner
retried its acknowledgements against nothing until the bus gave up (``bus.reconnect_max_s``, 120
s).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence

from tether.runs.supervisor import SHUTDOWN_MAX_S

# the launcher's longest shutdown, and a margin for the run's summary and its Redis server
GRACE_S = SHUTDOWN_MAX_S + 25.0


def stop(proc: subprocess.Popen, *, grace_s: float = GRACE_S) -> None:
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
    grace_s: float = GRACE_S,
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
