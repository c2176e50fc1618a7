"""Learner side (rank 0 only): hosts the store, accepts members, publishes versions down a chain
of the members (one copy out of the learner) or to each of them pairwise, within a deadline (see
the package docstring).

Two ways to publish, one set of rounds: ``publish(named, version)`` holds the whole update in
memory (and keeps it, so a member that joins later gets it at once from the acceptor); ``begin``
streams one (``StreamedPublish``: the learner gathers and hands over one unit at a time, so
rank 0 holds a window of units, never the model, ``common.weights.stream``). A streamed update
is not kept: a member that joins later is sent it by ``begin_catch_up``, which the learner calls
at its next chance (``behind()`` says when one is due).

Slow links (``slow_link_fraction``): a publish lasts until its slowest member has the version,
and every member below a slow one in a chain gets it at that member's rate. A chain round
measures every link but the first member's against the one above it (``Roster.chain_round``,
which also orders the chain so that the first member is one whose link was shown fine); a
member behind a slow link is left out of the rounds and sent the latest version in the
background (``_serve_slow``, on a thread of its own) from the update held in memory: a streamed
update is then held too (``StreamedPublish``: rank 0 keeps a copy of each unit). Its
background sends measure its link, and bring it back once the link keeps up."""

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
from common.weights.acceptor import Acceptor
from common.weights.buckets import pack_unit, unit_buffers
from common.weights.chain_sender import ChainSender
from common.weights.checksum import checksum_for
from common.weights.group import BACKEND_KEY, GPU_KEY, INSTANCE_KEY, default_device, gpu_uuid
from common.weights.layout import ALIGN, WeightSyncError, build_layout
from common.weights.pairwise import PairwiseRound
from common.weights.roster import Roster
from common.weights.rounds import Member, PublishReport, RoundOutcome, Update
from common.weights.stream import FeedReader, HeldFeed, Passes, UnitFeed

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
                 pairwise: bool, hold: bool = False) -> None:  # fmt: skip
        self.pub, self.update, self.t0 = pub, update, t0
        self.deadline = t0 + update.allowance_s
        # a copy of each unit, when slow members are sent the update later from memory
        self._held: list | None = [None] * update.n_units if hold else None
        self.passes, self._thread, self._outcome = pub._start_round(
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
        unit = pack_unit(tensors, self.layout, k, self.pub.device)
        if self._held is not None:  # in host memory; a tensor alone is its own memory: copied
            _, _, first, last = self.layout["units"][k]
            alone = last - first == 1
            self._held[k] = unit.to("cpu", copy=alone) if alone or unit.is_cuda else unit
        feed.put(unit, deadline=self.deadline)

    def close(self) -> PublishReport:
        self._thread.join(max(0.0, self.deadline - time.monotonic()))
        if self._held is not None and all(u is not None for u in self._held):
            self.update.units = self._held  # the slow members' copy (``_serve_slow``)
        self.pub.roster.release()
        return self.pub._report(self.update, self.t0, self._outcome)


class WeightPublisher:
    """Learner side (rank 0 only): hosts the store and publishes versions; its parts are the
    ``Acceptor`` (joins), the ``Roster`` (members), the ``PairwiseRound`` and the
    ``ChainSender``."""

    def __init__(self, host: str, port: int, *, backend: str = "gloo", timeout_s: float = 60.0,
                 bucket_bytes: int = int(BUCKET_MB * 2**20), accept_interval_s: float = 0.2,
                 device: str | None = None, auto_accept: bool = True, fanout: str = "chain",
                 chunk_bytes: int = int(CHUNK_MB * 2**20), secret: bytes | None = None,
                 min_gb_per_s: float = MIN_GB_PER_S,
                 slow_link_fraction: float = 0.0) -> None:  # fmt: skip
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
        self.fanout, self.chunk_bytes = fanout, chunk_bytes
        self.device = device or default_device(backend)
        self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout_s))  # fmt: skip
        self._store.set(BACKEND_KEY, backend)
        instance = uuid.uuid4().hex  # also the challenge a join's proof is bound to
        self._store.set(INSTANCE_KEY, instance)
        # handshake.py: without a secret, any process that reaches the port joins
        if secret is None:
            logger.warning(
                "weight store on %s:%d accepts any join: set %s (the same in every generator) "
                "so that only this run's processes join", host, port, handshake.SECRET_ENV,
            )  # fmt: skip
        if backend == "nccl":
            self._store.set(GPU_KEY, gpu_uuid(self.device))
        self.roster = Roster(slow_fraction=slow_link_fraction)
        self._slow_lane: threading.Thread | None = None  # the slow members' background round
        self.acceptor = Acceptor(self._store, self.roster, host=host, backend=backend,
                                 timeout_s=timeout_s, secret=secret,
                                 instance=instance)  # fmt: skip
        self.pairwise = PairwiseRound(self.roster, device=self.device)
        self.chain = ChainSender(self.roster, host=host, port=self.port, backend=backend,
                                 timeout_s=timeout_s, device=self.device)  # fmt: skip
        if auto_accept:
            self.acceptor.start(accept_interval_s, self.publish_to_new_members)

    @property
    def port(self) -> int:
        return self._store.port

    def members(self) -> dict[str, int]:
        """Live members: member id -> epoch."""
        return self.roster.ids()

    def close(self) -> None:
        """Stop accepting, and let go of every process group (the members', the chain's links):
        on a bounded wait, so that none is left for the interpreter's shutdown."""
        self.acceptor.stop()
        self.roster.clear()
        self.chain.close(wait_s=5.0)

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
            _, thread, outcome = self._start_round(
                update, members, t0 + update.allowance_s, pairwise=self.fanout == "pairwise"
            )
            thread.join(max(0.0, t0 + update.allowance_s - time.monotonic()))
        finally:
            self.roster.release()
        return self._report(update, t0, outcome)

    def begin(self, specs: Iterable[tuple[str, Any]], version: int) -> StreamedPublish:
        """Start a streamed publish of ``version``: ``specs`` name every tensor with its dtype
        and shape (meta tensors will do); the caller then makes the passes (``StreamedPublish``)."""
        t0 = time.monotonic()
        named = sorted(((n, t.detach()) for n, t in specs), key=lambda nt: nt[0])
        update = self._new_update(named, version)
        members = self._open(update)
        return StreamedPublish(self, update, members=members, t0=t0,
                               pairwise=self.fanout == "pairwise",
                               hold=bool(self.roster.slow_ids()))  # fmt: skip

    def behind(self) -> list[str]:
        """Members (joined since) that lack the latest version: a streamed update is not kept,
        so they wait for ``begin_catch_up`` (a publish held in memory serves them itself)."""
        update, behind = self.roster.behind()
        if update is None or update.units is not None:  # held: the acceptor serves them
            return []
        return [m.member_id for m in behind if not self.roster.is_slow(m)]

    def begin_catch_up(self) -> StreamedPublish | None:
        """A streamed publish of the latest version again, pairwise, to the members that lack
        it (``None`` when none does); the caller makes its pass as for ``begin``."""
        self.acceptor.take()
        t0 = time.monotonic()
        update, behind = self.roster.claim_behind()
        if update is None or not behind:
            return None
        return StreamedPublish(self, update, members=behind, t0=t0, pairwise=True)

    def publish_to_new_members(self) -> dict[str, str]:
        """Accept pending joins and send the latest version to members that lack it; not while a
        publish runs (it serves the members it could lock; a member that joined meanwhile is
        caught up here right after it, within the publish's deadline). A streamed update is not
        held: its late joiners wait for ``begin_catch_up``."""
        self.acceptor.take()
        self._serve_slow()
        update, behind = self.roster.behind(unless_publishing=True)
        behind = [m for m in behind if not self.roster.is_slow(m)]
        if not behind or update is None or update.units is None:
            return {}
        deadline = time.monotonic() + update.allowance_s
        _, thread, outcome = self._start_round(update, behind, deadline, pairwise=True)
        thread.join(max(0.0, deadline - time.monotonic()))
        return outcome.settled()

    def _serve_slow(self) -> None:
        """The slow members that lack the latest version held in memory get it pairwise, on a
        thread of their own that nothing waits for (one such round at a time; a member still
        taking an older one is locked by it, and gets the latest on the next call). Outcomes
        are as in any pairwise round: a member that misses the deadline is dropped."""
        if self._slow_lane is not None and self._slow_lane.is_alive():
            return
        update, behind = self.roster.behind()
        slow = [m for m in behind if self.roster.is_slow(m)]
        if update is None or update.units is None or not slow:
            return
        _, self._slow_lane, _ = self._start_round(
            update, slow, time.monotonic() + update.allowance_s, pairwise=True
        )

    # -- internals

    def _new_update(self, named: list, version: int) -> Update:
        names = [n for n, _ in named]
        if len(set(names)) != len(names) or not named:
            raise ValueError("publish needs a non-empty set of tensors with unique names")
        latest = self.roster.latest_version()
        if latest >= 0 and version <= latest:
            raise ValueError(f"weight versions must increase: got {version} after {latest}")
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
        """Make ``update`` the latest, take in pending joins; the members to send it to (not
        the slow ones: ``_serve_slow``)."""
        self.roster.open(update)
        self.acceptor.take(wait=False)  # if it is busy, the acceptor will catch them up
        return [m for m in self.roster.all() if not self.roster.is_slow(m)]

    def _start_round(self, update: Update, members: list[Member], deadline: float, *,
                     pairwise: bool) -> tuple[Passes, threading.Thread, RoundOutcome]:  # fmt: skip
        """The round (chain or pairwise) on a thread of its own; it asks for passes through the
        returned ``Passes`` and fills the returned ``RoundOutcome`` as it goes."""
        passes: Passes = Passes()
        outcome = RoundOutcome()

        def run() -> None:
            try:
                if pairwise:
                    readers = self._readers(update, passes, len(members))
                    self.pairwise.run(update, members, readers, deadline, outcome)
                else:
                    new_pass = lambda: self._readers(update, passes, 1)[0]  # noqa: E731
                    self.chain.run(update, members, deadline, new_pass, outcome)
            finally:
                passes.done()

        thread = threading.Thread(target=run, name="wsync-round", daemon=True)
        thread.start()
        return passes, thread, outcome

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
            feed = HeldFeed(update.units, self.device)
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

    def _report(self, update: Update, t0: float, outcome: RoundOutcome) -> PublishReport:
        per_member = outcome.settled()
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
               "Bytes the learner sent").inc(outcome.root_bytes)  # fmt: skip
        return PublishReport(update.version, update.nbytes, seconds, update.digest.hex(),
                             per_member, outcome.root_bytes, self.chain.epoch,
                             self.roster.slow_ids())  # fmt: skip
