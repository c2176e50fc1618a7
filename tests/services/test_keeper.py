"""The in-container keeper (``common.service.keeper``), the restart policy of the compose files,
with real processes: a refused service (exit 2) is never restarted, a crash (exit 1, SIGKILL) is
restarted a bounded number of times, an unhealthy one (/healthz 503) is stopped and restarted,
SIGTERM reaches the service and its exit code comes back, and nothing of its process group is
left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.bus.server import pid_running
from common.ports import free_port
from tests.paths import PROCS, REPO

pytestmark = pytest.mark.slow  # each test runs processes for a few seconds


def _keeper(tmp_path: Path, lives: str, *opts: str, port: int = 0):
    starts = tmp_path / "starts"
    grandchild = tmp_path / "grandchild.pid"
    child = [sys.executable, str(PROCS / "keeper_child.py"), "--starts", str(starts),
             "--lives", lives, "--port", str(port), "--grandchild-pid-file", str(grandchild)]  # fmt: skip
    cmd = [sys.executable, "-m", "common.service.keeper", *opts, "--", *child]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    return proc, starts, grandchild


def _starts(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _finish(proc, timeout_s: float = 60) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out


def _gone(pid_file: Path) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not pid_running(int(pid_file.read_text())):
            return True
        time.sleep(0.05)
    return False


def test_a_refused_service_is_never_restarted(tmp_path):
    proc, starts, grandchild = _keeper(tmp_path, "exit:2")
    code, out = _finish(proc)
    assert code == 2 and _starts(starts) == 1, out
    assert "not restarted" in out
    assert _gone(grandchild)  # the service's group is killed after it exits


def test_a_finished_service_exits_0_and_a_crash_is_restarted(tmp_path):
    proc, starts, _ = _keeper(tmp_path, "exit:1,kill,exit:0")
    code, out = _finish(proc)
    assert code == 0 and _starts(starts) == 3, out  # two crashes (a code, a SIGKILL), then done


def test_restarts_are_bounded(tmp_path):
    proc, starts, _ = _keeper(tmp_path, "exit:3", "--max-restarts", "2")
    code, out = _finish(proc)
    assert code == 3 and _starts(starts) == 3, out  # the first life and two restarts
    assert "giving up" in out


def test_an_unhealthy_service_is_restarted(tmp_path):
    port = free_port()
    proc, starts, grandchild = _keeper(
        tmp_path, "serve:sick-after:2,exit:0", "--health-url", f"http://127.0.0.1:{port}/healthz",
        "--check-every-s", "0.5", "--unhealthy-after", "3", "--stop-timeout-s", "10", port=port,
    )  # fmt: skip
    code, out = _finish(proc)
    assert code == 0 and _starts(starts) == 2, out
    assert "is unhealthy" in out


def test_sigterm_reaches_the_service_and_its_stop_code_comes_back(tmp_path):
    port = free_port()
    proc, starts, grandchild = _keeper(tmp_path, "serve:ok", port=port)
    deadline = time.monotonic() + 30
    while not grandchild.exists() and time.monotonic() < deadline:  # the service takes SIGTERM
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    code, out = _finish(proc)
    assert code == 75 and _starts(starts) == 1, out
    assert _gone(grandchild)
