"""Versioned, bounded, elastic weight sync: learner (rank 0) -> generators.

Membership
    The learner hosts a ``torch.distributed.TCPStore`` (``is_master``). A generator joins by
    bumping ``wsync/epoch/<member>`` (its epoch: 1 on the first join, +1 on every rejoin) and
    appending ``<member>:<epoch>`` to a join list. The publisher's acceptor thread (or
    ``publish_to_new_members()``) picks joins up within ``accept_interval_s`` and both sides build
    a 2-process group (``ProcessGroupGloo``, or ``ProcessGroupNCCL`` with ``backend="nccl"``:
    same code) over ``PrefixStore("wsync/<member>/<epoch>/", store)`` with ``timeout_s``. The
    publisher writes its backend to the store and a receiver (``backend="auto"``) follows it, so
    both sides always agree; with NCCL the buffers live on each side's current GPU, and every
    collective is polled against the deadline (``finish``): NCCL's ``wait()`` does not block,
    and a stuck transfer aborts only that member's group. The NCCL pair has not been run here
    (one GPU at most; NCCL refuses two ranks on one device); gloo is the default.

Why one group per member and not one per membership epoch
    A shared group makes every member wait for the slowest one and a peer that dies mid-broadcast
    poisons the collective for all. Pairwise groups isolate failures: a dead or hung generator only
    breaks its own group; it is dropped and the others finish. The cost is that the learner sends
    the bytes once per member (N x the traffic of a tree broadcast), which is fine for a handful of
    generators on one node; very large fleets would want a relay tree (not built).

One update on the wire (per member; every step is a broadcast from rank 0 = learner)
    1. ``int64[3]`` = (magic, version, header length)
    2. ``uint8[header length]`` = JSON header: version, tensor names (sorted), dtypes, shapes,
       byte offsets in a flat staging buffer (64-byte aligned), the units and the total bytes.
    3. the units: runs of consecutive tensors of at most ``bucket_bytes``; a tensor at least as big
       as a bucket goes alone and is sent from its own memory (no copy); small tensors are packed
       once per publish into shared buffers.
    4. ``uint8[16]`` = checksum (sent last so sending overlaps the sender's hashing).
    Before step 1 the learner sets ``pending`` = version in the member's store prefix, so a
    generator can poll cheaply (``pending_version()``) and only enter the collective when an
    update is really on its way.

Checksum
    xxh3-128 over, for every tensor in name order, ``"<name>|<dtype>|<shape>\\n"`` followed by its
    raw bytes (``tensors_checksum``). Exact (any flipped byte, missing tensor or reordering
    changes it) and fast (~5 GB/s), but not a defence against a malicious sender.

Guarantees
    * ``publish`` returns within ``timeout_s`` (+ thread hand-off slack) whatever the members do;
      each member gets "ok", "timeout" or "error: ..."; failed members are dropped and may rejoin
      (new epoch). A member that (re)joins is sent the latest version promptly by the acceptor.
    * Versions are strictly increasing ints (learner optimizer steps); each member receives them in
      order.
    * The receiver gets everything into a staging buffer and verifies the checksum before handing
      tensors out: a failed, partial or corrupted update raises ``WeightSyncError`` and leaves
      the caller on its previous complete version. After a failure the receiver must ``join()``
      again (its group is in an unknown state).
    * The publisher keeps references to the tensors of the latest publish to serve late joiners:
      do not modify them in place afterwards (a mismatch would be caught by the checksum).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

logger = logging.getLogger(__name__)

MAGIC = 0x7E7E_0001
ALIGN = 64
_JOIN_SEQ = "wsync/join_seq"
_BACKEND_KEY = "wsync/backend"  # set by the publisher: receivers use the learner's choice
_GPU_KEY = "wsync/learner_gpu"  # NCCL: the learner's GPU, so a generator on it can say so
NCCL_WATCHDOG_MARGIN_S = 60.0
PROBE_TIMEOUT_S = 5.0  # connecting to the weight store's port before building the TCPStore client


class WeightSyncError(RuntimeError):
    """A weight update failed; the receiver keeps its previous complete version."""


@dataclass
class PublishReport:
    version: int
    bytes: int
    seconds: float
    checksum: str
    per_member: dict[str, str] = field(default_factory=dict)


def _tensor_bytes(t):
    """A flat uint8 view of a contiguous tensor (a copy only if it was not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(__import__("torch").uint8)


def _hash_tensor(h, name: str, t) -> None:
    h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}\n".encode())
    b = _tensor_bytes(t)
    if b.device.type != "cpu":
        b = b.cpu()
    h.update(b.numpy())


