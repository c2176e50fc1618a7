"""The tool sandbox, seen from the generator: a pool of worker processes that run tool calls.

``ToolSandbox.call(name, arguments)`` never raises for anything a model can do: an unknown tool,
arguments that do not fit the schema, an exception in the tool, a timeout, output over its cap,
a worker that dies or is killed from outside — each comes back as a ``ToolResult`` with
``ok=False`` and an error text for the model. Calls run concurrently up to ``workers`` (one per
worker); the event loop is never blocked (pipes are read with asyncio), so a slow tool holds
only its own episode.

Isolation (``isolation``): ``namespaces`` starts each worker in fresh network, PID, mount, IPC
and UTS namespaces (``unshare``, as root) and the worker closes its jail
(``common.tools.jail``: no network, a read-only view of ``/usr`` and Python, a private
``/work``, a user id per slot, an empty environment); ``rlimits`` (what a non-root generator
gets) runs workers with the same per-call limits and an empty environment, in a new user and
network namespace where the kernel allows unprivileged ones (``unshare --user --net``: no
network), and makes the generator itself non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``), so a
tool running under the generator's own uid cannot read the generator's ``/proc/<pid>/environ``
(the Redis password), memory or open files through ``/proc``. What ``rlimits`` does not hide:
files the generator's uid can read on disk (run the generator under a uid that owns no
secrets on disk, or use ``namespaces``), and, where user namespaces are off, the network (the
log says so). ``auto`` takes ``namespaces`` where it works and says so in the log when it falls
back. Every worker kills what a call leaves behind (``common.tools.worker``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from common.tools.functions import ToolArgumentError, ToolSpec, check_arguments
from common.tools.jail import make_undumpable
from common.tools.worker import LEFTOVERS_S, MAX_FRAME_BYTES

log = logging.getLogger(__name__)

Isolation = Literal["auto", "namespaces", "rlimits"]
UNSHARE = ("--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child")
UNSHARE_NET = ("--user", "--net")  # rlimits mode: no network, without privileges
GRACE_S = 5.0  # a worker that misses a call's deadline by this much is wedged: restart it
LEFTOVERS_END_S = 60.0
UIDS_PER_PROCESS = 1024  # the slots' uids: 2,000,000 + (pid % 100,000) * this + a count
_UIDS_TAKEN = itertools.count()  # slots made in this process  # a worker ending over what it could not reap: how long its end may take
START_TIMEOUT_S = 30.0


class SandboxError(RuntimeError):
    """The sandbox cannot start as configured (the message names the setting and the fix)."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Per-call limits. Units in the names."""

    timeout_s: float = 10.0  # wall clock
    cpu_s: float = 10.0  # CPU time
    memory_mb: int = 512  # address space beyond the worker's own
    max_output_bytes: int = 64 * 1024  # printed output and returned value, each
    nproc: int = 16  # processes of the slot's user (fork bombs), namespaces only
    work_mb: int = 32  # the jail's tmpfs, /work included; the largest file written


@dataclass
class ToolResult:
    """One call's outcome. ``text`` is what the model reads."""

    ok: bool
    output: str = ""
    error: str = ""
    seconds: float = 0.0
    reason: str = ""  # for metrics: "" when ok, else a short bounded label

    @property
    def text(self) -> str:
        if self.ok:
            return self.output
        tail = f"\n{self.output[-500:]}" if self.output.strip() else ""
        return f"Error: {self.error}{tail}"


def _reason(error: str) -> str:
    for key in ("timed out", "output exceeded", "killed", "out of memory", "worker"):
        if key in error:
            return key.replace(" ", "_")
    return "tool_error"


@dataclass
class _Slot:
    index: int
    uid: int
    proc: asyncio.subprocess.Process | None = None
    isolation: str = ""
    workdir: str = ""
    calls: int = field(default=0)
    netns: bool = False  # rlimits mode in a user + network namespace


