"""Redis running out of memory, against both servers (``common.bus.memory``): at ``maxmemory``
with ``noeviction`` every bus write waits with back-off and one log line per episode, nothing
exits and nothing is lost; a ``maxmemory-policy`` that can evict Tether's keys is refused at
start (exit 2, one paragraph with the fix) unless ``bus.allow_evicting_policy`` says otherwise."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
import redis
from prometheus_client import REGISTRY

from common.bus.client import Bus
from common.bus.consumer import Consumer
from common.bus.server import EmbeddedRedis
from common.bus.settings import BusSettings
from common.config.errors import ConfigError
from common.protocol import wire
from common.service.supervision import SUPERVISOR_ENV
from tests.services.test_preflight import refused, tether

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path, server_binary):
    s = EmbeddedRedis(tmp_path / "redis", binary=server_binary).start()
    yield s
    s.stop()


def _bus(url: str, run: str, **kw) -> Bus:
    s = BusSettings(url=url, run=run, block_ms=100, socket_timeout_s=5, **kw)
    return Bus(s, service="test")


def _prompt(i: int) -> wire.PromptMsg:
    return wire.PromptMsg(prompt_id=f"p{i}", cycle=0, index=i, text="q" * 200)


def test_writes_wait_out_maxmemory_and_nothing_is_lost(server, caplog):
    run = "r" + uuid.uuid4().hex[:8]
    producer, worker = _bus(server.url, run), _bus(server.url, run)
    consumer = Consumer(worker, "in", "w", "c")
    admin = redis.Redis.from_url(server.url)
    n, errors, done = 60, [], threading.Event()

    def produce() -> None:
        for i in range(n):
            producer.publish("in", _prompt(i))
        producer.set("produced", n)

    def work() -> None:
        seen = 0
        while seen < n + 1:
            batch = consumer.read(8)
            consumer.commit(batch, publish=[("out", d.msg) for d in batch],
                            dedupe_ids=[d.msg.prompt_id for d in batch])  # fmt: skip
            seen += len(batch)
        worker.ensure_group("fresh", "g")  # XGROUP CREATE is refused too while full
        done.set()

    def guarded(fn):
        try:
            fn()
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    producer.publish("in", _prompt(n))  # something to read before the limit
    caplog.set_level(logging.WARNING, logger="common.bus.memory")
    # below what the server uses: every write is refused until the limit is lifted (a limit a
    # little above it let the 60 small prompts fit, or room come back, on a CI run: the producer
    # had finished within the 4 s, flaky); reads (XREADGROUP) are still served
    admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) // 2)
    waited_before = REGISTRY.get_sample_value("tether_bus_oom_wait_seconds_total") or 0.0
    threads = [threading.Thread(target=guarded, args=(f,)) for f in (produce, work)]
    for t in threads:
        t.start()
    time.sleep(4.0)  # the limit holds: both threads wait, neither raises
    assert not errors and all(t.is_alive() for t in threads)
    assert REGISTRY.get_sample_value("tether_bus_oom_waiting") == 1
    assert producer.memory().max_bytes > 0
    admin.config_set("maxmemory", 0)  # room again
    for t in threads:
        t.join(60)
    assert not errors and done.is_set()
    assert REGISTRY.get_sample_value("tether_bus_oom_waiting") == 0
    assert REGISTRY.get_sample_value("tether_bus_oom_wait_seconds_total") > waited_before + 2
    out = sorted(wire.decode(f[b"m"]).prompt_id for _, f in worker.redis.xrange(worker.key("out")))
    assert out == sorted(f"p{i}" for i in range(n + 1))  # each committed exactly once
    # one line when the episode starts and one when it ends, per client (here two services)
    starts = [r for r in caplog.records if "Redis is out of memory" in r.getMessage()]
    ends = [r for r in caplog.records if "accepts writes again" in r.getMessage()]
    assert len(starts) == 2 and len(ends) == 2, [r.getMessage() for r in caplog.records]
    assert "maxmemory" in starts[0].getMessage() and "policy noeviction" in starts[0].getMessage()


def test_an_evicting_policy_is_refused_at_start_with_the_fix(server, tmp_path):
    admin = redis.Redis.from_url(server.url)
    admin.config_set("maxmemory-policy", "allkeys-lru")
    try:
        # a service started by hand: its preflight reads the policy
        r = tether(tmp_path, "scorer", "--redis-url", server.url)
        line = refused(r, tmp_path, "tether scorer", "maxmemory-policy allkeys-lru",
                       "CONFIG SET maxmemory-policy noeviction", "bus.allow_evicting_policy")  # fmt: skip
        assert "maxmemory-policy allkeys-lru" in line
        # a service `tether train` restarts skips the PING preflight, not the policy
        r = tether(tmp_path, "scorer", "--redis-url", server.url,
                   extra_env={SUPERVISOR_ENV: "1"})  # fmt: skip
        refused(r, tmp_path, "tether scorer", "CONFIG SET maxmemory-policy noeviction")
        bus = _bus(server.url, "x")
        with pytest.raises(ConfigError, match="allkeys-lru"):
            bus.check_server()
        knowing = _bus(server.url, "x", allow_evicting_policy=True)
        assert knowing.check_server().policy == "allkeys-lru"  # a warning, no refusal
        admin.config_set("maxmemory-policy", "volatile-lru")  # Tether's keys never expire
        assert bus.check_server().policy == "volatile-lru"
    finally:
        admin.config_set("maxmemory-policy", "noeviction")
