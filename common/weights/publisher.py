"""Learner side (rank 0 only): hosts the store, accepts members, publishes versions down a chain
of the members (one copy out of the learner) or to each of them pairwise, within a deadline (see
the package docstring).

Two ways to publish, one set of rounds: ``publish(named, version)`` holds the whole update in
memory (and keeps it, so a member that joins later gets it at once from the acceptor); ``begin``
streams one (``StreamedPublish``: the learner gathers and hands over one unit at a time, so
rank 0 holds a window of units, never the model, ``common.weights.stream``). A streamed update
is not kept: a member that joins later is sent it by ``begin_catch_up``, which the learner calls
at its next chance (``behind()`` says when one is due)."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from common.config.shared import BUCKET_MB, CHUNK_MB, MIN_GB_PER_S
from common.telemetry.metrics import metric
from common.weights import handshake
from common.weights.buckets import pack_unit, unit_buffers
from common.weights.chain import ChainRound, Route, link, release_later
from common.weights.checksum import checksum_for
from common.weights.group import (
    BACKEND_KEY,
    GPU_KEY,
    INSTANCE_KEY,
    Stalled,
    default_device,
    gpu_uuid,
    make_pair_group,
    use_device,
)
from common.weights.layout import ALIGN, WeightSyncError, build_layout
from common.weights.rounds import Member, PublishReport, Update
from common.weights.stream import FeedReader, HeldFeed, Passes, UnitFeed
from common.weights.transfer import send_update

logger = logging.getLogger(__name__)


class StreamedPublish:
    """One streamed publish, driven by the caller (the learner's rank 0): make every pass the
    round asks for, a unit at a time, then ``close()``::

        while (feed := session.next_pass()) is not None:
            for k in range(session.n_units):
                session.put(feed, k, tensors_of_unit_k)  # layout order
        report = session.close()

    The round (its own thread) sends each unit as it comes; ``put`` waits while the window of
    units is full, and drops the units of a pass no member reads any more."""

    def __init__(self, pub: WeightPublisher, update: Update, *, members: list, t0: float,
                 pairwise: bool) -> None:  # fmt: skip
        self.pub, self.update, self.t0 = pub, update, t0
        self.deadline = t0 + update.allowance_s
        self.passes, self._thread, self._box = pub._start_round(
            update, members, self.deadline, pairwise=pairwise
        )

    @property
    def layout(self) -> dict:
        return self.update.layout

    @property
    def n_units(self) -> int:
        return self.update.n_units

    def next_pass(self) -> UnitFeed | None:
        return self.passes.next(deadline=self.deadline)

    def put(self, feed: UnitFeed, k: int, tensors: list) -> None:
        feed.put(pack_unit(tensors, self.layout, k, self.pub.device), deadline=self.deadline)

    def close(self) -> PublishReport:
        self._thread.join(max(0.0, self.deadline - time.monotonic()))
        with self.pub._lock:
            self.pub._publishing = False
        return self.pub._report(self.update, self.t0, self._box)


class WeightPublisher:
    """Learner side (rank 0 only): hosts the store, accepts members, publishes versions."""

    def __init__(self, host: str, port: int, *, backend: str = "gloo", timeout_s: float = 60.0,
                 bucket_bytes: int = int(BUCKET_MB * 2**20), accept_interval_s: float = 0.2,
                 device: str | None = None, auto_accept: bool = True, fanout: str = "chain",
                 chunk_bytes: int = int(CHUNK_MB * 2**20), secret: bytes | None = None,
                 min_gb_per_s: float = MIN_GB_PER_S) -> None:  # fmt: skip
        if timeout_s <= 0 or bucket_bytes < ALIGN or chunk_bytes < 0 or min_gb_per_s <= 0:
            raise ValueError(
                f"weight sync needs timeout_s > 0, bucket_bytes >= {ALIGN}, chunk_bytes >= 0 "
                f"and min_gb_per_s > 0; got timeout_s={timeout_s}, bucket_bytes={bucket_bytes}, "
                f"chunk_bytes={chunk_bytes}, min_gb_per_s={min_gb_per_s}"
            )
        self.min_gb_per_s = min_gb_per_s
        if fanout not in ("chain", "pairwise"):
            raise ValueError(f"weights.fanout must be 'chain' or 'pairwise', got {fanout!r}")
        import torch.distributed as dist

        self.backend, self.timeout_s, self.bucket_bytes = backend, timeout_s, bucket_bytes
        self.fanout, self.chunk_bytes, self._host = fanout, chunk_bytes, host
        # a member quiet for a quarter of the deadline is stuck: the rest still get the version
        self._round = ChainRound(stall_s=timeout_s / 4, grace_s=min(0.5, timeout_s / 8))
        self._chain_key: list = []  # the (member, join epoch)s of the current chain epoch
        self._chain_epoch, self._chain_dirty = 0, False
        self._links1: dict[int, Any] = {}  # chain epoch -> the learner's link to its first member
        self.device = device or default_device(backend)
        self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout_s))  # fmt: skip
        self._store.set(BACKEND_KEY, backend)
        self._instance = uuid.uuid4().hex  # also the challenge a join's proof is bound to
        self._store.set(INSTANCE_KEY, self._instance)
        self._secret = secret  # handshake.py: without one, any process that reaches the port joins
        if secret is None:
            logger.warning(
                "weight store on %s:%d accepts any join: set %s (the same in every generator) "
                "so that only this run's processes join", host, port, handshake.SECRET_ENV,
            )  # fmt: skip
        self._joins_taken: set[tuple[str, int]] = set()
        if backend == "nccl":
            self._store.set(GPU_KEY, gpu_uuid(self.device))
        self._members: dict[str, Member] = {}
        self._latest: Update | None = None
        self._publishing = False  # while true the acceptor leaves the members to publish()
        self._lock = threading.Lock()
        self._accept_lock = threading.Lock()
        self._joins_seen = 0
        self._stop = threading.Event()
        self._thread = None
        if auto_accept:
            self._thread = threading.Thread(target=self._accept_loop, args=(accept_interval_s,),
                                            name="wsync-accept", daemon=True)  # fmt: skip
            self._thread.start()

    @property
    def port(self) -> int:
        return self._store.port

    def members(self) -> dict[str, int]:
        """Live members: member id -> epoch."""
        with self._lock:
            return {m.member_id: m.epoch for m in self._members.values()}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s)
        with self._lock:
            self._members.clear()

    def publish(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> PublishReport:
        """Send ``version`` to every member concurrently; returns within its deadline
        (``allowance_s``). The update is held in memory, and kept to serve members that join
        later."""
        t0 = time.monotonic()
        named = sorted(((n, t.detach()) for n, t in named_tensors), key=lambda nt: nt[0])
        update = self._new_update(named, version)
        update.units = unit_buffers(named, update.layout, self.device)
        members = self._open(update)
        try:
            _, thread, box = self._start_round(
                update, members, t0 + update.allowance_s, pairwise=self.fanout == "pairwise"
            )
            thread.join(max(0.0, t0 + update.allowance_s - time.monotonic()))
        finally:
            with self._lock:
                self._publishing = False
        return self._report(update, t0, box)

    def begin(self, specs: Iterable[tuple[str, Any]], version: int) -> StreamedPublish:
        """Start a streamed publish of ``version``: ``specs`` name every tensor with its dtype
        and shape (meta tensors will do); the caller then makes the passes (``StreamedPublish``)."""
        t0 = time.monotonic()
        named = sorted(((n, t.detach()) for n, t in specs), key=lambda nt: nt[0])
        update = self._new_update(named, version)
        members = self._open(update)
        return StreamedPublish(self, update, members=members, t0=t0,
                               pairwise=self.fanout == "pairwise")  # fmt: skip

    def behind(self) -> list[str]:
        """Members (joined since) that lack the latest version: a streamed update is not kept,
        so they wait for ``begin_catch_up`` (a publish held in memory serves them itself)."""
        with self._lock:
            update = self._latest
            if update is None or update.units is not None:  # held: the acceptor serves them
                return []
            return [m.member_id for m in self._members.values()
                    if m.version_sent < update.version]  # fmt: skip

    def begin_catch_up(self) -> StreamedPublish | None:
        """A streamed publish of the latest version again, pairwise, to the members that lack
        it (``None`` when none does); the caller makes its pass as for ``begin``."""
        with self._accept_lock:
            self._accept_pending()
        t0 = time.monotonic()
        with self._lock:
            update = self._latest
            if update is None or self._publishing:
                return None
            behind = [m for m in self._members.values() if m.version_sent < update.version]
            if not behind:
                return None
            self._publishing = True
        return StreamedPublish(self, update, members=behind, t0=t0, pairwise=True)

    def publish_to_new_members(self) -> dict[str, str]:
        """Accept pending joins and send the latest version to members that lack it; not while a
        publish runs (it serves the members it could lock; a member that joined meanwhile is
        caught up here right after it, within the publish's deadline). A streamed update is not
        held: its late joiners wait for ``begin_catch_up``."""
        with self._accept_lock:
            self._accept_pending()
        with self._lock:
            update = self._latest
            behind = [
                m
                for m in self._members.values()
                if update and m.version_sent < update.version and not self._publishing
            ]
        if not behind or update is None or update.units is None:
            return {}
        deadline = time.monotonic() + update.allowance_s
        _, thread, box = self._start_round(update, behind, deadline, pairwise=True)
        thread.join(max(0.0, deadline - time.monotonic()))
        return {m: box["per_member"].get(m, "timeout") for m in list(box["members"])}

    # -- internals

    def _new_update(self, named: list, version: int) -> Update:
        names = [n for n, _ in named]
        if len(set(names)) != len(names) or not named:
            raise ValueError("publish needs a non-empty set of tensors with unique names")
        with self._lock:
            if self._latest is not None and version <= self._latest.version:
                raise ValueError(
                    f"weight versions must increase: got {version} after {self._latest.version}"
                )
        layout = build_layout(named, version, self.bucket_bytes, self.chunk_bytes)
        nbytes = sum(t[4] for t in layout["tensors"])
        allowance = self.allowance_s(nbytes)
        # the receiver hashes as the header says, and holds itself to the same allowance
        layout.update(checksum=checksum_for(self.device), deadline_s=allowance)
        return Update(version, json.dumps(layout).encode(), layout, nbytes, allowance)

    def allowance_s(self, nbytes: int) -> float:
        """The deadline of one round of an update of ``nbytes``: ``timeout_s`` plus the bytes at
        ``min_gb_per_s``, so that a large model is not dropped for being large. A member that
        makes no progress is still dropped after a quarter of ``timeout_s`` (in a chain)."""
        return self.timeout_s + nbytes / (self.min_gb_per_s * 1e9)

    def _open(self, update: Update) -> list[Member]:
        """Make ``update`` the latest, take in pending joins; the members to send it to."""
        with self._lock:
            self._latest, self._publishing = update, True
        if self._accept_lock.acquire(blocking=False):  # else the acceptor will catch them up
            try:
                self._accept_pending()
            finally:
                self._accept_lock.release()
        with self._lock:
            return list(self._members.values())

    def _start_round(self, update: Update, members: list[Member], deadline: float, *,
                     pairwise: bool) -> tuple[Passes, threading.Thread, dict]:  # fmt: skip
        """The round (chain or pairwise) on a thread of its own; it asks for passes through the
        returned ``Passes`` and writes ``per_member`` (outcomes as they are known), ``members``
        (those the round serves) and ``root_bytes`` into the box."""
        passes: Passes = Passes()
        # filled as members finish, so that a report taken at the deadline holds every outcome
        # known by then even while the round is still dropping the late ones
        box: dict[str, Any] = {"per_member": {}, "members": [], "root_bytes": 0}

        def run() -> None:
            try:
                if pairwise:
                    box["members"] = [m.member_id for m in members]
                    box["root_bytes"] = update.nbytes * len(members)
                    self._send_all(update, members, deadline, passes, box["per_member"])
                else:
                    self._send_chain(update, members, deadline, passes, box)
            finally:
                passes.done()

        thread = threading.Thread(target=run, name="wsync-round", daemon=True)
        thread.start()
        return passes, thread, box

    def _readers(self, update: Update, passes: Passes, n: int) -> list[FeedReader | HeldFeed]:
        """A new pass for ``n`` senders: their readers. When streamed, the pass is asked of the
        producer only once every reader is registered: a reader registered after the producer
        started would find the units the others had sent let go already (a chain's first
        sender, registered after the hasher had read unit 0, failed on it at once). The first
        pass (or, if it broke off, the next) is hashed too: the checksum goes out after the
        units, so hashing overlaps sending. A member that takes nothing for a quarter of the
        deadline is left behind, so that it does not hold back the others."""
        feed: UnitFeed | HeldFeed
        if update.units is not None:
            feed = HeldFeed(update.units)
        else:
            feed = UnitFeed(update.n_units, stall_s=self.timeout_s / 4)
        readers = [feed.reader() for _ in range(n)]
        if not update.hashed and not update.hashing:
            update.hashing = True
            threading.Thread(target=self._hash, args=(update, feed.reader()), name="wsync-hash",
                             daemon=True).start()  # fmt: skip
        if isinstance(feed, UnitFeed):
            passes.ask(feed)
        return readers

    def _hash(self, update: Update, reader: FeedReader | HeldFeed) -> None:
        try:
            with reader:
                update.hash_units(reader.units(time.monotonic() + update.allowance_s))
        except WeightSyncError:  # the pass was given up: the next pass hashes
            update.hashing = False

    def _report(self, update: Update, t0: float, box: dict) -> PublishReport:
        # a member the round has not finished with at the deadline is a timeout (the round
        # drops it as such right after)
        per_member = {m: box["per_member"].get(m, "timeout") for m in list(box["members"])}
        root_bytes = box["root_bytes"]
        if update.hashing and update.n_units:
            try:
                update.wait_digest(update.n_units - 1, t0 + update.allowance_s)
            except WeightSyncError:
                pass  # reported without a checksum: no member got the version
        elif update.units is not None and not update.hashed:  # no pass was made
            update.hash_units(update.units)
        seconds = time.monotonic() - t0
        metric("Histogram", "tether_weights_publish_seconds", "Publish time").observe(seconds)
        metric("Counter", "tether_weights_publish_bytes_total",
               "Bytes the learner sent").inc(root_bytes)  # fmt: skip
        return PublishReport(update.version, update.nbytes, seconds, update.digest.hex(),
                             dict(per_member), root_bytes, self._chain_epoch)  # fmt: skip

    def _accept_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.publish_to_new_members()
            except Exception:  # keep accepting: one bad join must not stop the acceptor
                logger.exception("weight sync: accepting members failed")

    def _accept_pending(self) -> None:
        import torch.distributed as dist

        if not self._store.check(["wsync/joins"]):
            return
        entries = self._store.get("wsync/joins").decode().split(";")[:-1]
        for entry in entries[self._joins_seen :]:
            self._joins_seen += 1
            # <member>:<join epoch>:<version it holds from this publisher, -1 for none>:<proof>
            try:
                join = handshake.Join.parse(entry)
            except ValueError:
                logger.warning("weight sync: ignoring a malformed join %r", entry[:100])
                continue
            member_id, epoch, has = join.member, join.epoch, join.has
            prefix = f"wsync/{member_id}/{epoch}/"
            pstore = dist.PrefixStore(prefix, self._store)
            why = handshake.refusal(self._secret, join, instance=self._instance)
            if not why and (member_id, epoch) in self._joins_taken:
                why = f"{member_id} epoch {epoch} has joined already (a replayed join)"
            if why:
                logger.warning("weight sync: refused a join: %s", why)
                pstore.set(handshake.REFUSED_KEY, why)
                metric("Counter", "tether_weights_member_failures_total", "Member failures",
                       ("reason",)).labels("refused").inc()  # fmt: skip
                continue
            self._joins_taken.add((member_id, epoch))
            with self._lock:  # what the member must wait for (set before it can finish joining)
                pstore.set("current", str(self._latest.version if self._latest else -1))
            try:
                # the rendezvous over a client of its own: it holds its client's lock while it
                # waits, and a publish's watch uses the main one meanwhile
                client = dist.TCPStore(self._host, self.port, is_master=False,
                                       timeout=timedelta(seconds=self.timeout_s))  # fmt: skip
                pg = make_pair_group(dist.PrefixStore(prefix, client), 0, backend=self.backend,
                                     timeout_s=self.timeout_s)  # fmt: skip
            except Exception as e:
                logger.warning("weight sync: join of %s epoch %s failed: %s", member_id, epoch, e)
                metric("Counter", "tether_weights_member_failures_total", "Member failures",
                        ("reason",)).labels("join").inc()  # fmt: skip
                continue
            with self._lock:
                self._members[member_id] = Member(member_id, epoch, pg, pstore, has)
                n = len(self._members)
            metric("Gauge", "tether_weights_members", "Live weight-sync members").set(n)
            logger.info("weight sync: %s joined (epoch %s)", member_id, epoch)

    def _send_all(self, update: Update, members: list[Member], deadline: float,
                  passes: Passes, results: dict[str, str]) -> None:  # fmt: skip
        """One pass, read by every member's sender thread; each outcome goes into ``results``
        as it is known."""
        done = threading.Lock()
        readers = dict(zip([m.member_id for m in members],
                           self._readers(update, passes, len(members)), strict=True))  # fmt: skip

        def one(m: Member) -> None:
            outcome = self._send_one(m, update, deadline, readers[m.member_id])
            with done:
                results.setdefault(m.member_id, outcome)

        threads = [threading.Thread(target=one, args=(m,), daemon=True) for m in members]
        for th in threads:
            th.start()
        for th in threads:
            th.join(max(0.0, deadline - time.monotonic()))
        with done:  # results that arrive later are ignored: they were reported as timeouts
            for m in members:
                if results.setdefault(m.member_id, "timeout") == "timeout":
                    readers[m.member_id].leave()
                    self._drop(m, "timeout")

    def _send_one(self, m: Member, update: Update, deadline: float,
                  reader: FeedReader | HeldFeed) -> str:  # fmt: skip
        with reader:
            if not m.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                # held by a chain publish until its deadline: its outcome is that publish's
                return "ok" if m.version_sent >= update.version else "timeout"
            try:
                if m.version_sent >= update.version:
                    return "ok"
                m.announce(update.version, Route(update.version))
                use_device(self.device)  # this sender thread's GPU
                send_update(m.pg, update.header, update.version, reader.units(deadline),
                            lambda k: update.wait_digest(k, deadline), deadline,
                            device=self.device)  # fmt: skip
                m.version_sent = update.version
                return "ok"
            except Exception as e:
                if time.monotonic() >= deadline or isinstance(e, Stalled):
                    return "timeout"  # (dropped as such by _send_all)
                self._drop(m, "error")
                return f"error: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"
            finally:
                m.lock.release()

    def _send_chain(self, update: Update, members: list[Member], deadline: float,
                    passes: Passes, box: dict) -> None:  # fmt: skip
        """Send ``update`` down a chain of the members this thread can lock now (the others are
        being caught up pairwise and get it from the acceptor); on a failure blame one member
        (``ChainRound``), drop it, and send the rest again at once down a new chain (a new pass
        of the producer's)."""
        chain = [m for m in sorted(members, key=lambda m: m.member_id) if m.lock.acquire(False)]
        results: dict[str, str] = box["per_member"]
        box["members"] = [m.member_id for m in chain]
        try:
            rest = [m for m in chain if m.version_sent < update.version]
            results.update({m.member_id: "ok" for m in chain if m not in rest})
            while rest and time.monotonic() < deadline:
                epoch, routes = self._route(update.version, rest)
                sender: dict[str, str] = {}
                (reader,) = self._readers(update, passes, 1)
                threading.Thread(target=self._send_first,
                                 args=(update, epoch, sender, deadline, reader),
                                 name="wsync-chain", daemon=True).start()  # fmt: skip
                box["root_bytes"] += update.nbytes
                acked, blamed, why = self._round.watch(rest, routes, sender, deadline)
                reader.leave()  # a sender still at it stops at the chain epoch's change
                for m in acked:
                    results[m.member_id], m.version_sent = "ok", update.version
                rest = [m for m in rest if m not in acked and m is not blamed]
                if blamed is None:
                    break
                results[blamed.member_id] = why
                self._chain_dirty = True
                self._drop(blamed, why.split(":")[0].split(" ")[0], why)
            for m in rest:
                results[m.member_id], self._chain_dirty = "timeout", True
                self._drop(m, "timeout")
        finally:
            for m in chain:
                m.lock.release()

    def _route(self, version: int, rest: list[Member]) -> tuple[int, list[str]]:
        """A new chain epoch when the members changed or the last round failed; every member is
        told its place (``route``) before ``pending`` tells it to look."""
        key = [(m.member_id, m.epoch) for m in rest]
        if key != self._chain_key or self._chain_dirty:
            self._chain_key, self._chain_epoch, self._chain_dirty = (
                key,
                self._chain_epoch + 1,
                False,
            )
            release_later(self._links1, after_s=self.timeout_s + 1)
            self._links1 = {}
            metric("Gauge", "tether_weights_chain_epoch", "Weight chain epoch").set(
                self._chain_epoch
            )
            logger.info("weight sync: chain epoch %d: %s", self._chain_epoch, [k[0] for k in key])
        routes = [
            str(Route(version, self._chain_epoch, p, len(rest))) for p in range(1, len(rest) + 1)
        ]
        for m, r in zip(rest, routes, strict=True):
            m.announce(version, Route.parse(r))
        return self._chain_epoch, routes

    def _send_first(self, update: Update, epoch: int, box: dict, deadline: float,
                    reader: FeedReader | HeldFeed) -> None:  # fmt: skip
        """The learner's only send of a chain round: to the first member, over link 1."""
        try:
            use_device(self.device)
            pg = self._links1.get(epoch)
            if pg is None:
                pg = link(self._host, self.port, epoch, 1, 0, backend=self.backend,
                          timeout_s=self.timeout_s)  # fmt: skip
                if epoch == self._chain_epoch:
                    self._links1[epoch] = pg
            send_update(pg, update.header, update.version, reader.units(deadline),
                        lambda k: update.wait_digest(k, deadline), deadline,
                        lambda: self._chain_epoch != epoch, device=self.device)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - ChainRound blames the first member
            box["error"] = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        finally:
            reader.leave()

    def _drop(self, m: Member, reason: str, detail: str = "") -> None:
        """``reason``: a metric label (one word); ``detail``: what the log says, if more."""
        with self._lock:
            if self._members.get(m.member_id) is not m:
                return
            del self._members[m.member_id]
            n = len(self._members)
        metric("Gauge", "tether_weights_members", "Live weight-sync members").set(n)
        metric("Counter", "tether_weights_member_failures_total", "Member failures",
                ("reason",)).labels(reason).inc()  # fmt: skip
        logger.warning("weight sync: dropped %s (epoch %d): %s", m.member_id, m.epoch,
                       detail or reason)  # fmt: skip
        try:
            m.store.set("dropped", reason)
        except Exception:  # the store is ours; a failure here only delays the rejoin
            logger.debug("could not mark %s dropped", m.member_id, exc_info=True)
