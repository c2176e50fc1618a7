"""A run that ends, ends everywhere: the learner's run-finished record (``common.service.run_end``)
against a real Redis-protocol server, and real `tether scorer` / `tether generator` processes that
stop by themselves with exit code 0 when it appears: idle, blocked on back-pressure, or started
after the end. A SIGTERM before the end is a stop (75), not a finish. (A generator with a running
vLLM engine: the last test of test_generator_service.py; `tether train`: tests/e2e/test_e2e.py.)"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest

from common.protocol import streams
from common.service import run_end
from common.service.exit_codes import EXIT_STOPPED
from tests.paths import REPO
from tests.procs.scorer_proc import (
    ScorerProc,
    make_group,
    pending,
    publish_all,
    scored,
    test_bus,
    wait_until,
)
from tether.demo.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow  # scorer processes with grading workers

CYCLES = 7  # run.num_cycles of the services below
EXIT_WITHIN_S = 20.0  # run_end.POLL_S + one bus read + stopping the grading workers, with margin


def _run() -> str:
    return f"end{uuid.uuid4().hex[:8]}"


@pytest.fixture
def procs(tmp_path):
    started: list[ScorerProc] = []

    def start(url, run, sid, *sets) -> ScorerProc:
        p = ScorerProc(url, run, sid, tmp_path, f"run.num_cycles={CYCLES}", *sets)
        started.append(p)
        return p

    yield start
    for p in started:
        p.cleanup()


def _exit_code(p: ScorerProc, timeout_s: float) -> int:
    try:
        return int(p.proc.wait(timeout_s))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after {timeout_s} s:\n{p.tail()}") from None


def test_the_record_ends_only_a_run_of_its_length(redis_server):
    bus = test_bus(redis_server.url, _run())
    assert run_end.finished(bus, num_cycles=CYCLES) is None
    run_end.mark_finished(bus, num_cycles=CYCLES, version=21)
    assert run_end.finished(bus, num_cycles=CYCLES)["version"] == 21
    assert run_end.finished(bus, num_cycles=CYCLES - 1) is not None
    # num_cycles raised to extend the run under the same name: not finished
    assert run_end.finished(bus, num_cycles=CYCLES + 1) is None
    run_end.clear(bus)  # what a learner resuming below its end does
    assert run_end.finished(bus, num_cycles=CYCLES) is None
    bus.set(streams.RUN_FINISHED, "not json")
    assert run_end.finished(bus, num_cycles=CYCLES) is None


def test_scorers_stop_by_themselves_idle_or_blocked_on_back_pressure(redis_server, procs):
    run = _run()
    bus = test_bus(redis_server.url, run)
    # `blocked` may hold one scored group in the learner's backlog: after the first batch it
    # has scored the next one and waits for room that a finished learner never makes
    blocked = procs(redis_server.url, run, "scorer-0", "bus.max_backlog=1")
    publish_all(bus, [make_group("g0", ["\\boxed{1}"], "1")])
    wait_until(lambda: len(scored(bus)) == 1, 90, "the first scored group", (blocked,))
    publish_all(bus, [make_group("g1", ["\\boxed{2}"], "2", index=1)])
    wait_until(lambda: pending(bus) == 1, 30, "the second group taken", (blocked,))
    time.sleep(1.0)
    assert len(scored(bus)) == 1 and pending(bus) == 1, "not blocked on back-pressure"
    idle = procs(redis_server.url, run, "scorer-1")
    wait_until(
        lambda: "scorer:scorer-1" in bus.read_statuses(), 60, "scorer-1's heartbeat", (idle,)
    )

    run_end.mark_finished(bus, num_cycles=CYCLES, version=14)
    t0 = time.monotonic()
    for p in (blocked, idle):
        assert _exit_code(p, EXIT_WITHIN_S) == 0, p.tail()
        assert "the run is finished" in p.tail()
    assert time.monotonic() - t0 < EXIT_WITHIN_S
    assert len(scored(bus)) == 1  # the blocked batch was given up, not forced through


def test_a_scorer_started_after_the_end_exits_0_at_once(redis_server, procs):
    run = _run()
    bus = test_bus(redis_server.url, run)
    run_end.mark_finished(bus, num_cycles=CYCLES, version=14)
    p = procs(redis_server.url, run, "scorer-0")
    assert _exit_code(p, 60) == 0, p.tail()
    assert "the run is already finished" in p.tail()
    assert "scorer:scorer-0" not in bus.read_statuses()  # it never served


def test_a_longer_run_under_the_same_name_keeps_its_scorer(redis_server, procs):
    run = _run()
    bus = test_bus(redis_server.url, run)
    run_end.mark_finished(bus, num_cycles=CYCLES - 1, version=12)  # an earlier, shorter run
    p = procs(redis_server.url, run, "scorer-0")
    wait_until(lambda: "scorer:scorer-0" in bus.read_statuses(), 60, "its heartbeat", (p,))
    time.sleep(2 * run_end.POLL_S)
    assert p.proc.poll() is None
    assert p.stop() == EXIT_STOPPED  # SIGTERM before the end: stopped, not finished


def test_a_generator_started_after_the_end_exits_0_before_its_engine(redis_server, tmp_path):
    run = _run()
    bus = test_bus(redis_server.url, run)
    run_end.mark_finished(bus, num_cycles=CYCLES, version=14)
    model = build_tiny_model(tmp_path / "tiny", seed=1)
    args = [sys.executable, "-m", "tether.cli", "generator", "--id", "generator-0",
            "--set", f"run.name={run}", "--set", f"run.model={model}",
            "--set", f"run.redis_url={redis_server.url}", "--set", f"run.num_cycles={CYCLES}",
            "--set", "generator.kv_cache_gib=1"]  # fmt: skip
    res = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout + res.stderr
    assert "the run is already finished" in out and "vllm" not in out.lower(), out[-2000:]
