"""A benchmark stopped half-way stops what it started: `tether bench learner --quick` (real
process, real embedded valkey-server) gets SIGTERM while it trains, exits, and leaves no server
running and no scratch folder behind. Before the runner turned SIGTERM into an exception, the
bench died at once and its valkey-server ran on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
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
    lines: list[str] = []
    training = threading.Event()  # the learner service logged its first step: the server is up

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "step_log: step 1 " in line:
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # the quick bench's service part lasts about a second here: the signal goes the moment
        # its first step is logged (a fixed 3 s wait once saw the whole bench end first)
        assert training.wait(180), "".join(lines)[-2000:]
        server = next((p for p, c in _children(proc.pid).items() if "valkey" in c), None)
        assert server is not None, "the bench's server was not running while it trained"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines)
    assert proc.returncode != 0, output[-2000:]
    assert "stopped by signal SIGTERM" in output, output[-2000:]
    deadline = time.monotonic() + 10
    while pid_running(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pid_running(server), "the bench's valkey-server outlived it"
    assert not list(work.glob("tether-bench-learner-*")), "its scratch folder was left behind"
    assert not (tmp_path / "README.md").exists()
