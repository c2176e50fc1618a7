"""One update on the wire, over one link (every step a broadcast from rank 0 = the sending side):
the preamble ``int64[3]`` = (magic, version, header length), the JSON header, then every unit in
pieces of at most the header's ``chunk`` bytes followed by the 16-byte running checksum through
that unit (``common.weights.checksum``), so that the receiver verifies each unit before it hands
it out and the sender's hashing of a unit overlaps the sending of it.

Both sides keep ``WINDOW_OPS`` collectives in flight, so the link never idles while one side
waits for an op to finish (the gap between ops, not the bytes, cost most of the time with one
op in flight). A receiver stages one unit at a time in one reused buffer (``StagingBuffer``)
and can relay every tensor it gets to the next member of a chain as it arrives (``relay``);
the next member sees exactly what the learner sent."""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from common.weights.checksum import UpdateHasher
from common.weights.group import broadcast, finish
from common.weights.layout import MAGIC, WeightSyncError, dtype_of, largest_unit, pieces

WINDOW_OPS = 4  # collectives in flight per link and side
# see StagingBuffer.take: gloo's worker thread lets go of a finished op's tensors a moment after
# the wait returns; on a loaded machine (CI's 2 cores under a parallel suite) it can take tens of
# milliseconds to be scheduled, and a second buffer of a unit's size costs more than the wait
RELEASE_WAIT_S = 0.05


class _InFlight:
    """Collectives posted on one link, finished oldest first once ``window`` are in flight."""

    def __init__(self, pg, deadline: float | None, cancelled, window: int) -> None:
        self.pg, self.deadline, self.cancelled, self.window = pg, deadline, cancelled, window
        self.ops: deque = deque()
        self.busy_s = 0.0  # waiting for the link to finish ops (a sender's: the link's rate)

    def post(self, t) -> None:
        self.ops.append(broadcast(self.pg, t))
        while len(self.ops) > self.window:
            self.oldest()

    def oldest(self) -> None:
        t0 = time.monotonic()
        finish(self.pg, self.ops.popleft(), self.deadline, self.cancelled)
        self.busy_s += time.monotonic() - t0

    def drain(self) -> None:
        while self.ops:
            self.oldest()


def send_update(
    pg, header: bytes, version: int, units: Iterable, digest: Callable[[int], bytes],
    deadline: float | None = None, cancelled=None, *, device: Any = None,
    window: int = WINDOW_OPS,
) -> float:  # fmt: skip
    """Learner side of one update (steps 1-3 of the package docstring). ``units``: the unit
    buffers in order, a list or an iterator that produces each when it is needed (a streamed
    publish, ``common.weights.stream``). ``digest(k)`` returns the 16-byte running checksum
    through unit k; it is called once unit k's pieces are posted. ``device``: where the
    preamble goes (the units' device; default: the first unit's, else host memory).

    Returns the seconds spent waiting for the link to take what was posted, not for the units
    to be produced: the update's bytes over it are the link's rate (``Roster.measured``)."""
    import torch

    if device is None:
        device = units[0].device if isinstance(units, list) and units else torch.device("cpu")
    meta = torch.tensor([MAGIC, version, len(header)], dtype=torch.int64, device=device)
    hdr = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    chunk = int(json.loads(header).get("chunk", 0))
    ops = _InFlight(pg, deadline, cancelled, window)
    ops.post(meta)
    ops.post(hdr)
    for k, u in enumerate(units):
        for a, b in pieces(0, u.numel(), chunk):
            ops.post(u[a:b])
        ops.post(torch.frombuffer(bytearray(digest(k)), dtype=torch.uint8).to(device))
    ops.drain()
    return ops.busy_s


def tensor_at(buf, offset: int, dtype, shape) -> Any:
    """A tensor of ``dtype`` and ``shape`` over the bytes of ``buf`` from ``offset`` (aligned):
    it shares ``buf``'s memory directly, not through a chain of views, so emptying it
    (``set_()``) lets go of that memory at once (a ``view(dtype).reshape`` keeps its
    intermediate view, and so the memory, alive)."""
    import torch

    t = torch.empty(0, dtype=dtype, device=buf.device)
    elem = t.element_size()
    stride: list[int] = []
    size = 1
    for n in reversed(list(shape)):
        stride.insert(0, size)
        size *= int(n)
    return t.set_(buf.untyped_storage(), (buf.storage_offset() + offset) // elem, list(shape),
                  stride)  # fmt: skip


def _holders(t) -> int:
    """How many tensors share ``t``'s memory (``t`` included); a large number when torch does
    not say (then the buffer is never reused)."""
    import torch

    try:
        return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata)) - 1
    except (AttributeError, RuntimeError):  # a private call: absent in another torch
        return 1 << 30


