"""The tool sandbox keeps the generator's secrets in ``rlimits`` mode, run as a NON-ROOT user.

A generator that is not root (the Kubernetes manifests run it so) gets ``rlimits`` isolation:
its tools run under its own uid. The test starts a real generator-side sandbox in a child
process running as an unprivileged user (``tetheruser``, created with ``useradd`` when the test
runs as root; the current user otherwise), with a Redis URL holding a password in its
environment, and has a ``python`` tool call try what a hostile model would: read the environment
of every ancestor process through ``/proc/<pid>/environ`` (the generator's included) and connect
to a TCP port this test listens on. Before the fix the first read returned the password and the
connection was accepted.

The child runs Debian's ``/usr/bin/python3`` (the sandbox is standard library only): the shared
virtual environment's interpreter lives under ``/root`` and an unprivileged user cannot run it.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SECRET = "s3cret-redis-password-7f1c"
USER = "tetheruser"
SYSTEM_PYTHON = "/usr/bin/python3"

HOSTILE = r"""
import json, os, socket
found, pid = [], os.getpid()
for _ in range(4):
    with open(f"/proc/{pid}/status") as f:
        pid = int(next(l for l in f if l.startswith("PPid:")).split()[1])
    if pid <= 1:
        break
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            found.append([pid, "SECRET" if b"@@SECRET@@" in f.read() else "readable"])
    except OSError as exc:
        found.append([pid, type(exc).__name__])
try:
    socket.create_connection(("127.0.0.1", @@PORT@@), timeout=2).close()
    net = "connected"
except OSError as exc:
    net = type(exc).__name__ + ": " + str(exc)
print(json.dumps({"environ": found, "network": net}))
"""

GENERATOR = r"""
import asyncio, json, os, sys
from common.tools.registry import resolve_tools
from common.tools.sandbox import ToolSandbox

async def main():
    async with ToolSandbox(resolve_tools(["python"]), workers=1, isolation="rlimits",
                           scratch_dir=sys.argv[2]) as sandbox:
        result = await sandbox.call("python", {"code": open(sys.argv[1]).read()})
    print("RESULT " + json.dumps({"ok": result.ok, "text": result.text, "uid": os.getuid(),
                                  "isolation": sandbox.isolation}))

asyncio.run(main())
"""


def _as_user() -> tuple[int, int] | None:
    """(uid, gid) to run the child as: a non-root user (made here when root), or None."""
    if os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
                       check=True)  # fmt: skip
        pw = pwd.getpwnam(USER)
    return pw.pw_uid, pw.pw_gid


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")
def test_a_tool_cannot_read_the_generators_environment_or_reach_the_network():
    assert os.path.exists(SYSTEM_PYTHON), "Debian's python3 runs the unprivileged child"
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    work = Path(tempfile.mkdtemp(prefix="tether-secrets-"))
    try:
        (work / "hostile.py").write_text(
            HOSTILE.replace("@@SECRET@@", SECRET).replace("@@PORT@@", str(port))
        )
        (work / "generator.py").write_text(GENERATOR)
        scratch = work / "scratch"
        scratch.mkdir()
        ids = _as_user()
        if ids is not None:
            for path in (work, scratch, work / "hostile.py", work / "generator.py"):
                os.chown(path, *ids)
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(work),
               "TETHER_RUN__REDIS_URL": f"redis://tether:{SECRET}@redis:6379/0"}  # fmt: skip

        def drop() -> None:
            if ids is not None:
                os.setgroups([])
                os.setgid(ids[1])
                os.setuid(ids[0])

        proc = subprocess.run(
            [SYSTEM_PYTHON, str(work / "generator.py"), str(work / "hostile.py"), str(scratch)],
            env=env, cwd=work, preexec_fn=drop, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        assert line is not None, proc.stdout + proc.stderr
        result = json.loads(line[len("RESULT ") :])
        assert result["uid"] != 0 and result["isolation"] == "rlimits"
        assert result["ok"], result["text"]
        seen = json.loads(result["text"].strip().splitlines()[-1])
        # the tool's parent (the worker) shows only its scrubbed start-up environment; the
        # generator (its parent) holds the password and must not be readable
        assert all(what != "SECRET" for _, what in seen["environ"]), seen
        generator = [what for pid, what in seen["environ"] if pid == proc_pid_of(seen)]
        assert generator and generator[0] != "readable", seen
        assert seen["network"] != "connected", seen
    finally:
        listener.close()
        shutil.rmtree(work, ignore_errors=True)


def proc_pid_of(seen: dict) -> int:
    """The generator's pid in the tool's ancestry: the worker's parent (the second entry)."""
    return int(seen["environ"][1][0])
