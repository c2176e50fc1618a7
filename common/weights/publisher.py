"""Learner side (rank 0 only): hosts the store, accepts members, publishes versions down a chain
of the members (one copy out of the learner) or to each of them pairwise, within a deadline (see
the package docstring)."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from common.config.shared import BUCKET_MB, CHUNK_MB
from common.telemetry.metrics import metric
from common.weights.buckets import unit_buffers
from common.weights.chain import ChainRound, Route, link, release_later
from common.weights.checksum import hash_tensor
from common.weights.group import (
    BACKEND_KEY,
    GPU_KEY,
    INSTANCE_KEY,
    default_device,
    gpu_uuid,
    make_pair_group,
    use_device,
)
from common.weights.layout import ALIGN, WeightSyncError, build_layout
from common.weights.transfer import send_update

logger = logging.getLogger(__name__)


@dataclass
class PublishReport:
    version: int
    bytes: int
    seconds: float
    checksum: str
    per_member: dict[str, str] = field(default_factory=dict)
    root_bytes: int = 0  # what the learner itself sent: once per chain round, once per pairwise
    epoch: int = 0  # the chain epoch of the last round (0: nothing went down a chain)


@dataclass(eq=False)
class _Member:
    member_id: str
    epoch: int
    pg: Any
    store: Any
    version_sent: int = -1
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class _Update:
    version: int
    header: bytes
    units: list
    nbytes: int
    digest: bytes = b""
    hashed: threading.Event = field(default_factory=threading.Event)

    def wait_digest(self, deadline: float) -> bytes:
        if not self.hashed.wait(max(0.0, deadline - time.monotonic())):
            raise WeightSyncError("checksum not ready before the deadline")
        return self.digest


class WeightPublisher:
    """Learner side (rank 0 only): hosts the store, accepts members, publishes versions."""

    def __init__(self, host: str, port: int, *, backend: str = "gloo", timeout_s: float = 60.0,
                 bucket_bytes: int = int(BUCKET_MB * 2**20), accept_interval_s: float = 0.2,
                 device: str | None = None, auto_accept: bool = True, fanout: str = "chain",
                 chunk_bytes: int = int(CHUNK_MB * 2**20)) -> None:  # fmt: skip
        if timeout_s <= 0 or bucket_bytes < ALIGN or chunk_bytes < 0:
            raise ValueError(
                f"weight sync needs timeout_s > 0, bucket_bytes >= {ALIGN} and chunk_bytes >= 0; "
                f"got timeout_s={timeout_s}, bucket_bytes={bucket_bytes}, chunk_bytes={chunk_bytes}"
            )
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
        self._store.set(INSTANCE_KEY, uuid.uuid4().hex)
        if backend == "nccl":
            self._store.set(GPU_KEY, gpu_uuid(self.device))
        self._members: dict[str, _Member] = {}
        self._latest: _Update | None = None
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
        """Send ``version`` to every member concurrently; returns within ``timeout_s``."""
        t0 = time.monotonic()
        named = sorted(((n, t.detach()) for n, t in named_tensors), key=lambda nt: nt[0])
        names = [n for n, _ in named]
        if len(set(names)) != len(names) or not named:
            raise ValueError("publish needs a non-empty set of tensors with unique names")
        with self._lock:
            if self._latest is not None and version <= self._latest.version:
                raise ValueError(
                    f"weight versions must increase: got {version} after {self._latest.version}"
                )
        layout = build_layout(named, version, self.bucket_bytes, self.chunk_bytes)
        update = _Update(version, json.dumps(layout).encode(),
                         unit_buffers(named, layout, self.device),
                         sum(t[4] for t in layout["tensors"]))  # fmt: skip
        hasher = threading.Thread(target=self._hash, args=(update, named), daemon=True)
        hasher.start()
        with self._lock:
            self._latest, self._publishing = update, True
        if self._accept_lock.acquire(blocking=False):  # else the acceptor will catch them up
            try:
                self._accept_pending()
            finally:
                self._accept_lock.release()
        with self._lock:
            members = list(self._members.values())
        try:
            if self.fanout == "chain":
                per_member, root_bytes = self._send_chain(update, members, t0 + self.timeout_s)
            else:
                per_member = self._send_all(update, members, t0 + self.timeout_s)
                root_bytes = update.nbytes * len(members)
        finally:
            with self._lock:
                self._publishing = False
        hasher.join(max(0.0, t0 + self.timeout_s - time.monotonic()))
        seconds = time.monotonic() - t0
        metric("Histogram", "tether_weights_publish_seconds", "Publish time").observe(seconds)
        metric("Counter", "tether_weights_publish_bytes_total",
               "Bytes the learner sent").inc(root_bytes)  # fmt: skip
        return PublishReport(version, update.nbytes, seconds, update.digest.hex(), per_member,
                             root_bytes, self._chain_epoch)  # fmt: skip

    def publish_to_new_members(self) -> dict[str, str]:
        """Accept pending joins and send the latest version to members that lack it; not while a
        publish runs (it serves the members it could lock; a member that joined meanwhile is
        caught up here right after it, within the publish's deadline)."""
        with self._accept_lock:
            self._accept_pending()
        with self._lock:
            update = self._latest
            behind = [
                m
                for m in self._members.values()
                if update and m.version_sent < update.version and not self._publishing
            ]
        if not behind or update is None:
            return {}
        return self._send_all(update, behind, time.monotonic() + self.timeout_s)

    # -- internals

    @staticmethod
    def _hash(update: _Update, named) -> None:
        import xxhash

        h = xxhash.xxh3_128()
        for name, t in named:
            hash_tensor(h, name, t)
        update.digest = h.digest()
        update.hashed.set()

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
            # <member>:<join epoch>:<version it holds from this publisher, -1 for none>
            member_id, epoch, has = entry.split(":")
            prefix = f"wsync/{member_id}/{epoch}/"
            pstore = dist.PrefixStore(prefix, self._store)
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
                self._members[member_id] = _Member(member_id, int(epoch), pg, pstore, int(has))
                n = len(self._members)
            metric("Gauge", "tether_weights_members", "Live weight-sync members").set(n)
            logger.info("weight sync: %s joined (epoch %s)", member_id, epoch)

    def _send_all(self, update: _Update, members: list[_Member], deadline: float) -> dict:
        results: dict[str, str] = {}
        done = threading.Lock()

        def one(m: _Member) -> None:
            outcome = self._send_one(m, update, deadline)
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
                    self._drop(m, "timeout")
            return dict(results)

    def _send_one(self, m: _Member, update: _Update, deadline: float) -> str:
        if not m.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            # held by a chain publish until its deadline: the member's outcome is that publish's
            return "ok" if m.version_sent >= update.version else "timeout"
        try:
            if m.version_sent >= update.version:
                return "ok"
            m.store.set("route", str(Route(update.version)))
            m.store.set("pending", str(update.version))
            use_device(self.device)  # this sender thread's GPU
            send_update(m.pg, update.header, update.version, update.units,
                        lambda: update.wait_digest(deadline), deadline)  # fmt: skip
            m.version_sent = update.version
            return "ok"
        except Exception as e:
            if time.monotonic() >= deadline:
                return "timeout"
            self._drop(m, "error")
            return f"error: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"
        finally:
            m.lock.release()

    def _send_chain(self, update: _Update, members: list[_Member], deadline: float):
        """Send ``update`` down a chain of the members this thread can lock now (the others are
        being caught up pairwise and get it from the acceptor); on a failure blame one member
        (``ChainRound``), drop it, and send the rest again at once down a new chain."""
        chain = [m for m in sorted(members, key=lambda m: m.member_id) if m.lock.acquire(False)]
        results: dict[str, str] = {}
        root_bytes = 0
        try:
            rest = [m for m in chain if m.version_sent < update.version]
            results.update({m.member_id: "ok" for m in chain if m not in rest})
            while rest and time.monotonic() < deadline:
                epoch, routes = self._route(update.version, rest)
                sender: dict[str, str] = {}
                threading.Thread(target=self._send_first, args=(update, epoch, sender, deadline),
                                 name="wsync-chain", daemon=True).start()  # fmt: skip
                root_bytes += update.nbytes
                acked, blamed, why = self._round.watch(rest, routes, sender, deadline)
                for m in acked:
                    results[m.member_id], m.version_sent = "ok", update.version
                rest = [m for m in rest if m not in acked and m is not blamed]
                if blamed is None:
                    break
                results[blamed.member_id] = why
                self._chain_dirty = True
                self._drop(blamed, why.split(":")[0].split(" ")[0])
            for m in rest:
                results[m.member_id], self._chain_dirty = "timeout", True
                self._drop(m, "timeout")
        finally:
            for m in chain:
                m.lock.release()
        return results, root_bytes

    def _route(self, version: int, rest: list[_Member]) -> tuple[int, list[str]]:
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
            m.store.multi_set(["result", "progress", "below", "route"], ["", "", "", r])
            m.store.set("pending", str(version))
        return self._chain_epoch, routes

    def _send_first(self, update: _Update, epoch: int, box: dict, deadline: float) -> None:
        """The learner's only send of a chain round: to the first member, over link 1."""
        try:
            use_device(self.device)
            pg = self._links1.get(epoch)
            if pg is None:
                pg = link(self._host, self.port, epoch, 1, 0, backend=self.backend,
                          timeout_s=self.timeout_s)  # fmt: skip
                if epoch == self._chain_epoch:
                    self._links1[epoch] = pg
            send_update(pg, update.header, update.version, update.units,
                        lambda: update.wait_digest(deadline), deadline,
                        lambda: self._chain_epoch != epoch)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - ChainRound blames the first member
            box["error"] = str(e).splitlines()[0][:200] if str(e) else type(e).__name__

    def _drop(self, m: _Member, reason: str) -> None:
        with self._lock:
            if self._members.get(m.member_id) is not m:
                return
            del self._members[m.member_id]
            n = len(self._members)
        metric("Gauge", "tether_weights_members", "Live weight-sync members").set(n)
        metric("Counter", "tether_weights_member_failures_total", "Member failures",
                ("reason",)).labels(reason).inc()  # fmt: skip
        logger.warning("weight sync: dropped %s (epoch %d): %s", m.member_id, m.epoch, reason)
        try:
            m.store.set("dropped", reason)
        except Exception:  # the store is ours; a failure here only delays the rejoin
            logger.debug("could not mark %s dropped", m.member_id, exc_info=True)