class ToolSandbox:
    def __init__(
        self,
        specs: list[ToolSpec],
        *,
        workers: int = 2,
        limits: SandboxLimits | None = None,
        isolation: Isolation = "auto",
        scratch_dir: str | None = None,
    ) -> None:
        if workers < 1:
            raise SandboxError(f"generator.tool_workers={workers}: need at least one worker")
        self.specs = {s.name: s for s in specs}
        self.limits = limits or SandboxLimits()
        self.requested: Isolation = isolation
        self.isolation = ""  # what the workers run with, once started
        self.scratch = scratch_dir or tempfile.gettempdir()
        # every slot of every sandbox of this process a uid of its own: a second sandbox (the
        # demo agent's, one per event loop, beside the generator's) sharing the first's uids
        # would share its RLIMIT_NPROC and could signal its tools
        first = next(_UIDS_TAKEN)
        for _ in range(workers - 1):
            next(_UIDS_TAKEN)
        uid_base = 2_000_000 + (os.getpid() % 100_000) * UIDS_PER_PROCESS
        self._slots = [_Slot(index=i, uid=uid_base + (first + i) % UIDS_PER_PROCESS)
                       for i in range(workers)]  # fmt: skip
        self._idle: asyncio.Queue[_Slot] = asyncio.Queue()
        self._next_id = 0
        self.restarts = 0

    # ------------------------------------------------------------------ workers
    def _can_isolate(self) -> str:
        if os.geteuid() != 0:
            return "the generator does not run as root"
        if shutil.which("unshare") is None:
            return "the `unshare` program (util-linux) is not installed"
        return ""

    def _command(self, slot: _Slot, isolate: bool) -> list[str]:
        config = {
            "tools": [asdict(s) for s in self.specs.values()],
            "isolate": isolate,
            "uid": slot.uid,
            "workdir": slot.workdir,
            "python": sys.executable,
            "limits": asdict(self.limits),
        }
        cmd = [sys.executable, "-m", "common.tools.worker", json.dumps(config)]
        if isolate:
            return ["unshare", *UNSHARE, "--", *cmd]
        return ["unshare", *UNSHARE_NET, "--", *cmd] if slot.netns else cmd

    async def _spawn(self, slot: _Slot, isolate: bool) -> dict[str, Any]:
        if not isolate and not slot.workdir:
            os.makedirs(self.scratch, exist_ok=True)
            slot.workdir = tempfile.mkdtemp(prefix=f"tool-slot{slot.index}-", dir=self.scratch)
        env = {
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)),
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LC_ALL": "C.UTF-8",
        }
        slot.proc = await asyncio.create_subprocess_exec(
            *self._command(slot, isolate),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        try:
            hello = await asyncio.wait_for(self._read(slot), START_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            await self._kill(slot)
            return {"ready": False, "error": f"the worker did not start: {exc!r}"}
        if not hello.get("ready"):
            await self._kill(slot)
        return dict(hello)

    async def _start_slot(self, slot: _Slot) -> None:
        why_not = self._can_isolate() if self.requested != "rlimits" else "rlimits requested"
        hello: dict[str, Any] = {"ready": False, "error": why_not}
        if not why_not:
            hello = await self._spawn(slot, isolate=True)
        if not hello.get("ready"):
            if self.requested == "namespaces":
                raise SandboxError(
                    f"generator.tool_sandbox = 'namespaces' but the tool jail cannot close: "
                    f"{hello.get('error')}. Run the generator as root on Linux with util-linux's "
                    "`unshare`, or set generator.tool_sandbox = 'auto' to accept per-call limits "
                    "without network and file isolation."
                )
            if self.requested == "auto" and slot.index == 0:
                log.warning(
                    "tool sandbox without namespaces (%s): tools run with per-call limits and an "
                    "empty environment but CAN reach the network and the file system",
                    hello.get("error"),
                )
            slot.netns = shutil.which("unshare") is not None
            hello = await self._spawn(slot, isolate=False)
            if not hello.get("ready") and slot.netns:  # no unprivileged user namespaces here
                if slot.index == 0:
                    log.warning("tool sandbox: no user namespace for the tools (%s); their "
                                "network stays open", hello.get("error"))  # fmt: skip
                slot.netns = False
                hello = await self._spawn(slot, isolate=False)
            if not hello.get("ready"):
                raise SandboxError(f"the tool sandbox cannot start: {hello.get('error')}")
        slot.isolation = str(hello["isolation"])

    async def start(self) -> None:
        """Start every worker (about 0.15 s each); ``isolation`` says what they run with. The
        generator becomes non-dumpable first (module docstring)."""
        make_undumpable()
        for slot in self._slots:
            await self._start_slot(slot)
            self._idle.put_nowait(slot)
        self.isolation = self._slots[0].isolation

    async def __aenter__(self) -> ToolSandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _kill(self, slot: _Slot) -> None:
        proc, slot.proc = slot.proc, None
        if proc is None:
            return
        if proc.returncode is None:
            try:
                proc.kill()  # unshare's --kill-child takes the PID namespace with it
            except ProcessLookupError:
                pass
        await proc.wait()

    async def _end_after_leftovers(self, slot: _Slot) -> None:
        """The worker could not reap what a call left within ``LEFTOVERS_S`` and ends (a
        process stuck in the kernel, as under heavy disk I/O, dies only once its I/O is done).
        Its PID namespace ends with it, once the kernel has reaped everything in it, and then
        ``unshare`` exits: waited for, so the slot's next worker starts with nothing left."""
        log.warning("tool slot %d: a call left processes its worker could not reap in %g s; "
                    "the worker ends and its PID namespace with it", slot.index, LEFTOVERS_S)  # fmt: skip
        assert slot.proc is not None
        try:
            await asyncio.wait_for(slot.proc.wait(), LEFTOVERS_END_S)
        except TimeoutError:
            log.error("tool slot %d: its worker's namespace did not end within %g s",
                      slot.index, LEFTOVERS_END_S)  # fmt: skip
        await self._kill(slot)  # restarted on its next call

    async def close(self) -> None:
        for slot in self._slots:
            if slot.proc is not None and slot.proc.stdin is not None:
                slot.proc.stdin.close()
            await self._kill(slot)
            if slot.workdir:
                shutil.rmtree(slot.workdir, ignore_errors=True)

    # ------------------------------------------------------------------ frames
    async def _read(self, slot: _Slot) -> dict[str, Any]:
        assert slot.proc is not None and slot.proc.stdout is not None
        head = await slot.proc.stdout.readexactly(4)
        (n,) = struct.unpack(">I", head)
        if n > MAX_FRAME_BYTES:
            raise ValueError(f"frame of {n} bytes")
        return dict(json.loads((await slot.proc.stdout.readexactly(n)).decode()))

    async def _write(self, slot: _Slot, obj: Any) -> None:
        assert slot.proc is not None and slot.proc.stdin is not None
        data = json.dumps(obj).encode()
        slot.proc.stdin.write(struct.pack(">I", len(data)) + data)
        await slot.proc.stdin.drain()

    # ------------------------------------------------------------------ calls
    async def call(self, name: str, arguments: Any) -> ToolResult:
        """Run one tool call; see the module docstring for what can come back."""
        spec = self.specs.get(name)
        if spec is None:
            known = ", ".join(sorted(self.specs)) or "none"
            return ToolResult(ok=False, error=f"unknown tool {name!r}; tools: {known}",
                              reason="unknown_tool")  # fmt: skip
        try:
            arguments = check_arguments(spec, arguments)
        except ToolArgumentError as exc:
            return ToolResult(ok=False, error=str(exc), reason="bad_arguments")
        slot = await self._idle.get()
        try:
            return await self._call_on(slot, name, arguments)
        finally:
            self._idle.put_nowait(slot)

    async def _call_on(self, slot: _Slot, name: str, arguments: dict[str, Any]) -> ToolResult:
        if slot.proc is None or slot.proc.returncode is not None:
            await self._kill(slot)
            self.restarts += 1
            await self._start_slot(slot)
        self._next_id += 1
        request = {"id": self._next_id, "tool": name, "arguments": arguments,
                   "timeout_s": self.limits.timeout_s}  # fmt: skip
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await self._write(slot, request)
            answer = await asyncio.wait_for(self._read(slot), self.limits.timeout_s + GRACE_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            await self._kill(slot)  # restarted on its next call
            what = "stopped answering" if isinstance(e, asyncio.TimeoutError) else "died"
            return ToolResult(ok=False, error=f"the sandbox worker {what} during the call",
                              seconds=loop.time() - started, reason="worker")  # fmt: skip
        slot.calls += 1
        if answer.get("leftovers"):
            await self._end_after_leftovers(slot)
        ok = bool(answer.get("ok"))
        error = str(answer.get("error", ""))
        return ToolResult(
            ok=ok,
            output=str(answer.get("output", "")),
            error=error,
            seconds=float(answer.get("seconds", loop.time() - started)),
            reason="" if ok else _reason(error),
        )

    def worker_pids(self) -> list[int]:
        """The workers' process ids (the ``unshare`` wrappers when isolated), for tests."""
        return [s.proc.pid for s in self._slots if s.proc is not None]