class StagingBuffer:
    """The buffers a receiver stages units in, reused from unit to unit and update to update
    while nothing else holds a view of them. Each is sized at its first use to the update's
    largest unit, so a receiver holds one largest unit (``slots=1``), not the model. A member
    that relays to the next one in a chain takes ``slots=2``: the next unit arrives in one while
    the relay still passes the previous one on from the other, so its link never waits at a
    unit's end for the link below (waiting there cost a chain of 16 units at 200 Mbit/s about
    2 s per publish: ``bench.weights_hosts``). A view kept elsewhere (an update collected
    whole, a relay that fell behind, vLLM's layerwise reload holding a fused layer's first
    parts until its last arrives) keeps a buffer alive: when every slot is held the unit goes
    to a temporary buffer of its own size, and the kept ones are reused once let go."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self._bufs: list[Any] = []
        self.allocations = 0  # buffers made (tests, metrics)

    def _free(self) -> Any:
        return next((b for b in self._bufs if _holders(b) <= 1), None)

    def take(self, nbytes: int, *, reserve: int = 0, slots: int = 1) -> Any:
        import torch

        if len(self._bufs) > slots:  # a relay's second slot, no longer needed: let go of it
            keep = self._free()
            self._bufs = [self._bufs[0] if keep is None else keep]
        buf = self._free()
        if buf is None and len(self._bufs) >= slots:
            # gloo's worker thread lets go of a finished op's tensors a moment after its wait
            # returns: give it that moment before taking a temporary buffer
            until = time.monotonic() + RELEASE_WAIT_S
            while (buf := self._free()) is None and time.monotonic() < until:
                time.sleep(0.0001)
            if buf is None:  # still read elsewhere: a temporary one
                self.allocations += 1
                return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if buf is None or buf.numel() < nbytes:
            if buf is not None:  # let go first: the old one is freed before the new one
                self._bufs = [b for b in self._bufs if b is not buf]
                buf = None
            buf = torch.empty(max(nbytes, reserve), dtype=torch.uint8, device=self.device)
            self.allocations += 1
            self._bufs.append(buf)
        return buf[:nbytes]

    def drop(self) -> None:
        """Never reuse the buffers (an op left behind after a failure may still write to them)."""
        self._bufs = []


class IncomingUpdate:
    """One update arriving over one link: the preamble and the header are received on creation
    (``version``, ``layout``), then ``units()`` receives the units one at a time into
    ``staging``, each verified against the running checksum before it is handed out.

    ``relay(t)`` gets every tensor received, in order, to pass on (then units are staged in two
    slots, ``StagingBuffer``); ``progress(n)`` is told how many pieces have arrived. The
    header's ``deadline_s`` (the learner's allowance for this update, which grows with its
    bytes) extends ``deadline``."""

    def __init__(
        self, pg, *, staging: StagingBuffer, deadline: float | None = None, relay=None,
        progress=None, cancelled=None, window: int = WINDOW_OPS,
    ) -> None:  # fmt: skip
        import torch

        self.pg, self.staging, self.deadline = pg, staging, deadline
        self.relay, self.progress, self.cancelled = relay, progress, cancelled
        self.window = window
        started = time.monotonic()
        device = staging.device
        meta = torch.zeros(3, dtype=torch.int64, device=device)
        self._recv(meta)
        magic, version, hlen = (int(x) for x in meta.cpu())
        if magic != MAGIC or not 0 < hlen < (1 << 30):
            raise WeightSyncError(f"bad update preamble (magic {magic:#x}, header {hlen} bytes)")
        hdr = torch.zeros(hlen, dtype=torch.uint8, device=device)
        self._recv(hdr)
        self.layout: dict = json.loads(bytes(hdr.cpu().numpy()))
        if self.layout.get("version") != version:
            raise WeightSyncError("header version does not match the preamble")
        self.version = version
        self.nbytes = sum(int(t[4]) for t in self.layout["tensors"])
        allowance = float(self.layout.get("deadline_s", 0.0))
        if self.deadline is not None and allowance:
            self.deadline = max(self.deadline, started + allowance)
        self.checksum: str | None = None  # hex, once every unit arrived and matched
        self.current: Any = None  # the bytes of the unit last handed out (TP rank 0 passes them on)
        self._hasher = UpdateHasher(self.layout)

    def _recv(self, t) -> None:
        finish(self.pg, broadcast(self.pg, t), self.deadline, self.cancelled)
        if self.relay is not None:
            self.relay(t)

    def units(self, on_unit=None) -> Iterator[tuple[int, list]]:
        """``(k, [(name, tensor), ...])`` for every unit in order: views into the staging
        buffer, valid until the next unit is asked for (keep a view, and the next unit goes
        to a new buffer). ``on_unit(k)`` runs once unit k is verified, before it is handed out."""
        import torch

        chunk = int(self.layout.get("chunk", 0))
        reserve = largest_unit(self.layout)
        n = 0
        for k, (start, end, first, last) in enumerate(self.layout["units"]):
            self.current = None
            buf = self.staging.take(
                end - start, reserve=reserve, slots=1 if self.relay is None else 2
            )
            plan = pieces(0, end - start, chunk)
            tail = torch.zeros(16, dtype=torch.uint8, device=self.staging.device)
            targets = [buf[a:b] for a, b in plan] + [tail]  # the checksum comes in the window too
            ops = _InFlight(self.pg, self.deadline, self.cancelled, len(targets))
            posted = 0
            for j, t in enumerate(targets):
                while posted < len(targets) and len(ops.ops) < self.window:
                    ops.post(targets[posted])
                    posted += 1
                ops.oldest()  # target j: the next ones are on their way meanwhile
                if self.relay is not None:
                    self.relay(t)
                if t is tail:
                    break
                self._hasher.upto(buf, start, start + plan[j][1])
                n += 1
                if self.progress is not None:
                    self.progress(n)
            del targets, t
            sent, got = bytes(tail.cpu().numpy()).hex(), self._hasher.digest().hex()
            if sent != got:
                raise WeightSyncError(
                    f"checksum mismatch for version {self.version} in unit {k}: sent {sent}, "
                    f"received {got}; the update was discarded from there on"
                )
            named = [
                (name, tensor_at(buf, off - start, dtype_of(dt), shape))
                for name, dt, shape, off, _ in self.layout["tensors"][first:last]
            ]
            self.current = buf
            del buf, ops
            if k + 1 == len(self.layout["units"]):
                self.checksum = sent
            if on_unit is not None:
                on_unit(k)
            yield k, named
            del named
        self.current = None
