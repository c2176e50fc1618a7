"""The layout of one update: the JSON header naming every tensor (sorted), its dtype, shape and
byte offset in a flat staging buffer (64-byte aligned), and the units it is sent in."""

from __future__ import annotations

from typing import Any

MAGIC = 0x7E7E_0001
ALIGN = 64


class WeightSyncError(RuntimeError):
    """A weight update failed; the receiver keeps its previous complete version."""


def dtype_of(name: str):
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise WeightSyncError(f"header names unknown dtype {name!r}")
    return dt


def build_layout(
    named: list[tuple[str, Any]], version: int, bucket_bytes: int, chunk_bytes: int = 0
) -> dict:
    """The JSON header for a sorted list of tensors: offsets, units, total bytes, and the chunk:
    each unit goes on the wire in pieces of at most ``chunk`` bytes (0 = whole units), so that a
    relay can pass a piece on while the next one arrives."""
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
    return {"version": version, "tensors": tensors, "units": unit_ranges, "total": off,
            "chunk": chunk_bytes}  # fmt: skip


def pieces(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """The byte ranges ``[start, end)`` is sent in: pieces of at most ``chunk`` (0 = one piece)."""
    if chunk <= 0 or end - start <= chunk:
        return [(start, end)]
    return [(a, min(a + chunk, end)) for a in range(start, end, chunk)]
