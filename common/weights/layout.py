"""The layout of one update: the JSON header naming every tensor (sorted), its dtype, shape and
byte offset in the update's byte range (64-byte aligned), and the units it is sent in.

A unit is either one tensor of at least ``ALONE_BYTES`` (sent from its own memory, never copied)
or a run of consecutive smaller tensors of at most a bucket (packed once into one buffer). A
receiver stages one unit at a time, so the largest unit bounds what it holds besides the model:
``max(bucket, largest tensor)``. The rule depends on the bucket and the tensors only, so every
learner rank derives the same units from the same specs."""

from __future__ import annotations

from typing import Any

MAGIC = 0x7E7E_0002  # 2: a running checksum after every unit (1: one checksum at the end)
ALIGN = 64
ALONE_BYTES = 1 << 20  # a tensor at least this big is a unit of its own: sent without a copy


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
        alone = nbytes >= min(ALONE_BYTES, bucket_bytes)
        if cur and (alone or off + nbytes - tensors[cur[0]][3] > bucket_bytes):
            units.append(cur)
            cur = []
        cur.append(i)
        if alone:
            units.append(cur)
            cur = []
        off += -(-nbytes // ALIGN) * ALIGN
    if cur:
        units.append(cur)
    unit_ranges = [
        [tensors[u[0]][3], tensors[u[-1]][3] + tensors[u[-1]][4], u[0], u[-1] + 1] for u in units
    ]
    return {"version": version, "tensors": tensors, "units": unit_ranges, "total": off,
            "chunk": chunk_bytes}  # fmt: skip


def largest_unit(layout: dict) -> int:
    """The bytes of the largest unit: what a receiver stages at a time."""
    return max((end - start for start, end, _, _ in layout["units"]), default=0)


def pieces(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """The byte ranges ``[start, end)`` is sent in: pieces of at most ``chunk`` (0 = one piece)."""
    if chunk <= 0 or end - start <= chunk:
        return [(start, end)]
    return [(a, min(a + chunk, end)) for a in range(start, end, chunk)]
