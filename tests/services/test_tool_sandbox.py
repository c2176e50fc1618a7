"""Hostile tool calls against the real sandbox (worker processes in namespaces, as root).

Each hostile call must come back as an error message for the model, leave nothing behind for
the next call, and not hold up calls running beside it. CI runs as root, where the namespaces
work; ``test_rlimits_fallback`` covers the weaker mode a non-root generator gets.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from common.tools.registry import resolve_tools
from common.tools.sandbox import SandboxError, SandboxLimits, ToolSandbox
from tests.paths import REPO

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the namespace jail needs root (CI runs as root)"
)
LIMITS = SandboxLimits(timeout_s=2.0, cpu_s=2.0, memory_mb=256, max_output_bytes=4096, nproc=8)


def _run(coro):
    return asyncio.run(coro)


async def _sandbox(**kw) -> ToolSandbox:
    sb = ToolSandbox(resolve_tools(["calculator", "python"]), workers=2, limits=LIMITS, **kw)
    await sb.start()
    return sb


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _uid_processes(uid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            line = next(ln for ln in status.splitlines() if ln.startswith("Uid:"))
            if int(line.split()[1]) == uid:
                pids.append(int(entry.name))
    return pids


async def _calc_ok(sb: ToolSandbox) -> None:
    r = await sb.call("calculator", {"expression": "123*4567"})
    assert r.ok and r.text == "561741", r


HOSTILE = {
    "infinite loop": ("while True:\n    pass", "timed out"),
    "a call that never returns": ("import time\ntime.sleep(10**6)", "timed out"),
    "1 GB of output": ("import sys\nfor _ in range(1 << 14):\n    sys.stdout.write('x' * 65536)",
                       "output exceeded 4096 bytes"),
    "memory": ("x = bytearray(2 << 30)", "MemoryError"),
    "reading /etc/passwd": ("print(open('/etc/passwd').read())", "FileNotFoundError"),
    "reading the repository": (f"print(open({str(REPO / 'README.md')!r}).read())",
                               "FileNotFoundError"),
    "reading another process's environment": ("print(open('/proc/1/environ').read())",
                                              "FileNotFoundError"),
    "writing outside /work": ("open('/usr/evil', 'w').write('x')", "Read-only file system"),
}  # fmt: skip


@pytest.mark.parametrize("what", list(HOSTILE))
def test_hostile_python_calls_become_error_messages(what):
    code, words = HOSTILE[what]

    async def go():
        sb = await _sandbox()
        try:
            r = await sb.call("python", {"code": code})
            assert not r.ok and words in r.text, r.text
            assert r.text.startswith("Error: ")
            await _calc_ok(sb)  # the same worker serves the next call
            await _calc_ok(sb)
        finally:
            await sb.close()

    _run(go())


def test_the_environment_holds_no_secret_of_the_generator(monkeypatch):
    monkeypatch.setenv("TETHER_TEST_SECRET", "hunter2")

    async def go():
        sb = await _sandbox()
        try:
            r = await sb.call("python", {"code": "import os\nprint(sorted(os.environ.items()))"})
            assert r.ok and "hunter2" not in r.text and "TETHER_TEST_SECRET" not in r.text
            assert "REDIS" not in r.text and "PYTHONPATH" not in r.text
        finally:
            await sb.close()

    _run(go())


def test_a_socket_cannot_reach_a_server_on_this_host():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"

        async def go():
            sb = await _sandbox()
            try:
                r = await sb.call("python", {"code": code})
                assert not r.ok and "Network is unreachable" in r.text, r.text
            finally:
                await sb.close()

        _run(go())
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody came


def test_a_fork_bomb_is_bounded_and_leaves_no_process_behind():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"

    async def go():
        sb = await _sandbox()
        try:
            uids = [s.uid for s in sb._slots]
            r = await sb.call("python", {"code": code})
            assert not r.ok and "timed out" in r.text
            for uid in uids:  # only the workers themselves are left, one per slot
                assert len(_uid_processes(uid)) <= 1
            await _calc_ok(sb)
        finally:
            await sb.close()

    _run(go())


def test_nothing_a_call_writes_reaches_the_next_call():
    async def go():
        sb = await ToolSandbox(resolve_tools(["python"]), workers=1, limits=LIMITS).__aenter__()
        try:
            w = await sb.call("python", {"code": "open('note', 'w').write('x')\nimport os\n"
                                         "os.makedirs('d/e')\nprint(sorted(os.listdir('.')))"})  # fmt: skip
            assert w.ok and "'note'" in w.text
            r = await sb.call("python", {"code": "import os\nprint(sorted(os.listdir('.')))"})
            assert r.ok and r.text.strip() == "['main.py']", r.text
        finally:
            await sb.close()

    _run(go())


def test_a_hanging_call_does_not_hold_up_the_others():
    async def go():
        sb = await _sandbox()
        try:
            hang = asyncio.create_task(sb.call("python", {"code": "while True: pass"}))
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            await _calc_ok(sb)
            assert time.monotonic() - t0 < 1.0
            assert not (await hang).ok
        finally:
            await sb.close()

    _run(go())


def test_a_tool_process_killed_from_outside_gives_an_error():
    async def go():
        sb = await ToolSandbox(resolve_tools(["python", "calculator"]), workers=1,
                               limits=SandboxLimits(timeout_s=20.0, cpu_s=20.0)).__aenter__()  # fmt: skip
        try:
            call = asyncio.create_task(sb.call("python", {"code": "import time\ntime.sleep(60)"}))
            (unshare,) = sb.worker_pids()
            (worker,) = await _eventually(lambda: _children(unshare))
            (tool,) = await _eventually(lambda: _children(worker))
            os.kill(tool, signal.SIGKILL)
            r = await asyncio.wait_for(call, 5)
            assert not r.ok and "killed by SIGKILL" in r.text, r.text
            # and the worker itself, killed mid-call: an error, then a fresh worker
            call = asyncio.create_task(sb.call("python", {"code": "import time\ntime.sleep(60)"}))
            (worker,) = await _eventually(lambda: _children(unshare))
            await _eventually(lambda: _children(worker))
            os.kill(worker, signal.SIGKILL)
            r = await asyncio.wait_for(call, 5)
            assert not r.ok and "sandbox worker died" in r.text, r.text
            await _calc_ok(sb)
            assert sb.restarts == 1
        finally:
            await sb.close()

    _run(go())


async def _eventually(fn, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError("timed out waiting")


def test_bad_calls_never_reach_a_worker():
    async def go():
        sb = await _sandbox()
        try:
            r = await sb.call("rm", {})
            assert not r.ok and "unknown tool 'rm'" in r.text and r.reason == "unknown_tool"
            r = await sb.call("calculator", {"expr": "1"})
            assert not r.ok and "unknown argument" in r.text and r.reason == "bad_arguments"
            r = await sb.call("calculator", {"expression": "open('x')"})
            assert not r.ok and "Call is not allowed" in r.text
        finally:
            await sb.close()

    _run(go())


def test_rlimits_fallback(tmp_path):
    async def go():
        sb = await _sandbox(isolation="rlimits", scratch_dir=str(tmp_path))
        try:
            assert sb.isolation == "rlimits"
            r = await sb.call("python", {"code": "while True: pass"})
            assert not r.ok and "timed out" in r.text
            r = await sb.call("python", {"code": "import os\nprint(os.environ.get('HOME'))"})
            assert r.ok and r.text.strip().startswith(str(tmp_path))
            await _calc_ok(sb)
        finally:
            await sb.close()

    _run(go())


def test_namespaces_required_but_impossible_is_refused(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)

    async def go():
        sb = ToolSandbox(resolve_tools(["calculator"]), isolation="namespaces")
        with pytest.raises(SandboxError, match="generator.tool_sandbox = 'namespaces'"):
            await sb.start()

    _run(go())
