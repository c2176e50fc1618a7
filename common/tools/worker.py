"""A sandbox worker: serves tool calls one at a time, each in a process of its own.

Started by ``common.tools.sandbox`` as ``python -m common.tools.worker CONFIG`` (inside fresh
namespaces when it can: see ``common.tools.jail``). It imports its tools, closes its jail, says
``ready``, then answers requests read from stdin with results written to stdout, both as
frames (a 4-byte big-endian length, then UTF-8 JSON; never pickle).

Per call it forks a child that sets the call's limits and runs it:

- ``RLIMIT_AS`` (memory: ``memory_mb`` more than the worker's own address space, or in all for
  the ``python`` tool's fresh interpreter), ``RLIMIT_CPU`` (``cpu_s``; SIGXCPU past it),
  ``RLIMIT_NPROC`` (``nproc`` processes of the slot's user), ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``,
  no core files;
- stdout and stderr go to a pipe the worker reads up to ``max_output_bytes``; past that, or past
  the wall-clock ``timeout_s``, the call is killed;
- function tools return their value through a second pipe; the ``python`` tool is a fresh
  ``python -I -S`` running the code from ``/work/main.py``: what it prints is the answer.

After every call the worker kills every process the call left (in the jail it is the PID
namespace's init: ``kill(-1)`` reaches them all, daemons included), reaps them, and empties
``/work``, so nothing carries over to the next call. Should some still be there after
``LEFTOVERS_S``, its answer says so (``leftovers``) and the worker ends after it: the kernel
kills what is left in the namespace, and the pool starts a fresh worker. Every outcome is a result frame
``{"id", "ok", "output", "error", "seconds"}``; the worker itself exits only at end of input.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import struct
import sys
import time
from typing import Any, BinaryIO

from common.tools import jail
from common.tools.functions import ToolSpec
from common.tools.registry import callable_of

MAX_FRAME_BYTES = 16 * 1024 * 1024
# after a call, what it left is killed and reaped for at most this long (a fork bomb's thousands
# of processes on a loaded machine can take more than a second); past it the worker ends, and
# its PID namespace with everything in it
LEFTOVERS_S = 3.0
_SIGNALS: dict[int, str] = {signal.SIGXCPU: "its CPU time limit", signal.SIGKILL: "SIGKILL"}


def write_frame(stream: BinaryIO, obj: Any) -> None:
    data = json.dumps(obj).encode()
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def _read_exactly(stream: BinaryIO, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def read_frame(stream: BinaryIO) -> Any | None:
    """The next frame's object, or None at end of input."""
    head = _read_exactly(stream, 4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {n} bytes is over {MAX_FRAME_BYTES}")
    return json.loads(_read_exactly(stream, n).decode())


def _vm_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc in the jail: measured before it closed
        return _VM_AT_START


_VM_AT_START = 0


class Worker:
    def __init__(self, config: dict[str, Any]) -> None:
        self.cfg = config
        self.limits: dict[str, Any] = config["limits"]
        self.isolated = False
        self.work = config.get("workdir") or "/work"
        self.functions: dict[str, Any] = {}
        self.kinds: dict[str, str] = {}

    # ------------------------------------------------------------------ start-up
    def start(self) -> dict[str, Any]:
        global _VM_AT_START

        for t in self.cfg["tools"]:
            spec = ToolSpec(**t)
            self.kinds[spec.name] = spec.kind
            if spec.kind == "function":
                self.functions[spec.name] = callable_of(spec)
        _VM_AT_START = _vm_bytes()
        python = os.path.realpath(self.cfg["python"])
        if self.cfg["isolate"]:
            jail.close_jail(uid=self.cfg["uid"], work_mb=self.limits["work_mb"], python=python)
            self.isolated, self.work = True, jail.WORK
        else:
            os.makedirs(self.work, exist_ok=True)
            os.chdir(self.work)
        jail.clean_environment(self.work)
        self.python = python
        return {"ready": True, "isolation": "namespaces" if self.isolated else "rlimits"}

    # ------------------------------------------------------------------ one call
    def _set_limits(self, *, fresh_image: bool) -> None:
        mb = self.limits["memory_mb"] * 2**20
        address_space = mb if fresh_image else _vm_bytes() + mb
        cpu = int(self.limits["cpu_s"]) + 1
        for what, value in (
            (resource.RLIMIT_AS, address_space),
            (resource.RLIMIT_CPU, cpu),
            (resource.RLIMIT_FSIZE, self.limits["work_mb"] * 2**20),
            (resource.RLIMIT_NOFILE, 64),
            (resource.RLIMIT_CORE, 0),
        ):
            resource.setrlimit(what, (value, value))
        if self.isolated:  # a uid of this slot's own: the count is this call's processes
            resource.setrlimit(resource.RLIMIT_NPROC, (self.limits["nproc"],) * 2)

    def _child(self, request: dict[str, Any], out_w: int, res_w: int) -> None:
        """In the forked child: limits, then the call. Never returns."""
        code = 0
        try:
            if not self.isolated:
                os.setpgid(0, 0)
            devnull = os.open("/dev/null", os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(out_w, 1)
            os.dup2(out_w, 2)
            if self.kinds.get(request["tool"]) == "python":
                with open(os.path.join(self.work, "main.py"), "w") as f:
                    f.write(request["arguments"]["code"])
                self._set_limits(fresh_image=True)
                env = {"HOME": self.work, "PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
                os.execve(self.python, [self.python, "-I", "-S", "main.py"], env)
            self._set_limits(fresh_image=False)
            value = self.functions[request["tool"]](**request["arguments"])
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            result = {"ok": True, "output": text}
        except MemoryError:
            result = {"ok": False, "error": f"out of memory (limit {self.limits['memory_mb']} MB)"}
        except BaseException as exc:  # the tool's own error is the answer
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            code = 1
        try:
            os.write(res_w, json.dumps(result).encode())
        finally:
            os._exit(code)

    def _collect(self, pid: int, fds: dict[int, bytearray], deadline: float) -> tuple[str, Any]:
        """Read the child's pipes until it exits, the deadline passes or output runs over its
        cap. Returns (what ended it, the child's wait status or None)."""
        cap = self.limits["max_output_bytes"]
        status = None
        while True:
            if status is None:
                done, st = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = st
            wait = 0.0 if status is not None else min(0.05, max(deadline - time.monotonic(), 0))
            if not fds:  # both pipes closed: wait for the exit itself
                time.sleep(wait / 10)
            ready = select.select(list(fds), [], [], wait)[0] if fds else []
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    fds.pop(fd)
                    continue
                fds[fd] += chunk
                if len(fds[fd]) > cap:
                    return "output", status
            if status is not None and not ready:
                return "exited", status
            if status is None and time.monotonic() >= deadline:
                return "timeout", None

    def _kill_leftovers(self, pid: int) -> bool:
        """Kill the call and everything it started; reap them all. False when some were still
        there after ``LEFTOVERS_S`` (a fork bomb on a loaded machine): the worker then ends after
        its answer, and the PID namespace with it (``serve``)."""
        deadline = time.monotonic() + LEFTOVERS_S
        while True:
            try:
                if self.isolated:
                    os.kill(-1, signal.SIGKILL)  # init of the PID namespace: all but itself
                else:
                    os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            except ChildProcessError:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def _empty_work(self) -> None:
        for name in os.listdir(self.work):
            path = os.path.join(self.work, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        started = time.monotonic()
        out_r, out_w = os.pipe()
        res_r, res_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(out_r)
            os.close(res_r)
            os.close(self.proto_in)
            os.close(self.proto_out)
            self._child(request, out_w, res_w)
        os.close(out_w)
        os.close(res_w)
        fds = {out_r: bytearray(), res_r: bytearray()}
        output, result = fds[out_r], fds[res_r]
        ended, status = self._collect(pid, dict(fds), started + float(request["timeout_s"]))
        clean = self._kill_leftovers(pid)
        os.close(out_r)
        os.close(res_r)
        self._empty_work()
        answer = self._answer(request, ended, status, bytes(output), bytes(result))
        if not clean:
            answer["leftovers"] = True  # the sandbox waits for this worker's end (serve)
        return {**answer, "id": request["id"], "seconds": time.monotonic() - started}

    def _answer(
        self, request: dict[str, Any], ended: str, status: Any, output: bytes, result: bytes
    ) -> dict[str, Any]:
        cap = self.limits["max_output_bytes"]
        if ended == "timeout":
            return {"ok": False, "error": f"timed out after {request['timeout_s']:g} s"}
        if ended == "output":
            return {"ok": False, "error": f"output exceeded {cap} bytes; the call was stopped"}
        text = output.decode(errors="replace")
        if status is not None and os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            name = _SIGNALS.get(sig, signal.Signals(sig).name)
            return {"ok": False, "error": f"the tool process was killed by {name}", "output": text}
        if self.kinds.get(request["tool"]) == "python":
            code = os.WEXITSTATUS(status) if status is not None else -1
            if code != 0:
                return {"ok": False, "error": f"exit code {code}", "output": text}
            return {"ok": True, "output": text}
        try:
            return dict(json.loads(result.decode()))
        except ValueError:
            return {"ok": False, "error": "the tool process ended without a result"}

    # ------------------------------------------------------------------ serve
    def serve(self) -> None:
        # the protocol's descriptors are kept away from 0-2, which the calls' children reuse
        self.proto_in, self.proto_out = os.dup(0), os.dup(1)
        null = os.open("/dev/null", os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(2, 1)
        reader = os.fdopen(self.proto_in, "rb", buffering=0)
        writer = os.fdopen(self.proto_out, "wb", buffering=0)
        try:
            hello = self.start()
        except Exception as exc:
            write_frame(writer, {"ready": False, "error": f"{type(exc).__name__}: {exc}"})
            return
        write_frame(writer, hello)
        while True:
            request = read_frame(reader)
            if request is None:
                return
            answer = self.call(request)
            write_frame(writer, answer)
            if answer.get("leftovers"):  # ending takes the PID namespace, and what is left in it
                return


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool stops workers by closing stdin
    Worker(json.loads(sys.argv[1])).serve()


if __name__ == "__main__":
    main()
