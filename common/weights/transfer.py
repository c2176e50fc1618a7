"""One update on the wire, per member (every step a broadcast from rank 0 = learner): the
preamble ``int64[3]`` = (magic, version, header length), the JSON header, the units, and the
16-byte checksum last (so sending overlaps the sender's hashing)."""

from __future__ import annotations

import json
from typing import Any

from common.weights.checksum import hash_tensor
from common.weights.group import broadcast, finish
from common.weights.layout import MAGIC, WeightSyncError, dtype_of


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
        view = staging[off : off + nbytes].view(dtype_of(dt)).reshape(shape)
        named.append((name, view))
    units = layout["units"]
    h = xxhash.xxh3_128()
    work: Any = broadcast(pg, staging[units[0][0] : units[0][1]]) if units else None
    for k, (_, _, first, last) in enumerate(units):
        finish(pg, work, deadline)
        if k + 1 < len(units):  # hash unit k while unit k+1 arrives
            work = broadcast(pg, staging[units[k + 1][0] : units[k + 1][1]])
        for name, t in named[first:last]:
            hash_tensor(h, name, t)
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
