"""Scorer test helpers: realistic TrajectoryGroups, `tether scorer` subprocesses (ScorerProc), reads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from common.bus.client import Bus
from common.bus.settings import BusSettings
from common.protocol import streams, wire
from tests.paths import REPO
from tests.procs.httpget import http_get  # noqa: F401  (re-exported for the tests)
from tests.procs.metrics_text import metric_value  # noqa: F401  (re-exported for the tests)


def make_group(
    group_id: str, responses: list[str], ground_truth: str | None, *, index: int = 0
) -> wire.TrajectoryGroup:
    """A group as a generator publishes it: packed token ids, behaviour log-probs, spans."""
    rng = np.random.default_rng(abs(hash(group_id)) % 2**32)
    prompt = f"Problem {index}: compute the value. Put the final answer in \\boxed{{}}."
    samples = []
    for j, text in enumerate(responses):
        n = max(1, len(text.encode()))
        samples.append(
            wire.Trajectory.single_turn(
                sample_id=f"{group_id}/{j}",
                sample_index=j,
                token_ids=rng.integers(0, 259, n).astype(np.uint32),
                logprobs=-rng.exponential(0.7, n).astype(np.float32),
                version_spans=[(0, 3)],
                finish_reason="stop",
                response_text=text,
                timings={"generate_s": 0.5},
            )
        )
    return wire.TrajectoryGroup(
        group_id=group_id,
        prompt_id=f"p-{group_id}",
        cycle=0,
        index=index,
        split="train",
        prompt_token_ids=np.frombuffer(prompt.encode(), dtype=np.uint8).astype(np.uint32),
        prompt_text=prompt,
        ground_truth=ground_truth,
        metadata={"source": "test"},
        generator_id="gen-0",
        samples=samples,
    )


def test_bus(url: str, run: str) -> Bus:
    return Bus(BusSettings(url=url, run=run, block_ms=200, socket_timeout_s=5), service="test")


test_bus.__test__ = False  # a helper, not a test


def publish_all(bus: Bus, groups: list[wire.TrajectoryGroup]) -> None:
    """XADD all in one MULTI/EXEC, so a blocked scorer receives them in one read (one batch)."""
    pipe = bus.redis.pipeline(transaction=True)
    for g in groups:
        pipe.xadd(bus.key(streams.GROUPS), {b"m": wire.encode(g)})
    pipe.execute()


def scored(bus: Bus) -> list[wire.ScoredGroup]:
    entries = bus.redis.xrange(bus.key(streams.SCORED))
    return [wire.decode(fields[b"m"]) for _, fields in entries]


def dead(bus: Bus) -> list[dict[str, str]]:
    out = []
    for _, fields in bus.redis.xrange(bus.key(streams.DEAD)):
        out.append({k.decode(): v for k, v in fields.items()})
    return out


def pending(bus: Bus) -> int:
    try:
        return int(bus.redis.xpending(bus.key(streams.GROUPS), streams.SCORERS)["pending"])
    except Exception:  # noqa: BLE001 - no group yet
        return 0


class ScorerProc:
    """`python -m tether.cli scorer` in its own session; logs go to a file for failure messages."""

    def __init__(self, url: str, run: str, sid: str, log_dir: Path, *sets: str,
                 env: dict[str, str] | None = None, metrics_port: int = 0) -> None:  # fmt: skip
        args = [sys.executable, "-m", "tether.cli", "scorer", "--id", sid,
                "--set", f"run.redis_url={url}", "--set", f"run.name={run}",
                "--set", "bus.block_ms=200", "--set", "scorer.grader_workers=2",
                "--set", f"scorer.metrics_port={metrics_port}"]  # fmt: skip
        for s in sets:
            args += ["--set", s]
        self.log_path = log_dir / f"{sid}-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()/kill()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=full_env, start_new_session=True)  # fmt: skip

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def sigkill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM, wait for a clean exit; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.cleanup()
                raise AssertionError(f"scorer did not stop on SIGTERM:\n{self.tail()}") from None
        return int(self.proc.returncode)

    def cleanup(self) -> None:
        """SIGKILL whatever is left of our own process group (grading workers included)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.log.close()


def wait_until(pred: Callable[[], bool], timeout_s: float, what: str,
               procs: tuple[ScorerProc, ...] = ()) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        for p in procs:
            if p.proc.poll() is not None:
                raise AssertionError(
                    f"scorer exited ({p.proc.returncode}) while {what}:\n{p.tail()}"
                )
        time.sleep(0.1)
    logs = "\n".join(p.tail() for p in procs)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{logs}")
