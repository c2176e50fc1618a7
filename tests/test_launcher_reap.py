"""A supervised service killed with SIGKILL leaves no orphans: the launcher kills what is left of
its process group (vLLM's engine core, grader workers) before restarting it."""

from __future__ import annotations

import os
import signal
import sys
import time

from common.launcher import Child

# The leader starts a grandchild that ignores SIGTERM and outlives it (as vLLM's engine core
# outlives a SIGKILLed generator), writes the grandchild's pid, then sleeps.
SCRIPT = """
import subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
open(sys.argv[1], "w").write(str(g.pid))
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_sigkilled_child_leaves_no_orphan(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    child = Child("svc", [sys.executable, "-c", SCRIPT, str(pid_file)], tmp_path / "svc.log",
                  dict(os.environ))  # fmt: skip
    child.start()
    assert child.proc is not None
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the grandchild never started"
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    os.kill(child.proc.pid, signal.SIGKILL)  # the leader only, as the OOM killer would
    child.proc.wait(10)
    assert _alive(grandchild), "without reaping, the grandchild outlives its parent"
    child.reap_group()
    deadline = time.monotonic() + 10
    while _alive(grandchild):
        assert time.monotonic() < deadline, "the orphaned grandchild is still running"
        time.sleep(0.05)
    child.reap_group()  # nothing left: a no-op
