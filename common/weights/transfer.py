"""One update on the wire, over one link (every step a broadcast from rank 0 = the sending side):
the preamble ``int64[3]`` = (magic, version, header length), the JSON header, the units in pieces
of at most the header's ``chunk`` bytes, and the 16-byte checksum last (so sending overlaps the
sender's hashing). A receiver can relay every tensor it gets to the next member of a chain as it
arrives (``relay``); the next member sees exactly what the learner sent."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from common.weights.checksum import StreamHasher
from common.weights.group import broadcast, finish
from common.weights.layout import MAGIC, WeightSyncError, dtype_of, pieces


def send_update(
    pg, header: bytes, version: int, units: Iterable, digest, deadline: float | None = None,
    cancelled=None, *, device: Any = None,
) -> None:  # fmt: skip
    """Learner side of one update (steps 1-4 of the package docstring). ``units``: the unit
    buffers in order, a list or an iterator that produces each when it is needed (a streamed
    publish, ``common.weights.stream``). ``digest`` is a zero-argument callable returning the
    16-byte checksum; it is called after the units went out. ``device``: where the preamble
    goes (the units' device; default: the first unit's, else host memory)."""
    import torch

    if device is None:
        device = units[0].device if isinstance(units, list) and units else torch.device("cpu")
    meta = torch.tensor([MAGIC, version, len(header)], dtype=torch.int64, device=device)
    hdr = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    chunk = int(json.loads(header).get("chunk", 0))
    for t in (meta, hdr):  # one op in flight: gloo runs queued ops on parallel threads
        finish(pg, broadcast(pg, t), deadline, cancelled)
    for u in units:
        for a, b in pieces(0, u.numel(), chunk):
            finish(pg, broadcast(pg, u[a:b]), deadline, cancelled)
    tail = torch.frombuffer(bytearray(digest()), dtype=torch.uint8).to(device)
    finish(pg, broadcast(pg, tail), deadline, cancelled)


def receive_update(
    pg, *, device: str = "cpu", on_unit=None, staging=None, deadline: float | None = None,
    relay=None, progress=None, cancelled=None,
) -> tuple:  # fmt: skip
    """Generator side of one update: staging buffer (``staging`` is reused if big enough),
    incremental hash, verify, then hand out. Returns (version, named, checksum, staging).
    ``relay(t)`` gets every tensor received, in order, to pass on; ``progress(n)`` is told how
    many pieces have arrived; ``on_unit(k)`` runs after unit k is complete."""
    import torch

    def recv(t):
        finish(pg, broadcast(pg, t), deadline, cancelled)
        if relay is not None:
            relay(t)

    meta = torch.zeros(3, dtype=torch.int64, device=device)
    recv(meta)
    magic, version, hlen = (int(x) for x in meta.cpu())
    if magic != MAGIC or not 0 < hlen < (1 << 30):
        raise WeightSyncError(f"bad update preamble (magic {magic:#x}, header {hlen} bytes)")
    hdr = torch.zeros(hlen, dtype=torch.uint8, device=device)
    recv(hdr)
    layout = json.loads(bytes(hdr.cpu().numpy()))
    if layout.get("version") != version:
        raise WeightSyncError("header version does not match the preamble")
    total = int(layout["total"])
    if staging is None or staging.numel() < total:
        staging = torch.empty(total, dtype=torch.uint8, device=device)
    named = []
    for name, dt, shape, off, nbytes in layout["tensors"]:
        view = staging[off : off + nbytes].view(dtype_of(dt)).reshape(shape)
        named.append((name, view))
    chunk = int(layout.get("chunk", 0))
    plan = [
        (k, a, b) for k, (s, e, _, _) in enumerate(layout["units"]) for a, b in pieces(s, e, chunk)
    ]
    hasher = StreamHasher(layout, staging)
    work: Any = broadcast(pg, staging[plan[0][1] : plan[0][2]]) if plan else None
    for j, (k, a, b) in enumerate(plan):
        finish(pg, work, deadline, cancelled)
        if j + 1 < len(plan):  # hash piece j while piece j+1 arrives
            work = broadcast(pg, staging[plan[j + 1][1] : plan[j + 1][2]])
        if relay is not None:
            relay(staging[a:b])
        hasher.upto(b)
        if progress is not None:
            progress(j + 1)
        if on_unit is not None and (j + 1 == len(plan) or plan[j + 1][0] != k):
            on_unit(k)
    tail = torch.zeros(16, dtype=torch.uint8, device=device)
    recv(tail)
    sent = bytes(tail.cpu().numpy()).hex()
    hasher.upto(total)
    if sent != hasher.hexdigest():
        raise WeightSyncError(
            f"checksum mismatch for version {version}: sent {sent}, received "
            f"{hasher.hexdigest()}; the update was discarded"
        )
    return version, named, sent, staging
