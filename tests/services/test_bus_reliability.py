"""Bus under failure, with real processes: SIGKILLed consumer, SIGKILLed and emptied server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid

import pytest
from prometheus_client import REGISTRY

from common.bus.client import Bus
from common.bus.consumer import Consumer
from common.bus.server import EmbeddedRedis
from common.bus.settings import BusSettings
from common.protocol import wire
from common.protocol.wire import PromptMsg
from tests.paths import REPO
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def settings(url: str, **overrides) -> BusSettings:
    kw = dict(url=url, run="r" + uuid.uuid4().hex[:8], block_ms=100, socket_timeout_s=5)
    return BusSettings(**(kw | {"reconnect_max_s": 20} | overrides))


def prompt(i: int) -> PromptMsg:
    return PromptMsg(prompt_id=f"p{i}", cycle=0, index=i, text="q")


def counter(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def out_ids(bus: Bus) -> list[str]:
    entries = bus.redis.xrange(bus.key("out"))
    return [wire.decode(f[b"m"]).prompt_id for _, f in entries]


def test_sigkilled_consumer_work_is_claimed_and_processed_exactly_once(redis_server) -> None:
    s = settings(redis_server.url, claim_idle_ms=500)
    bus = Bus(s, service="test")
    bus.ensure_group("in", "workers")
    n = 40
    for i in range(n):
        bus.publish("in", prompt(i))
    bus.publish("in", prompt(3))  # an at-least-once producer retry: a duplicate id
    cmd = [sys.executable, "-m", "tests.procs.bus_consumer", "--url", s.url, "--run", s.run,
           "--claim-idle-ms", "500", "--batch", "8"]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(REPO)}
    victim = subprocess.Popen([*cmd, "--name", "victim", "--work-s", "30"], cwd=REPO, env=env)
    deadline = time.monotonic() + 20
    while bus.get("started:victim") is None:
        assert victim.poll() is None and time.monotonic() < deadline, "victim never took a batch"
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)  # mid-batch: 8 entries delivered, none acked
    victim.wait()
    assert bus.backlog("in", "workers")[1] == 8
    rescuer = subprocess.run([*cmd, "--name", "rescuer", "--exit-after-idle-s", "2"],
                             cwd=REPO, env=env, timeout=60)  # fmt: skip
    assert rescuer.returncode == 0
    ids = out_ids(bus)
    assert sorted(ids) == sorted(f"p{i}" for i in range(n))  # each exactly once
    assert bus.backlog("in", "workers") == (0, 0)


def _stacks(threads: list[threading.Thread]) -> str:
    frames = sys._current_frames()
    return "\n".join(f"{t.name}:\n{''.join(traceback.format_stack(frames[t.ident]))}"
                     for t in threads if t.ident in frames)  # fmt: skip


def test_redis_sigkill_and_restart_with_aof(tmp_path, server_binary) -> None:
    server = EmbeddedRedis(tmp_path, binary=server_binary).start()
    s = settings(server.url)
    producer_bus, consumer_bus = Bus(s, service="producer"), Bus(s, service="consumer")
    consumer = Consumer(consumer_bus, "in", "w", "c")
    committed: dict[str, float] = {}
    published: list[tuple[str, float]] = []
    stop, errors = threading.Event(), []

    def produce() -> None:
        i = 0
        while not stop.is_set():
            producer_bus.publish("in", prompt(i))
            published.append((f"p{i}", time.monotonic()))
            i += 1
            time.sleep(0.01)

    def consume() -> None:
        while not (stop.is_set() and sum(consumer_bus.backlog("in", "w")) == 0):
            batch = consumer.read(16)
            ids = [d.msg.prompt_id for d in batch]
            consumer.commit(batch, publish=[("out", d.msg) for d in batch], dedupe_ids=ids)
            committed.update((i, time.monotonic()) for i in ids)

    def guarded(fn):
        try:
            fn()
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    reconnects = counter("tether_bus_reconnects_total")
    threads = [threading.Thread(target=guarded, args=(f,)) for f in (produce, consume)]
    for t in threads:
        t.start()
    # commits older than the AOF's 1 s fsync interval, which the kill must not lose
    wait_until(lambda: committed and min(list(committed.values())) < time.monotonic() - 1.3,
               timeout_s=30, what="commits older than 1.3 s")  # fmt: skip
    server.kill()
    killed_at = time.monotonic()
    # the clients meet the outage (each failed attempt counts a reconnect), then it ends
    wait_until(lambda: counter("tether_bus_reconnects_total") >= reconnects + 2, timeout_s=30,
               what="the clients to fail against the killed server")  # fmt: skip
    server.start()  # same port, same dir: AOF replay
    restarted_at = time.monotonic()

    def consumed_after_restart() -> bool:
        return any(t > restarted_at + 0.2 and i in committed for i, t in list(published))

    wait_until(consumed_after_restart, timeout_s=30, what="a message published after the restart "
               "to be consumed")  # fmt: skip
    stop.set()
    for t in threads:
        t.join(30)
    stuck = _stacks([t for t in threads if t.is_alive()])  # what a thread still alive is doing
    state = (f"in hand {sorted(consumer._in_hand)[:5]}, suspects {len(consumer._suspects)}, "
             f"backlog {consumer_bus.backlog('in', 'w') if stuck else None}")  # fmt: skip
    server.stop()
    assert not errors and not stuck, f"{errors} {state}\n{stuck}"
    assert server.port == int(s.url.rsplit(":", 1)[1].split("/")[0])
    assert counter("tether_bus_reconnects_total") > reconnects
    # Everything committed more than ~1 s before the kill survived; everything published after
    # the restart was consumed: nothing stalled.
    server.start()
    survivors = set(out_ids(Bus(s, service="check")))
    server.stop()
    old = {i for i, t in committed.items() if t < killed_at - 1.2}
    assert old and old <= survivors
    late = {i for i, t in published if t > restarted_at + 0.2}
    assert late and late <= survivors


def test_redis_restarted_empty_group_is_recreated(tmp_path, server_binary) -> None:
    server = EmbeddedRedis(tmp_path, appendonly=False, binary=server_binary).start()
    try:
        bus = Bus(settings(server.url), service="test")
        consumer = Consumer(bus, "in", "w", "c")
        bus.publish("in", prompt(0))
        consumer.ack(consumer.read(5))
        server.kill()
        server.start()  # no persistence: streams and groups are gone
        before = REGISTRY.get_sample_value(
            "tether_bus_recreated_total", {"stream": "in", "group": "w"}
        )
        bus.publish("in", prompt(1))
        got = []
        for _ in range(5):
            got += consumer.read(5)
            if got:
                break
        assert [d.msg.prompt_id for d in got] == ["p1"]
        after = REGISTRY.get_sample_value(
            "tether_bus_recreated_total", {"stream": "in", "group": "w"}
        )
        assert after == (before or 0) + 1
    finally:
        server.stop()
