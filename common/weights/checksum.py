"""The checksum of an update, one of two, named in its header (``"checksum"``):

``xxh3-128`` (host memory, gloo): xxh3-128 over, for every tensor in name order,
``"<name>|<dtype>|<shape>\\n"`` followed by its raw bytes (``tensors_checksum``, which every side
can compute from tensors alone). Exact (any flipped byte, missing tensor or reordering changes
it) and fast (~7 GB/s on this CPU), but not a defence against a malicious sender.

``wsum64`` (GPU memory, NCCL): computed where the bytes are, with no copy to the host: every unit's
byte range as little-endian 64-bit words ``w_g`` (``g`` = the word's index in the update, the
last word zero-padded), ``S = sum(w_g * (2g + 1)) mod 2**64``; the digest is xxh3-128 of the
tensors' ``"<name>|<dtype>|<shape>\\n"`` lines and ``S``. An odd multiplier is invertible mod
2**64, so any one changed word changes ``S``; the word's index in it catches moved bytes. A few
elementwise passes at device bandwidth instead of a device-to-host copy and a host hash of every
byte (at 32B: 65.5 GB at ~7 GB/s = 9 s of one CPU core on the critical path).

Both are running checksums (``UpdateHasher``): the digest after unit k covers units 0..k, and
the wire sends it after each unit so that a receiver verifies every unit before handing it out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import xxhash

from common.weights.buckets import tensor_bytes
from common.weights.layout import WeightSyncError

XXH3 = "xxh3-128"
WSUM = "wsum64"
_WSUM_WORDS = 1 << 24  # words per elementwise pass (bounds the temporaries to 256 MB)


def checksum_for(device: Any) -> str:
    """The checksum computed where the buffers live: on a GPU ``wsum64``, else ``xxh3-128``."""
    return WSUM if str(device).startswith("cuda") else XXH3


def hash_tensor(h, name: str, t) -> None:
    h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}\n".encode())
    b = tensor_bytes(t)
    if b.device.type != "cpu":
        b = b.cpu()
    h.update(b.numpy())


def tensors_checksum(named_tensors: Iterable[tuple[str, Any]]) -> str:
    """Checksum of tensors by name order (``xxh3-128``, see the module docstring)."""
    h = xxhash.xxh3_128()
    for name, t in sorted(named_tensors, key=lambda nt: nt[0]):
        hash_tensor(h, name, t)
    return h.hexdigest()


class UpdateHasher:
    """The running checksum of one update (``layout["checksum"]``, default ``xxh3-128``) as its
    bytes arrive in offset order: ``upto(buf, base, offset)`` takes every byte of the update
    below ``offset`` not yet taken, read from ``buf`` (a uint8 tensor holding the update's bytes
    from offset ``base``); ``digest()`` is the checksum of everything taken so far (16 bytes).
    ``xxh3-128`` hashes piece by piece (so hashing overlaps the transfer) and skips alignment
    padding; ``wsum64`` takes each unit whole when its last byte is in (padding included)."""

    def __init__(self, layout: dict) -> None:
        self.kind = layout.get("checksum", XXH3)
        if self.kind not in (XXH3, WSUM):
            raise WeightSyncError(f"header names unknown checksum {self.kind!r}")
        self.tensors, self.units = layout["tensors"], layout["units"]
        self.h = xxhash.xxh3_128()
        self.i = self.pos = 0  # xxh3: next tensor, and how far into it the hash is
        self.k = 0  # wsum64: next unit
        self.sum = 0
        if self.kind == WSUM:
            for name, dt, shape, _, _ in self.tensors:
                self.h.update(f"{name}|{dt}|{shape}\n".encode())

    def upto(self, buf, base: int, offset: int) -> None:
        if self.kind == WSUM:
            while self.k < len(self.units) and self.units[self.k][1] <= offset:
                start, end = self.units[self.k][:2]
                self.sum = (self.sum + _wsum(buf[start - base : end - base], start)) % (1 << 64)
                self.k += 1
            return
        while self.i < len(self.tensors):
            name, dt, shape, off, nbytes = self.tensors[self.i]
            if self.pos == 0:
                if off >= offset and nbytes:
                    return
                self.h.update(f"{name}|{dt}|{shape}\n".encode())
            end = min(off + nbytes, offset)
            if end > off + self.pos:
                b = buf[off + self.pos - base : end - base]
                self.h.update((b.cpu() if b.device.type != "cpu" else b).numpy())
                self.pos = end - off
            if self.pos < nbytes:
                return
            self.i, self.pos = self.i + 1, 0

    def digest(self) -> bytes:
        if self.kind == WSUM:
            h = self.h.copy()
            h.update(self.sum.to_bytes(8, "little"))
            return h.digest()
        return self.h.digest()


def _wsum(b, start: int) -> int:
    """``sum(w_g * (2g + 1)) mod 2**64`` over the bytes ``b`` of an update from offset ``start``
    (a multiple of 8), on ``b``'s device; one int back to the host."""
    import torch

    n = b.numel()
    if n % 8:
        b = torch.cat([b, torch.zeros(8 - n % 8, dtype=torch.uint8, device=b.device)])
    words = b.view(torch.int64)
    total = torch.zeros((), dtype=torch.int64, device=b.device)
    g0 = start // 8
    for a in range(0, words.numel(), _WSUM_WORDS):
        w = words[a : a + _WSUM_WORDS]
        odd = torch.arange(g0 + a, g0 + a + w.numel(), dtype=torch.int64, device=b.device)
        total += (w * (odd * 2 + 1)).sum()  # int64 arithmetic wraps: mod 2**64
    return int(total.item()) % (1 << 64)
