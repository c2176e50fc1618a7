"""A member that takes updates ten times slower than the others (issue 46 item 5): real
TCPStore, real gloo groups, real receiver processes; the slow one sleeps over every unit
(``--unit-seconds``), so its sender waits on it as it would on a slow link.

What must hold: a chain round finds the slow member (it has each version far later than the
member above it) and it is left out of the rounds after (a publish lasts until it has the
version, and every member below it in a chain gets the version at its rate), so the publishes
that follow go down a chain of the others, one copy out of the learner, without waiting for it;
it is sent the latest version in the background from the copy the learner holds, held whole
(``publish``) or kept from a streamed publish (``begin``, the learner's way), and ends on the
latest version with the right checksum. With the rule off it stays in the chain."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from common.weights.publisher import WeightPublisher  # noqa: E402
from common.weights.roster import MEASURE_MIN_BYTES  # noqa: E402
from tests import weights_support as ws  # noqa: E402

UNIT_SECONDS = 0.8  # 18 units: ~14 s an update for the slow member, 1-3 s for the others


def _updates(log, version=None) -> list[dict]:
    return [
        e for e in ws.events(log)
        if e["event"] == "update" and (version is None or e["version"] == version)
    ]  # fmt: skip


def _publish(pub, named, version, mode):
    return pub.publish(named, version) if mode == "held" else ws.stream(pub, named, version)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "slow"), [("held", "s"), ("streamed", "s"), ("held", "0s")],
    ids=["held-last", "streamed-last", "held-first"],
)  # fmt: skip
def test_a_slow_member_leaves_the_chain_and_is_sent_each_version_in_the_background(
    tmp_path, mode, slow
):
    """``slow`` sorts last among the members (the chain finds it in its first round: it has the
    version much later than the member above it) or first (nothing is above it: the next round
    moves it down the chain, where it is found)."""
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=60.0, bucket_bytes=4 << 20,
                          slow_link_fraction=0.25)  # fmt: skip
    procs = []
    try:
        a, log_a = ws.start_receiver(tmp_path, pub.port, "a", "--count", "4")
        b, log_b = ws.start_receiver(tmp_path, pub.port, "b", "--count", "4")
        s, log_s = ws.start_receiver(tmp_path, pub.port, slow, "--count", "100",
                                     "--unit-seconds", str(UNIT_SECONDS))  # fmt: skip
        procs += [a, b, s]
        ws.wait_for(lambda: set(pub.members()) == {"a", "b", slow}, ws.JOIN_S, "three members")

        w = {v: ws.weights(v, n=17) for v in (1, 2, 3, 4)}  # 68 MiB: large enough to measure
        reports = []
        for v in (1, 2):  # every member gets these down one chain, until the slow one is found
            r = _publish(pub, w[v], v, mode)
            assert r.bytes >= MEASURE_MIN_BYTES
            assert r.per_member == {"a": "ok", "b": "ok", slow: "ok"}
            assert r.root_bytes == r.bytes  # a chain: one copy out of the learner
            reports.append(r)
            if r.slow:
                break
        assert r.slow == [slow] and len(reports) == (1 if slow == "s" else 2)

        for v in range(len(reports) + 1, len(reports) + 3):
            r = _publish(pub, w[v], v, mode)
            # down a chain of the fast two, not waiting for the slow one
            assert r.per_member == {"a": "ok", "b": "ok"} and r.slow == [slow]
            assert r.root_bytes == r.bytes
            assert not _updates(log_s, v), "the publish waited for the slow member"
            assert pub.behind() == []  # the learner is not asked to catch it up itself
            reports.append(r)
        last = len(reports)
        for log in (log_a, log_b):
            got = ws.wait_for(lambda log=log: len(_updates(log)) == last and _updates(log))
            assert [e["checksum"] for e in got] == [r.checksum for r in reports]
        # the slow member ends on the latest version, sent in the background
        got = ws.wait_for(lambda: _updates(log_s, last), 90, "the slow member on the last")
        assert got[0]["checksum"] == reports[-1].checksum
        assert slow in pub.members()  # served, never dropped
        if last < 4:
            a.kill(), b.kill()
        else:
            assert a.wait(30) == 0 and b.wait(30) == 0
    finally:
        ws.stop_all(procs, pub)


@pytest.mark.slow
def test_with_the_rule_off_the_slow_member_stays_in_the_chain(tmp_path):
    """The control: ``slow_link_fraction = 0`` measures nothing, every publish goes down one
    chain of all three, and each returns once the slow member has the version."""
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=60.0, bucket_bytes=4 << 20,
                          slow_link_fraction=0.0)  # fmt: skip
    procs = []
    try:
        a, _ = ws.start_receiver(tmp_path, pub.port, "a", "--count", "2")
        s, log_s = ws.start_receiver(tmp_path, pub.port, "s", "--count", "2",
                                     "--unit-seconds", str(UNIT_SECONDS))  # fmt: skip
        procs += [a, s]
        ws.wait_for(lambda: set(pub.members()) == {"a", "s"}, ws.JOIN_S, "two members")
        for v in (1, 2):
            r = pub.publish(ws.weights(v, n=17), v)
            assert r.per_member == {"a": "ok", "s": "ok"} and r.slow == []
            assert r.root_bytes == r.bytes  # a chain from the first publish on
            # "ok" from the slow member: the publish waited until it had the version
            got = ws.wait_for(lambda v=v: _updates(log_s, v))
            assert got[0]["checksum"] == r.checksum
        assert a.wait(30) == 0 and s.wait(30) == 0
    finally:
        ws.stop_all(procs, pub)
