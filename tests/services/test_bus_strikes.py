"""Redelivery is not poison (``common.bus.strikes``), with real consumer processes against both
servers: a consumer that restarts while holding entries on purpose, or stops on purpose, never
dead-letters them, however often; a message that kills its consumer every time is dead-lettered,
alone, and the entries that were in hand beside it go on."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from common.bus.client import Bus
from common.bus.consumer import Consumer
from common.bus.server import EmbeddedRedis
from common.bus.settings import BusSettings
from common.protocol import streams, wire
from tests.paths import REPO

pytestmark = pytest.mark.slow


@pytest.fixture
def bus(tmp_path, server_binary):
    server = EmbeddedRedis(tmp_path, binary=server_binary).start()
    s = BusSettings(
        url=server.url, run="r" + uuid.uuid4().hex[:8], block_ms=100, socket_timeout_s=5
    )
    b = Bus(s, service="test")
    yield b
    b.close()
    server.stop()


def _publish(bus: Bus, n: int) -> None:
    bus.ensure_group("in", "workers")
    for i in range(n):
        bus.publish("in", wire.PromptMsg(prompt_id=f"p{i}", cycle=0, index=i, text="q"))


def _consumer(bus: Bus, *flags: str) -> int:
    """Run tests/procs/bus_consumer.py once as consumer "c"; its exit code (-9: SIGKILLed)."""
    cmd = [sys.executable, "-m", "tests.procs.bus_consumer", "--url", bus.settings.url,
           "--run", bus.settings.run, "--name", "c", "--batch", "8",
           "--exit-after-idle-s", "0.5", *flags]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=REPO, env=env, timeout=60).returncode


def _out(bus: Bus) -> list[str]:
    return sorted(wire.decode(f[b"m"]).prompt_id for _, f in bus.redis.xrange(bus.key("out")))


def _dead(bus: Bus) -> list[tuple[str, str]]:
    rows = bus.redis.xrange(bus.key(streams.DEAD))
    return [(f[b"reason"].decode(), f[b"ref"].decode()) for _, f in rows]


def _marks_left(bus: Bus) -> int:
    return sum(
        bus.redis.hlen(bus.key(name("in", "workers")))
        for name in (streams.in_hand, streams.strikes)
    )


def _restarted(bus: Bus, *, let_go: bool = False, **kw) -> list[str]:
    """A consumer "c" as a restarted process sees it (a new client, its own pending first);
    ``let_go``: then stopped on purpose (what the services do on SIGTERM)."""
    again = Bus(bus.settings, service="test")
    try:
        consumer = Consumer(again, "in", "workers", "c", **kw)
        got = [d.msg.prompt_id for d in consumer.read(8)]
        if let_go:
            consumer.let_go()
        return got
    finally:
        again.close()


def test_a_holder_restarted_more_often_than_max_deliveries_keeps_its_entries(bus):
    # the learner's pattern: read, hold pending (no ack), die; seven times with max_deliveries 5
    _publish(bus, 3)
    for _ in range(7):
        assert _restarted(bus, claims=False, track_strikes=False) == ["p0", "p1", "p2"]
    assert _dead(bus) == []
    assert bus.backlog("in", "workers") == (0, 3)  # still pending, delivered 7 times by Redis
    assert _consumer(bus) == 0  # then a real process works on them
    assert _out(bus) == ["p0", "p1", "p2"] and _dead(bus) == []


def test_a_consumer_stopped_on_purpose_lets_go_without_a_strike(bus):
    _publish(bus, 3)
    assert _consumer(bus, "--let-go") == 0  # a real process, stopped mid-batch
    for _ in range(6):
        assert _restarted(bus, let_go=True) == ["p0", "p1", "p2"]
    assert _dead(bus) == [] and _marks_left(bus) == 0
    assert _consumer(bus) == 0
    assert _out(bus) == ["p0", "p1", "p2"]


def test_a_message_that_kills_its_consumer_is_dead_lettered_alone(bus):
    # p3 SIGKILLs its consumer every time; it is taken in a batch of 8 with seven good entries
    _publish(bus, 8)
    codes = []
    while len(codes) < 12 and (not codes or codes[-1] != 0):
        codes.append(_consumer(bus, "--poison", "p3"))
    # 2 crashes with the whole batch in hand, then p3 alone: 3 more crashes, the 6th delivery
    # finds 5 strikes (bus.max_deliveries) and dead-letters it
    assert codes == [-9] * 5 + [0], codes
    assert _dead(bus) == [("max_deliveries", "p3")]
    assert _out(bus) == [f"p{i}" for i in range(8) if i != 3]  # each exactly once
    assert bus.backlog("in", "workers") == (0, 0)
    assert _marks_left(bus) == 0  # the marks leave with the acknowledgements
