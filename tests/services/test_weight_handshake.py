"""Only the run's processes join the learner's weight group: the shared secret of
``common.weights.handshake`` against a real TCPStore, real gloo groups and real receiver
processes — one with the secret (joins and gets the weights), one without and one with a wrong
secret (refused at once with the reason, never members), and a join entry replayed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from common.weights import handshake  # noqa: E402
from common.weights.checksum import tensors_checksum  # noqa: E402
from common.weights.publisher import WeightPublisher  # noqa: E402
from tests.weights_support import JOIN_S, events, start_receiver, stop_all, wait_for, weights  # noqa: E402

SECRET = "s3cret-of-this-run"


def _refused(log) -> str:
    errors = [e["error"] for e in events(log) if e["event"] == "error"]
    return errors[0] if errors else ""


def test_the_proof_binds_the_secret_to_this_learner_and_this_join():
    secret, other = SECRET.encode(), b"another"
    join = handshake.signed(secret, instance="i1", member="g0", epoch=3, has=-1)
    assert handshake.Join.parse(join.entry()[:-1]) == join
    assert handshake.refusal(secret, join, instance="i1") == ""
    assert "does not match" in handshake.refusal(other, join, instance="i1")
    assert "does not match" in handshake.refusal(secret, join, instance="i2")  # another learner
    moved = handshake.Join(join.member, join.epoch + 1, join.has, join.proof)
    assert "does not match" in handshake.refusal(secret, moved, instance="i1")
    bare = handshake.signed(None, instance="i1", member="g0", epoch=3, has=-1)
    assert "without the weights secret" in handshake.refusal(secret, bare, instance="i1")
    assert handshake.refusal(None, bare, instance="i1") == ""  # no secret: anyone joins


@pytest.mark.slow
def test_only_holders_of_the_secret_join_and_receive(tmp_path):
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=10.0, bucket_bytes=1 << 20,
                          secret=SECRET.encode())  # fmt: skip
    procs = []
    try:
        ok, log_ok = start_receiver(tmp_path, pub.port, "ours", secret=SECRET)
        bare, log_bare = start_receiver(tmp_path, pub.port, "bare")
        wrong, log_wrong = start_receiver(tmp_path, pub.port, "wrong", secret="guess")
        procs += [ok, bare, wrong]
        wait_for(lambda: set(pub.members()) == {"ours"}, JOIN_S, "the holder of the secret")
        # the others are told at once (not after the 20 s join timeout) and exit with the reason
        why_bare = wait_for(lambda: bare.poll() is not None and _refused(log_bare), 15, "bare")
        assert "without the weights secret" in why_bare and handshake.SECRET_ENV in why_bare
        why_wrong = wait_for(lambda: wrong.poll() is not None and _refused(log_wrong), 15, "wrong")
        assert "does not match" in why_wrong
        w = weights(3)
        report = pub.publish(w, 1)
        assert report.per_member == {"ours": "ok"}
        got = wait_for(lambda: [e for e in events(log_ok) if e["event"] == "update"])
        assert got[0]["checksum"] == tensors_checksum(w) == report.checksum
        assert set(pub.members()) == {"ours"}
        # the accepted join appended again (a replay by whoever can read the store): refused
        store = torch.distributed.TCPStore("127.0.0.1", pub.port, is_master=False)
        entries = store.get("wsync/joins").decode().split(";")[:-1]
        (accepted,) = [e for e in entries if e.startswith("ours:")]
        store.append("wsync/joins", accepted + ";")
        member, epoch = accepted.split(":")[:2]
        prefix = torch.distributed.PrefixStore(f"wsync/{member}/{epoch}/", store)
        assert "joined already" in wait_for(
            lambda: (
                prefix.check([handshake.REFUSED_KEY]) and prefix.get(handshake.REFUSED_KEY).decode()
            ),
            10,
            "the replay refused",
        )
    finally:
        stop_all(procs, pub)
