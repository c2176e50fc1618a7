"""A supervised service killed with SIGKILL leaves no orphans: the launcher kills what is left of
its process group (vLLM's engine core, grader workers) before restarting it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from common.bus.server import EmbeddedRedis, pid_running, valkey_binary
from tests.paths import REPO
from tether.runs.supervised import main
from tether.runs.supervisor import Child

# The leader starts a grandchild that ignores SIGTERM and outlives it (as vLLM's engine core
# outlives a SIGKILLed generator), writes the grandchild's pid, then sleeps.
SCRIPT = """
import subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
open(sys.argv[1], "w").write(str(g.pid))
time.sleep(300)
"""


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
    assert pid_running(grandchild), "without reaping, the grandchild outlives its parent"
    child.reap_group()
    deadline = time.monotonic() + 10
    while pid_running(grandchild):
        assert time.monotonic() < deadline, "the orphaned grandchild is still running"
        time.sleep(0.05)
    child.reap_group()  # nothing left: a no-op


# A stand-in launcher: starts one service-like child the way `tether train` does (own session,
# TETHER_SUPERVISOR_PID set), writes the child's pid, then waits to be killed.
LAUNCHER = """
import os, subprocess, sys, time
env = dict(os.environ, TETHER_SUPERVISOR_PID=str(os.getpid()))
child = subprocess.Popen([sys.executable, "-c",
    "from common.service.supervision import stop_with_supervisor; stop_with_supervisor(); "
    "import time; open(sys.argv[1], 'w').write('up'); time.sleep(300)".replace("sys.argv[1]", repr(sys.argv[2]))],
    env=env, start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(300)
"""


def _child_stops_with_sigkilled_launcher(tmp_path, launcher_source: str) -> None:
    """Run a stand-in launcher, wait for its child, SIGKILL the launcher: the child must go."""
    pid_file, up_file = tmp_path / "child.pid", tmp_path / "child.up"
    launcher = subprocess.Popen([sys.executable, "-c", launcher_source, str(pid_file), str(up_file)],
                                cwd=REPO)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (up_file.exists() and pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert pid_running(child)
        launcher.kill()  # SIGKILL: the launcher cannot tell anyone
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while pid_running(child):
            assert time.monotonic() < deadline, "the child outlived its launcher"
            time.sleep(0.05)
    finally:
        launcher.kill()
        if pid_file.exists() and pid_file.read_text():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_services_stop_when_the_launcher_is_sigkilled(tmp_path):
    _child_stops_with_sigkilled_launcher(tmp_path, LAUNCHER)


# The same launcher starting a program that does not ask for the signal itself (as torchrun
# does not), through the `tether.runs.supervised` shim the launcher uses for torchrun.
FOREIGN_LAUNCHER = LAUNCHER.replace(
    '[sys.executable, "-c",',
    '[sys.executable, "-m", "tether.runs.supervised", sys.executable, "-c",',
).replace(
    "from common.service.supervision import stop_with_supervisor; stop_with_supervisor(); ",
    "import sys; ",
)


def test_a_foreign_program_started_through_the_shim_stops_with_the_launcher(tmp_path):
    # the program's pid is the shim's (it exec'd); without the shim it was checked to survive
    assert (
        "stop_with_supervisor" not in FOREIGN_LAUNCHER
        and "tether.runs.supervised" in FOREIGN_LAUNCHER
    )
    _child_stops_with_sigkilled_launcher(tmp_path, FOREIGN_LAUNCHER)


def test_supervised_shim_without_a_program_is_a_usage_error():
    assert main([]) == 2


def test_a_server_orphaned_on_the_run_directory_is_stopped_before_a_new_one_starts(
    tmp_path, server_binary
):
    """`tether train --resume` after a SIGKILLed launcher: the old server (still running, by
    design: it is not ours to signal) is stopped first, so two servers never share one AOF.
    With Debian's redis-server too, whose /proc exe names redis-check-rdb (a symlink)."""
    old = EmbeddedRedis(tmp_path / "data", binary=server_binary).start()
    orphan = old.pid
    assert orphan is not None
    old.proc = None  # as if its starter had died: nobody holds the Popen any more
    new = EmbeddedRedis(tmp_path / "data", binary=server_binary)
    try:
        new.start()
        assert not pid_running(orphan)
        assert new.pid != orphan and pid_running(new.pid)
    finally:
        new.stop()
        try:
            os.kill(orphan, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_server_of_another_directory_is_not_taken_for_an_orphan(tmp_path):
    """The pid file names a live server, but one started on another directory (a pid file
    copied along with a run directory, say): it is left alone."""
    other = EmbeddedRedis(tmp_path / "other").start()
    try:
        here = EmbeddedRedis(tmp_path / "here")
        here.data_dir.mkdir(parents=True)
        here.pid_path.write_text(str(other.pid))
        here.start()
        try:
            assert pid_running(other.pid) and here.pid != other.pid
        finally:
            here.stop()
    finally:
        other.stop()


def test_the_embedded_server_is_the_wheels_unless_another_is_named(tmp_path, monkeypatch):
    """A `redis-server` on PATH is not picked up silently; naming one (a path or a program on
    PATH, `run.redis_server_binary`) is how a user asks for it; a wrong name is an error."""

    impostor = tmp_path / "bin" / "redis-server"
    impostor.parent.mkdir()
    impostor.write_text("#!/bin/sh\nexit 1\n")
    impostor.chmod(0o755)
    monkeypatch.setenv("PATH", f"{impostor.parent}:{os.environ['PATH']}")
    assert EmbeddedRedis(tmp_path / "a").binary == valkey_binary()
    assert EmbeddedRedis(tmp_path / "b", binary="redis-server").binary == impostor
    with pytest.raises(FileNotFoundError, match="run.redis_server_binary = 'no-such-server'"):
        EmbeddedRedis(tmp_path / "c", binary="no-such-server")
