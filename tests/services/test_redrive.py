"""`tether bus redrive`: dead letters go back to their stream once their cause is fixed, against
a real server: only whole training messages of cycles the learner has still to train, filtered
by reason, never while the learner runs; a stopped local run's embedded server is started for
the command (and its data, AOF, kept)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from common.bus.client import Bus
from common.bus.consumer import Consumer
from common.bus.server import EmbeddedRedis
from common.bus.settings import BusSettings
from common.protocol import streams, wire
from tests.services.test_learner_service import _scored
from tests.services.test_status import make_run_dir, tether


def _learner_heartbeat(bus: Bus, *, cycle: int, age_s: float) -> None:
    doc = {
        "service": "learner",
        "id": "learner-0",
        "cycle": cycle,
        "heartbeat": time.time() - age_s,
    }
    bus.write_status("learner", "learner-0", json.dumps(doc))


def _dead_letter(bus: Bus, stream: str, msg: wire.Message, reason: str) -> None:
    """As a consumer does (``Consumer.dead_letter``): the whole message kept."""
    bus.publish(stream, msg)
    group = {"groups": streams.SCORERS, "scored": streams.LEARNER}[stream]
    consumer = Consumer(bus, stream, group, "c")
    (d,) = consumer.read(1, 100)
    consumer.dead_letter(d, reason, "test")


def _fill(bus: Bus) -> None:
    _dead_letter(bus, "groups", _scored(4, 16).group, "max_deliveries")  # cycle 4: re-drivable
    _dead_letter(bus, "groups", _scored(5, 20).group, "unscorable")  # re-drivable, other reason
    _dead_letter(bus, "scored", _scored(2, 8), "max_deliveries")  # cycle 2: trained without it
    bus.publish_raw("groups", {b"m": b"\xc1\xc1"})  # undecodable: kept
    Consumer(bus, "groups", streams.SCORERS, "c").read(1, 100)


def _reasons(bus: Bus) -> list[str]:
    return [f[b"reason"].decode() for _, f in bus.redis.xrange(bus.key(streams.DEAD))]


def test_redrive_moves_what_can_be_trained_back_and_keeps_the_others(
    redis_server, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("TETHER_REDIS_URL", raising=False)
    run_dir = make_run_dir(tmp_path, "rd_live")
    bus = Bus(BusSettings(url=redis_server.url, run="rd_live"), service="test")
    _fill(bus)
    assert _reasons(bus) == ["max_deliveries", "unscorable", "max_deliveries", "undecodable"]
    argv = ["bus", "redrive", "--run", str(run_dir), "--redis-url", redis_server.url]

    _learner_heartbeat(bus, cycle=4, age_s=1.0)  # the learner runs: refused
    code, _, err = tether([*argv, "--reason", "max_deliveries"], capsys)
    assert code == 2 and "is running" in err and "tether train --resume" in err
    code, out, _ = tether([*argv, "--dry-run"], capsys)
    assert code == 0 and "would re-drive 2 dead letter(s)" in out
    assert len(_reasons(bus)) == 4  # a dry run moves nothing

    _learner_heartbeat(bus, cycle=4, age_s=60.0)  # stopped at cycle 4
    code, out, err = tether([*argv, "--reason", "max_deliveries"], capsys)
    assert code == 0, err
    assert "re-drove 1 dead letter(s) (max_deliveries 1)" in out
    assert "kept 1 that cannot be re-driven (max_deliveries 1)" in out  # cycle 2's
    assert _reasons(bus) == ["unscorable", "max_deliveries", "undecodable"]
    back = wire.decode(bus.redis.xrevrange(bus.key("groups"), count=1)[0][1][b"m"])
    assert (back.cycle, back.index) == (4, 16)  # whole, as it was
    (again,) = Consumer(bus, "groups", streams.SCORERS, "scorer-0").read(8, 100)
    assert again.msg.group_id == back.group_id and again.strikes == 0  # consumed as new
    bus.close()


def test_redrive_starts_a_stopped_local_runs_server(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TETHER_REDIS_URL", raising=False)
    run_dir = make_run_dir(tmp_path, "rd_local")
    server = EmbeddedRedis(Path(run_dir) / "redis").start()  # the run's own, as `tether train`
    bus = Bus(BusSettings(url=server.url, run="rd_local"), service="test")
    _dead_letter(bus, "groups", _scored(4, 16).group, "max_deliveries")
    _learner_heartbeat(bus, cycle=4, age_s=60.0)
    bus.close()
    server.stop()  # the run is over; its data is in the AOF
    code, out, err = tether(["bus", "redrive", "--run", str(run_dir)], capsys)
    assert code == 0, err
    assert "re-drove 1 dead letter(s) (max_deliveries 1)" in out
    server = EmbeddedRedis(Path(run_dir) / "redis").start()  # stopped again after the command
    try:
        bus = Bus(BusSettings(url=server.url, run="rd_local"), service="test")
        assert bus.redis.xlen(bus.key(streams.DEAD)) == 0
        assert bus.redis.xlen(bus.key("groups")) == 2  # the original entry and the re-driven one
        bus.close()
    finally:
        server.stop()