def tensors_checksum(named_tensors: Iterable[tuple[str, Any]]) -> str:
    """Checksum of tensors by name order (see module docstring); used by every side."""
    import xxhash

    h = xxhash.xxh3_128()
    for name, t in sorted(named_tensors, key=lambda nt: nt[0]):
        _hash_tensor(h, name, t)
    return h.hexdigest()


def _dtype(name: str):
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise WeightSyncError(f"header names unknown dtype {name!r}")
    return dt


def _default_device(backend: str) -> str:
    """Where update buffers live: this process's current GPU for NCCL, host memory for gloo."""
    if backend == "gloo":
        return "cpu"
    if backend != "nccl":
        raise ValueError(f"weight sync backend must be 'gloo' or 'nccl', got {backend!r}")
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            'weights.backend = "nccl" needs a CUDA GPU in both the learner and the generator '
            '(on different GPUs: NCCL refuses two ranks on one device); use "gloo" (the default)'
        )
    return f"cuda:{torch.cuda.current_device()}"


def _probe(host: str, port: int, *, timeout_s: float) -> None:
    """Fail at once when nothing listens at the weight store's address (a learner that died or
    restarted elsewhere): a TCPStore client keeps retrying a refused connection for up to
    ~2 × its timeout (measured: 18.6 s for 10 s), which kept a generator from stopping or
    re-reading the address for minutes with the default 120 s."""
    import socket

    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise WeightSyncError(
            f"the learner's weight store at {host}:{port} is not reachable ({e})"
        ) from e


def _gpu_uuid(device: str) -> str:
    import torch

    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


