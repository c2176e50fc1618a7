"""xxh3-128 over, for every tensor in name order, ``"<name>|<dtype>|<shape>\\n"`` followed by its
raw bytes: exact (any flipped byte, missing tensor or reordering changes it) and fast (~5 GB/s),
but not a defence against a malicious sender. Every side computes it with ``tensors_checksum``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from common.weights.buckets import tensor_bytes


def hash_tensor(h, name: str, t) -> None:
    h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}\n".encode())
    b = tensor_bytes(t)
    if b.device.type != "cpu":
        b = b.cpu()
    h.update(b.numpy())


def tensors_checksum(named_tensors: Iterable[tuple[str, Any]]) -> str:
    """Checksum of tensors by name order (see module docstring); used by every side."""
    import xxhash

    h = xxhash.xxh3_128()
    for name, t in sorted(named_tensors, key=lambda nt: nt[0]):
        hash_tensor(h, name, t)
    return h.hexdigest()


class StreamHasher:
    """``tensors_checksum`` of the tensors of a layout as their bytes arrive in a staging buffer in
    offset order: ``upto(offset)`` hashes every byte below ``offset`` not yet hashed (alignment
    padding excluded), so hashing overlaps the transfer piece by piece."""

    def __init__(self, layout: dict, staging) -> None:
        import xxhash

        self.h = xxhash.xxh3_128()
        self.tensors, self.staging = layout["tensors"], staging
        self.i = self.pos = 0  # next tensor, and how far into it the hash is

    def upto(self, offset: int) -> None:
        while self.i < len(self.tensors):
            name, dt, shape, off, nbytes = self.tensors[self.i]
            if self.pos == 0:
                if off >= offset and nbytes:
                    return
                self.h.update(f"{name}|{dt}|{shape}\n".encode())
            end = min(off + nbytes, offset)
            if end > off + self.pos:
                b = self.staging[off + self.pos : end]
                self.h.update((b.cpu() if b.device.type != "cpu" else b).numpy())
                self.pos = end - off
            if self.pos < nbytes:
                return
            self.i, self.pos = self.i + 1, 0

    def hexdigest(self) -> str:
        return self.h.hexdigest()


class UnitHasher:
    """``tensors_checksum`` of an update from its unit buffers, unit after unit in order (a
    streamed publish never holds all of them at once)."""

    def __init__(self, layout: dict) -> None:
        import xxhash

        self.h = xxhash.xxh3_128()
        self.layout = layout

    def unit(self, k: int, buf) -> None:
        start, _, first, last = self.layout["units"][k]
        for name, dt, shape, off, nbytes in self.layout["tensors"][first:last]:
            self.h.update(f"{name}|{dt}|{shape}\n".encode())
            b = buf[off - start : off - start + nbytes]
            self.h.update((b.cpu() if b.device.type != "cpu" else b).numpy())

    def digest(self) -> bytes:
        return self.h.digest()
