"""Positions that no stream holds any more (Redis evicted a key, or restarted without its data)
are dispatched again instead of waited for forever, and a wait without progress is reported
(``services/learner/watchdog.py``); against a real Redis server, with rank 0's real bus, the
test standing in for the generators and scorers."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from common.bus.consumer import Consumer
from common.protocol import wire
from common.protocol.streams import GENERATORS, PROMPTS, SCORED
from services.learner import watchdog
from tests.services.test_learner_service import _scored
from tests.services.test_lost_positions import WAIT_S, _bus_side, _metric


@pytest.fixture(autouse=True)
def fast_watchdog(monkeypatch):
    monkeypatch.setattr(watchdog, "CHECK_EVERY_S", 0.3)


def _answer(io, prompts: list[wire.PromptMsg]) -> None:
    for p in prompts:
        sg = _scored(p.cycle, p.index)
        group = wire.TrajectoryGroup(**{**sg.group.__dict__, "group_id": p.prompt_id,
                                        "prompt_id": p.prompt_id})  # fmt: skip
        io.bus.publish(SCORED, wire.ScoredGroup(**{**sg.__dict__, "group": group}))


def test_positions_whose_stream_vanished_are_dispatched_again(redis_server, tmp_path, caplog):
    io = _bus_side(tmp_path, "evicted", redis_server.url, num_cycles=1)
    before = _metric("tether_learner_redispatched_positions_total")
    try:
        io.dispatch(0, first_cycle=0)
        gen = Consumer(io.bus, PROMPTS, GENERATORS, "generator-0")
        taken = gen.read(64, 100)
        assert sorted(d.msg.index for d in taken) == [0, 1, 2, 3]
        done = [d for d in taken if d.msg.index in (0, 1)]
        gen.commit(done)  # positions 0 and 1 went on to be generated and scored
        _answer(io, [d.msg for d in done])
        io.bus.redis.delete(io.bus.key(PROMPTS))  # evicted: 2 and 3 vanish with their stream

        redispatched: list[wire.PromptMsg] = []
        stop = threading.Event()

        def generator() -> None:  # answers what the learner dispatches again
            again = Consumer(io.bus, PROMPTS, GENERATORS, "generator-1")
            while not stop.is_set():
                batch = again.read(8, 100)
                redispatched.extend(d.msg for d in batch)
                _answer(io, [d.msg for d in batch])
                again.ack(batch)

        helper = threading.Thread(target=generator, daemon=True)
        helper.start()
        caplog.set_level(logging.ERROR, logger="services.learner.watchdog")
        deadline = time.monotonic() + WAIT_S
        groups = io.collect(0, stop=lambda: time.monotonic() > deadline)
        stop.set()
        helper.join(5)
        assert groups is not None, "cycle 0 still waits for positions nothing holds"
        assert sorted(g.group.index for g in groups) == [0, 1, 2, 3]
        assert sorted(p.index for p in redispatched) == [2, 3]
        assert all(p.prompt_id.endswith("/r1") for p in redispatched)  # new ids: no dedupe
        assert _metric("tether_learner_redispatched_positions_total") - before == 2
        (said,) = [
            r.getMessage() for r in caplog.records if "can no longer arrive" in r.getMessage()
        ]
        assert "cycle 0: 2 position(s) [2, 3]" in said
    finally:
        io.close()


def test_a_wait_without_progress_is_reported_with_where_things_sit(redis_server, tmp_path, caplog):
    io = _bus_side(tmp_path, "stalled", redis_server.url, "learner.no_progress_s=0.5", num_cycles=1)
    try:
        io.dispatch(0, first_cycle=0)
        Consumer(io.bus, PROMPTS, GENERATORS, "generator-0").read(1, 100)  # held, never finished
        caplog.set_level(logging.ERROR, logger="services.learner.watchdog")
        deadline, seen = time.monotonic() + 2.5, {}

        def stop() -> bool:  # what status and Prometheus show while it waits
            seen.update(metric=_metric("tether_learner_no_progress_seconds"),
                        silent=io.watchdog.silent_s)  # fmt: skip
            return time.monotonic() > deadline

        assert io.collect(0, stop=stop) is None
        said = [r.getMessage() for r in caplog.records if "no progress for" in r.getMessage()]
        assert said and "in flight: prompts 4, groups 0, scored 0" in said[0], said
        assert not any("can no longer arrive" in r.getMessage() for r in caplog.records)
        assert seen["metric"] >= 0.5 and seen["silent"] >= 2.0
        # not waiting any more: nothing to report (training is not a stall)
        assert io.watchdog.silent_s == 0.0 and _metric("tether_learner_no_progress_seconds") == 0
    finally:
        io.close()