def build_layout(named: list[tuple[str, Any]], version: int, bucket_bytes: int) -> dict:
    """The JSON header for a sorted list of tensors: offsets, units, total bytes."""
    tensors, units, off = [], [], 0
    cur: list[int] = []
    for i, (name, t) in enumerate(named):
        nbytes = t.numel() * t.element_size()
        tensors.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), off, nbytes])
        if cur and (off + nbytes - tensors[cur[0]][3] > bucket_bytes):
            units.append(cur)
            cur = []
        cur.append(i)
        off += -(-nbytes // ALIGN) * ALIGN
    if cur:
        units.append(cur)
    unit_ranges = [
        [tensors[u[0]][3], tensors[u[-1]][3] + tensors[u[-1]][4], u[0], u[-1] + 1] for u in units
    ]
    return {"version": version, "tensors": tensors, "units": unit_ranges, "total": off}


def _unit_buffers(named, layout, device) -> list:
    """The tensor sent for each unit: the tensor's own bytes if alone, else a packed copy."""
    import torch

    out = []
    for start, end, first, last in layout["units"]:
        if last - first == 1:
            out.append(_tensor_bytes(named[first][1]).to(device))
            continue
        buf = torch.zeros(end - start, dtype=torch.uint8, device=device)
        for i in range(first, last):
            _, _, _, off, nbytes = layout["tensors"][i]
            buf[off - start : off - start + nbytes].copy_(_tensor_bytes(named[i][1]))
        out.append(buf)
    return out


def make_pair_group(store, rank: int, *, backend: str, timeout_s: float):
    """A 2-process group (rank 0 = learner) over ``store``; blocks until both sides are in."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        # Our own deadline (``finish``) aborts a stuck transfer first; NCCL's watchdog, which tears
        # the whole process down on a timeout, gets a later one.
        opts._timeout = timedelta(seconds=timeout_s + NCCL_WATCHDOG_MARGIN_S)
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    raise ValueError(f"weight sync backend must be 'gloo' or 'nccl', got {backend!r}")


def broadcast(pg, tensor):
    """Start a broadcast from rank 0 on a pairwise group; returns the work handle."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([tensor], opts)


def finish(pg, work, deadline: float | None) -> None:
    """Wait for one collective, bounded by ``deadline`` (``time.monotonic()``; None = the group's
    own timeout).

    gloo's ``wait()`` blocks the caller and honours the group's timeout. NCCL's only orders the
    GPU stream and returns at once: completion is polled instead, and a transfer still running at
    the deadline (a peer that died or hangs) aborts the pairwise communicator — only this member
    is lost — instead of leaving NCCL's watchdog to kill the process later.
    """
    if type(pg).__name__ != "ProcessGroupNCCL":
        work.wait()
        return
    while not work.is_completed():
        if deadline is not None and time.monotonic() >= deadline:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - the member is dropped either way
                logger.warning("aborting the NCCL weight group failed", exc_info=True)
            raise WeightSyncError("NCCL weight transfer did not finish before the deadline")
        time.sleep(0.0005)
    work.wait()  # raises the collective's error, if any


def send_update(
    pg, header: bytes, version: int, units: list, digest, deadline: float | None = None
) -> None:
    """Learner side of one update (steps 1-4 of the module docstring). ``digest`` is a
    zero-argument callable returning the 16-byte checksum; it is called after the units went out."""
    import torch

    dev = units[0].device if units else torch.device("cpu")
    meta = torch.tensor([MAGIC, version, len(header)], dtype=torch.int64, device=dev)
    hdr = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(dev)
    for t in [meta, hdr, *units]:  # one op in flight: gloo runs queued ops on parallel threads
        finish(pg, broadcast(pg, t), deadline)
    tail = torch.frombuffer(bytearray(digest()), dtype=torch.uint8).to(dev)
    finish(pg, broadcast(pg, tail), deadline)


def receive_update(
    pg, *, device: str = "cpu", on_unit=None, staging=None, deadline: float | None = None
) -> tuple:
    """Generator side of one update: staging buffer (``staging`` is reused if big enough),
    incremental hash, verify, then hand out. Returns (version, named, checksum, staging)."""
    import torch
    import xxhash

    meta = torch.zeros(3, dtype=torch.int64, device=device)
    finish(pg, broadcast(pg, meta), deadline)
    magic, version, hlen = (int(x) for x in meta.cpu())
    if magic != MAGIC or not 0 < hlen < (1 << 30):
        raise WeightSyncError(f"bad update preamble (magic {magic:#x}, header {hlen} bytes)")
    hdr = torch.zeros(hlen, dtype=torch.uint8, device=device)
    finish(pg, broadcast(pg, hdr), deadline)
    layout = json.loads(bytes(hdr.cpu().numpy()))
    if layout.get("version") != version:
        raise WeightSyncError("header version does not match the preamble")
    total = int(layout["total"])
    if staging is None or staging.numel() < total:
        staging = torch.empty(total, dtype=torch.uint8, device=device)
    named = []
    for name, dt, shape, off, nbytes in layout["tensors"]:
        view = staging[off : off + nbytes].view(_dtype(dt)).reshape(shape)
        named.append((name, view))
    units = layout["units"]
    h = xxhash.xxh3_128()
    work: Any = broadcast(pg, staging[units[0][0] : units[0][1]]) if units else None
    for k, (_, _, first, last) in enumerate(units):
        finish(pg, work, deadline)
        if k + 1 < len(units):  # hash unit k while unit k+1 arrives
            work = broadcast(pg, staging[units[k + 1][0] : units[k + 1][1]])
        for name, t in named[first:last]:
            _hash_tensor(h, name, t)
        if on_unit is not None:
            on_unit(k)
    tail = torch.zeros(16, dtype=torch.uint8, device=device)
    finish(pg, broadcast(pg, tail), deadline)
    sent = bytes(tail.cpu().numpy()).hex()
    if sent != h.hexdigest():
        raise WeightSyncError(
            f"checksum mismatch for version {version}: sent {sent}, received {h.hexdigest()}; "
            "the update was discarded"
        )
    return version, named, sent, staging


# ----------------------------------------------------------------------------- metrics

_METRICS: dict[str, Any] = {}


def _metric(kind: str, name: str, doc: str, labels: tuple[str, ...] = ()):
    if name not in _METRICS:
        import prometheus_client as pc

        try:
            _METRICS[name] = getattr(pc, kind)(name, doc, labels)
        except ValueError:  # registered by another import path of this module
            _METRICS[name] = pc.REGISTRY._names_to_collectors[name]
    return _METRICS[name]


# ----------------------------------------------------------------------------- learner side


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
                 bucket_bytes: int = 64 << 20, accept_interval_s: float = 0.2,
                 device: str | None = None, auto_accept: bool = True) -> None:  # fmt: skip
        if timeout_s <= 0 or bucket_bytes < ALIGN:
            raise ValueError(
                f"weight sync needs timeout_s > 0 and bucket_bytes >= {ALIGN}; got "
                f"timeout_s={timeout_s}, bucket_bytes={bucket_bytes}"
            )
        import torch.distributed as dist

        self.backend, self.timeout_s, self.bucket_bytes = backend, timeout_s, bucket_bytes
        self.device = device or _default_device(backend)
        self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout_s))  # fmt: skip
        self._store.set(_BACKEND_KEY, backend)
        if backend == "nccl":
            self._store.set(_GPU_KEY, _gpu_uuid(self.device))
        self._members: dict[str, _Member] = {}
        self._latest: _Update | None = None
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
        layout = build_layout(named, version, self.bucket_bytes)
        update = _Update(version, json.dumps(layout).encode(),
                         _unit_buffers(named, layout, self.device),
                         sum(t[4] for t in layout["tensors"]))  # fmt: skip
        hasher = threading.Thread(target=self._hash, args=(update, named), daemon=True)
        hasher.start()
        with self._lock:
            self._latest = update
        if self._accept_lock.acquire(blocking=False):  # else the acceptor will catch them up
            try:
                self._accept_pending()
            finally:
                self._accept_lock.release()
        with self._lock:
            members = list(self._members.values())
        per_member = self._send_all(update, members, t0 + self.timeout_s)
        hasher.join(max(0.0, t0 + self.timeout_s - time.monotonic()))
        seconds = time.monotonic() - t0
        _metric("Histogram", "tether_weights_publish_seconds", "Publish time").observe(seconds)
        sent = update.nbytes * sum(r == "ok" for r in per_member.values())
        _metric("Counter", "tether_weights_publish_bytes_total", "Bytes published").inc(sent)
        return PublishReport(version, update.nbytes, seconds, update.digest.hex(), per_member)

    def publish_to_new_members(self) -> dict[str, str]:
        """Accept pending joins and send the latest version to members that lack it."""
        with self._accept_lock:
            self._accept_pending()
        with self._lock:
            update = self._latest
            behind = [
                m for m in self._members.values() if update and m.version_sent < update.version
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
            _hash_tensor(h, name, t)
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
            member_id, _, epoch = entry.rpartition(":")
            pstore = dist.PrefixStore(f"wsync/{member_id}/{epoch}/", self._store)
            try:
                pg = make_pair_group(pstore, 0, backend=self.backend, timeout_s=self.timeout_s)
            except Exception as e:
                logger.warning("weight sync: join of %s epoch %s failed: %s", member_id, epoch, e)
                _metric("Counter", "tether_weights_member_failures_total", "Member failures",
                        ("reason",)).labels("join").inc()  # fmt: skip
                continue
            with self._lock:
                self._members[member_id] = _Member(member_id, int(epoch), pg, pstore)
                n = len(self._members)
            _metric("Gauge", "tether_weights_members", "Live weight-sync members").set(n)
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
            return "timeout"
        try:
            if m.version_sent >= update.version:
                return "ok"
            m.store.set("pending", str(update.version))
            if self.device.startswith("cuda"):
                import torch

                torch.cuda.set_device(torch.device(self.device))  # this sender thread's device
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

    def _drop(self, m: _Member, reason: str) -> None:
        with self._lock:
            if self._members.get(m.member_id) is not m:
                return
            del self._members[m.member_id]
            n = len(self._members)
        _metric("Gauge", "tether_weights_members", "Live weight-sync members").set(n)
        _metric("Counter", "tether_weights_member_failures_total", "Member failures",
                ("reason",)).labels(reason).inc()  # fmt: skip
        logger.warning("weight sync: dropped %s (epoch %d): %s", m.member_id, m.epoch, reason)
        try:
            m.store.set("dropped", reason)
        except Exception:  # the store is ours; a failure here only delays the rejoin
            logger.debug("could not mark %s dropped", m.member_id, exc_info=True)


# ----------------------------------------------------------------------------- generator side


class WeightReceiver:
    """Generator side: ``join()``, then ``poll()`` cheaply and ``receive()`` when one is pending."""

    def __init__(self, host: str, port: int, member_id: str, *, backend: str = "auto",
                 timeout_s: float = 60.0, device: str | None = None) -> None:  # fmt: skip
        if not member_id or ":" in member_id or ";" in member_id or "/" in member_id:
            raise ValueError(f"member_id must be non-empty without ':', ';' or '/': {member_id!r}")
        self.host, self.port, self.member_id = host, port, member_id
        self.backend, self.timeout_s, self.device = backend, timeout_s, device
        self.version: int | None = None
        self.epoch: int | None = None
        self._store: Any = None
        self._pstore: Any = None
        self._pg: Any = None
        self._spare = self._latest_buf = None

    @property
    def joined(self) -> bool:
        return self._pg is not None

    def join(self) -> int:
        """Register with the learner (new epoch) and build the pairwise group; returns the epoch."""
        import torch.distributed as dist

        self._pg = None
        try:
            if self._store is None:
                _probe(self.host, self.port, timeout_s=min(self.timeout_s, PROBE_TIMEOUT_S))
                self._store = dist.TCPStore(self.host, self.port, is_master=False,
                                            timeout=timedelta(seconds=self.timeout_s))  # fmt: skip
            # the publisher sets the key before it can be reached; a store without it is gloo
            has_key = self._store.check([_BACKEND_KEY])
            announced = self._store.get(_BACKEND_KEY).decode() if has_key else "gloo"
            if self.backend not in ("auto", announced):
                raise WeightSyncError(
                    f"this generator was set to backend {self.backend!r} but the learner "
                    f"publishes over {announced!r}: set weights.backend the same on both"
                )
            self.backend = announced
            self.device = self.device or _default_device(announced)
            if announced == "nccl" and self._store.get(_GPU_KEY).decode() == _gpu_uuid(self.device):
                raise WeightSyncError(
                    f"the learner and generator {self.member_id!r} share GPU {self.device}: NCCL "
                    'cannot connect two ranks on one GPU; set weights.backend = "gloo"'
                )
            epoch = int(self._store.add(f"wsync/epoch/{self.member_id}", 1))
            self._pstore = dist.PrefixStore(f"wsync/{self.member_id}/{epoch}/", self._store)
            self._store.append("wsync/joins", f"{self.member_id}:{epoch};")
            self._pg = make_pair_group(self._pstore, 1, backend=self.backend,
                                       timeout_s=self.timeout_s)  # fmt: skip
        except Exception as e:
            raise WeightSyncError(
                f"could not join the learner's weight sync at {self.host}:{self.port} "
                f"as {self.member_id!r}: {e}. Check that the learner runs and that the "
                "weight sync host/port settings match"
            ) from e
        self.epoch = epoch
        logger.info("weight sync: joined as %s epoch %d", self.member_id, epoch)
        return epoch

    def poll(self) -> int | None:
        """The version waiting to be received if it is newer than ours, else None.
        Raises ``WeightSyncError`` when not joined or dropped by the learner (then rejoin)."""
        if self._pg is None:
            raise WeightSyncError(f"{self.member_id} is not joined: call join() first")
        if self._pstore.check(["dropped"]):
            self._pg = None
            reason = self._pstore.get("dropped").decode()
            raise WeightSyncError(f"the learner dropped {self.member_id} ({reason}): rejoin")
        if not self._pstore.check(["pending"]):
            return None
        pending = int(self._pstore.get("pending"))
        return pending if self.version is None or pending > self.version else None

    def receive(self, *, wait_s: float | None = None, on_unit=None) -> tuple[int, list]:
        """Wait up to ``wait_s`` (default ``timeout_s``) for an update, receive and verify it.

        Returns ``(version, [(name, tensor), ...])``: views into a staging buffer that stays
        valid until the next-but-one ``receive()`` (two buffers alternate). Raises
        ``WeightSyncError`` on timeout, failure or checksum mismatch; ``self.version`` is then
        unchanged and the receiver must ``join()`` again unless nothing had arrived yet.
        """
        deadline = time.monotonic() + (self.timeout_s if wait_s is None else wait_s)
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise WeightSyncError(f"no weight update arrived within {wait_s} s")
            time.sleep(0.02)
        try:
            version, named, _, buf = receive_update(
                self._pg,
                device=self.device or "cpu",
                on_unit=on_unit,
                staging=self._spare,
                deadline=time.monotonic() + self.timeout_s,
            )
        except Exception as e:
            self._pg = None  # the group is in an unknown state: rejoin
            if isinstance(e, WeightSyncError):
                raise
            raise WeightSyncError(f"weight update failed mid-transfer: {e}") from e
        if self.version is not None and version <= self.version:
            raise WeightSyncError(f"got version {version} after {self.version}: not newer")
        self.version = version
        # double buffering: the next update lands in the buffer returned the time before
        # (page-faulting a fresh buffer costs more than the transfer on small machines)
        self._spare, self._latest_buf = self._latest_buf, buf
        return version, named

    def close(self) -> None:
        self._pg = self._pstore = self._store = self._spare = self._latest_buf = None
