"""Weights down a chain of three generators: real TCPStore, real gloo groups, real receiver
processes, one of them SIGKILLed or SIGSTOPped in the middle of a publish.

What must hold (issue 16): the learner sends each byte once (``/proc/self/io`` of this process,
the learner, counts what it writes); a member lost mid-publish costs the others no more than a
quarter of the deadline, they get the version in that same publish, the publish returns before its
deadline, and the lost member comes back through the pairwise join path with the current weights
before anything else (a generator generates only after that first update)."""

from __future__ import annotations

import signal

import pytest

torch = pytest.importorskip("torch")

from common.weights.checksum import tensors_checksum  # noqa: E402
from common.weights.publisher import WeightPublisher  # noqa: E402
from tests import weights_support as ws  # noqa: E402


def _written_bytes() -> int:
    """Bytes this process passed to write-type system calls (sockets included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def _updates(log) -> list[dict]:
    return [e for e in ws.events(log) if e["event"] == "update"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_chain_of_three_loses_the_middle_member_mid_publish(tmp_path, sig):
    timeout_s = 8.0
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=timeout_s, bucket_bytes=4 << 20,
                          chunk_bytes=1 << 20)  # fmt: skip
    procs = []
    try:
        # b (the middle of the chain a -> b -> c) stops after unit 1 of its second receive
        a, log_a = ws.start_receiver(tmp_path, pub.port, "a", "--count", "3")
        b, log_b = ws.start_receiver(
            tmp_path, pub.port, "b", "--count", "3", "--stall-after-unit", "1",
            "--stall-on-update", "2", "--stall-seconds", "1.0",
        )  # fmt: skip
        c, log_c = ws.start_receiver(tmp_path, pub.port, "c", "--count", "3")
        procs += [a, b, c]
        ws.wait_for(lambda: set(pub.members()) == {"a", "b", "c"}, 120, "three members")

        w1 = ws.weights(1)
        written = _written_bytes()
        r1 = pub.publish(w1, 1)
        out = _written_bytes() - written
        assert r1.per_member == {"a": "ok", "b": "ok", "c": "ok"}
        # one copy out of the learner: 3 members cost the bytes of one (pairwise: 3 x)
        assert r1.root_bytes == r1.bytes and r1.bytes <= out < 1.1 * r1.bytes, (out, r1.bytes)
        for log in (log_a, log_b, log_c):
            assert ws.wait_for(lambda log=log: _updates(log))[0]["checksum"] == r1.checksum

        w2 = ws.weights(2)
        box = ws.publish_in_thread(pub, w2, 2)
        ws.wait_for(
            lambda: any(e["event"] == "stalled" for e in ws.events(log_b)), what="b mid-publish"
        )
        b.send_signal(sig)
        box["thread"].join(timeout_s + 5)
        r2, elapsed = box["report"], box["elapsed"]
        print(f"{sig.name}: publish {elapsed:.2f} s, per member {r2.per_member}")
        assert elapsed < timeout_s / 2  # found within a quarter of the deadline, not at it
        assert r2.per_member["a"] == r2.per_member["c"] == "ok"
        assert r2.per_member["b"] != "ok" and "b" not in pub.members()
        for log in (log_a, log_c):
            got = ws.wait_for(lambda log=log: [e for e in _updates(log) if e["version"] == 2])
            assert got[0]["checksum"] == r2.checksum == tensors_checksum(w2)

        if sig == signal.SIGKILL:  # a new process with b's id comes back
            b, log_b = ws.start_receiver(tmp_path, pub.port, "b", "--count", "2")
            procs.append(b)
        else:  # the same process wakes up: its round was called off, the learner dropped it
            b.send_signal(signal.SIGCONT)
        ws.wait_for(lambda: pub.members().get("b") == 2, 120, "b rejoined with join epoch 2")
        # b holds the current version, checksum and all, before anything else: a new process gets
        # it over its pairwise group as soon as it joined; the woken one finished receiving it
        # down the chain (what was in flight) or gets it pairwise after its rejoin
        got = ws.wait_for(lambda: [e for e in _updates(log_b) if e["version"] == 2], 60, "b on v2")
        assert got[-1]["checksum"] == r2.checksum
        assert {"event": "joined", "epoch": 2} in ws.events(log_b)
        if sig == signal.SIGKILL:
            assert _updates(log_b)[0]["version"] == 2

        epoch = r2.epoch
        r3 = pub.publish(ws.weights(3), 3)
        assert r3.per_member == {"a": "ok", "b": "ok", "c": "ok"}
        assert r3.epoch > epoch and r3.root_bytes == r3.bytes  # a new chain, one copy again
        for log in (log_a, log_b, log_c):
            got = ws.wait_for(lambda log=log: [e for e in _updates(log) if e["version"] == 3])
            assert got[0]["checksum"] == r3.checksum
        for p in (a, b, c):
            assert p.wait(30) == 0
    finally:
        ws.stop_all(procs, pub)


def test_a_new_member_is_caught_up_pairwise_then_joins_the_chain(tmp_path):
    """A member that joins between publishes gets the latest version over its own pairwise
    group first (the acceptor), and the next publish goes down a new chain that includes it."""
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=10.0, bucket_bytes=1 << 20)
    procs = []
    try:
        a, log_a = ws.start_receiver(tmp_path, pub.port, "a", "--count", "2")
        procs.append(a)
        ws.wait_for(lambda: "a" in pub.members(), 120, "a")
        r1 = pub.publish(ws.weights(1, n=2), 1)
        assert r1.per_member == {"a": "ok"} and r1.epoch == 1
        late, log_late = ws.start_receiver(tmp_path, pub.port, "late", "--count", "2")
        procs.append(late)
        got = ws.wait_for(lambda: _updates(log_late), 120, "the catch-up")
        assert got[0]["version"] == 1 and got[0]["checksum"] == r1.checksum
        r2 = pub.publish(ws.weights(2, n=2), 2)
        assert r2.per_member == {"a": "ok", "late": "ok"}
        assert r2.epoch == 2 and r2.root_bytes == r2.bytes
        assert ws.wait_for(lambda: len(_updates(log_late)) == 2)
        assert _updates(log_late)[1]["checksum"] == r2.checksum
        assert a.wait(20) == 0 and late.wait(20) == 0
    finally:
        ws.stop_all(procs, pub)
