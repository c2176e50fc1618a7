"""Generator test helpers: `tether generator` subprocesses (GeneratorProc), a learner-side weight
publisher for a tiny model's weights, prompt publishing and reads of the groups stream."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common.bus.client import Bus
from common.bus.settings import BusSettings
from common.protocol import streams, wire
from tests.procs.httpget import http_get  # noqa: F401  (re-exported for the tests)
from tests.procs.metrics_text import metric_value  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parents[2]


def make_bus(url: str, run: str) -> Bus:
    return Bus(BusSettings(url=url, run=run, block_ms=200, socket_timeout_s=5), service="test")


def model_weights(model_dir: str | Path, *, scale: float = 1.0) -> list[tuple[str, Any]]:
    """A tiny model's state dict as a learner publishes it: HF names, the tied ``lm_head.weight``
    left out (the engine reads the embedding). ``scale`` != 1 gives a different policy."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = []
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        out.append((name, (t * scale if scale != 1.0 and t.dim() == 2 else t).contiguous()))
    return out


def prompt(pid: str, *, index: int = 0, min_version: int = 0, text: str = "") -> wire.PromptMsg:
    return wire.PromptMsg(
        prompt_id=pid,
        cycle=0,
        index=index,
        text=text or f"Question {pid}: what is {index} + {index}?",
        ground_truth=str(2 * index),
        min_policy_version=min_version,
    )


def publish_prompts(bus: Bus, msgs: Sequence[wire.PromptMsg]) -> None:
    """XADD all in one MULTI/EXEC (one read can take them all)."""
    pipe = bus.redis.pipeline(transaction=True)
    for m in msgs:
        pipe.xadd(bus.key(streams.PROMPTS), {b"m": wire.encode(m)})
    pipe.execute()


def groups(bus: Bus) -> list[wire.TrajectoryGroup]:
    return [wire.decode(f[b"m"]) for _, f in bus.redis.xrange(bus.key(streams.GROUPS))]


def pending_by_consumer(bus: Bus) -> dict[str, int]:
    """Pending prompt entries per generator (XPENDING summary); {} before the group exists."""
    try:
        info = bus.redis.xpending(bus.key(streams.PROMPTS), streams.GENERATORS)
    except Exception:  # noqa: BLE001 - no stream or group yet
        return {}
    return {c["name"].decode(): int(c["pending"]) for c in info.get("consumers") or []}


def delivery_counts(bus: Bus) -> dict[str, int]:
    """Pending prompt entry id -> times delivered (a claim by another consumer adds one)."""
    rows = bus.redis.xpending_range(bus.key(streams.PROMPTS), streams.GENERATORS, "-", "+", 10_000)
    return {r["message_id"].decode(): int(r["times_delivered"]) for r in rows}


def pending_prompt_ids(bus: Bus, consumer: str) -> set[str]:
    """Prompt ids of the entries pending to ``consumer`` (taken, not yet committed)."""
    key = bus.key(streams.PROMPTS)
    rows = bus.redis.xpending_range(key, streams.GENERATORS, "-", "+", 10_000, consumer)
    out = set()
    for row in rows:
        entry_id = row["message_id"]
        for _, fields in bus.redis.xrange(key, entry_id, entry_id):
            out.add(wire.decode(fields[b"m"]).prompt_id)
    return out


def status_doc(bus: Bus, sid: str) -> dict | None:
    raw = bus.redis.hget(bus.key(streams.STATUS), f"generator:{sid}")
    return None if raw is None else json.loads(raw)


def engine_core_pids(pid: int) -> list[int]:
    """Pids of the vLLM engine-core processes below ``pid`` (vLLM names them ``VLLM::EngineCore``
    in /proc/PID/cmdline)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_bytes()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat[stat.rindex(b")") + 2 :].split()[1]) != parent:
                continue
            todo.append(int(entry))
            if b"EngineCore" in cmdline:
                found.append(int(entry))
    return found


class GeneratorProc:
    """`python -m tether.cli generator` in its own session; its log goes to a file."""

    def __init__(
        self, url: str, run: str, sid: str, model: str, log_dir: Path, *sets: str,
        env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        args = [sys.executable, "-m", "tether.cli", "generator", "--id", sid,
                "--set", f"run.name={run}", "--set", f"run.model={model}",
                "--set", "bus.block_ms=200", "--set", "generator.kv_cache_gib=1",
                "--set", "generator.gpu_memory_utilization=0.2"]  # fmt: skip
        for s in sets:
            args += ["--set", s]
        self.sid = sid
        self.log_path = log_dir / f"{sid}-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in cleanup()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TETHER_RUN__REDIS_URL": url, **(env or {})}
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)  # fmt: skip

    def tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def sigkill(self) -> None:
        """SIGKILL the whole process group (the service and its vLLM engine core): a crash."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.killed_at = time.monotonic()  # from here on nothing of it commits
        # Reaping can lag the kill: a fresh-clone run under load saw the SIGKILLed service still
        # unreaped after 10 s (tearing down a process with GBs mapped). It runs no code meanwhile.
        self.proc.wait(60)

    def cleanup(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(60)
        self.log.close()


def wait_until(pred: Callable[[], Any], timeout_s: float, what: str,
               procs: Sequence[GeneratorProc] = ()) -> Any:  # fmt: skip
    """Poll ``pred`` until truthy (returned); fail early with the log of a process that died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        for p in procs:
            if p.proc.poll() is not None:
                raise AssertionError(
                    f"{p.sid} exited ({p.proc.returncode}) while {what}:\n{p.tail()}"
                )
        time.sleep(0.1)
    logs = "\n".join(f"--- {p.sid}\n{p.tail()}" for p in procs)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{logs}")
