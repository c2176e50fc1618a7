"""A benchmark stopped half-way stops what it started: `tether bench learner --quick` (real
process, real embedded valkey-server) gets SIGTERM while it trains, exits, and leaves no server
running and no scratch folder behind. Before the runner turned SIGTERM into an exception, the
bench died at once and its valkey-server ran on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.bus.server import pid_running
from tests.paths import REPO


def _children(pid: int) -> dict[int, str]:
    """{pid: command name} of the processes whose parent is ``pid``."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        if int(rest.split()[1]) == pid:
            out[int(entry.name)] = comm
    return out


def test_sigterm_stops_the_bench_and_the_server_it_started(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    cmd = [sys.executable, "-m", "tether.cli", "bench", "learner", "--quick", "--out", str(out),
           "--work-dir", str(work)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    try:
        server, deadline = None, time.monotonic() + 180
        while server is None and time.monotonic() < deadline and proc.poll() is None:
            server = next((p for p, c in _children(proc.pid).items() if "valkey" in c), None)
            time.sleep(0.2)
        assert server is not None, "the bench never started its server"
        time.sleep(3.0)  # into the timed cycles
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, output[-2000:]
    assert "stopped by signal SIGTERM" in output, output[-2000:]
    deadline = time.monotonic() + 10
    while pid_running(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pid_running(server), "the bench's valkey-server outlived it"
    assert not list(work.glob("tether-bench-learner-*")), "its scratch folder was left behind"
    assert not (tmp_path / "README.md").exists()
