"""Sequence packing for the learner's forward pass: a micro-batch's samples laid end to end in a
few rows instead of one right-padded row each.

The rule: samples go first-fit-decreasing into rows as wide as the micro-batch's longest sample;
each sample's ``position_ids`` restart at 0, and a row's unused tail is one more segment of pad
tokens (positions 0..k, never scored). transformers (>= 4.53; 5.19 here) reads a restart of
``position_ids`` with ``attention_mask=None`` as a sequence boundary: ``sdpa`` and ``eager`` get a
block-diagonal causal mask (``masking_utils.find_packed_sequence_indices``), and
``flash_attention_2`` runs the varlen kernel on a single row (``_is_packed_sequence``), so with
flash-attn the rows are joined into one (``forward_rows``). The code path is the same for both;
only the attention implementation differs.

Only the forward is packed. ``add_packed`` keeps the padded ``[B, T]`` tensors (loss mask,
advantages, log-probs) and adds a map ``packed_index[b, t]`` from each padded position to its
place in the packed rows, so the logits selected for response tokens come back in the padded
order and every loss, aggregation and sequence-level rule stays as it is.

Why rows as wide as the longest sample rather than one row: with a dense mask (``sdpa`` on CPU)
attention costs rows × width², and one row of every token would pay (sum of lengths)² — more
than padding for long micro-batches. Rows of the longest width never pay more than padding does.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from services.learner import batching

if TYPE_CHECKING:
    import torch

PACKED_KEYS = ("packed_input_ids", "packed_position_ids", "packed_index")
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")


def pack_rows(lengths: Sequence[int], *, width: int) -> list[list[int]]:
    """First-fit decreasing: indices into ``lengths`` grouped into rows of total length <= width.

    Ties keep the lower index first; inside a row the samples are in ascending index order.
    """
    for i, n in enumerate(lengths):
        if not 0 < n <= width:
            raise ValueError(f"sample {i} has length {n}; packing needs 1 <= length <= {width}")
    rows: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, load in enumerate(loads):
            if load + lengths[i] <= width:
                rows[r].append(i)
                loads[r] += lengths[i]
                break
        else:
            rows.append([i])
            loads.append(lengths[i])
    return [sorted(r) for r in rows]


def add_packed(batch: dict[str, torch.Tensor], *, pad_id: int) -> dict[str, torch.Tensor]:
    """``batch`` (from ``batching.collate``) plus the packed forward's inputs:

    - ``packed_input_ids`` / ``packed_position_ids`` ``[R, W]``: W = the longest sample, R rows;
    - ``packed_index`` ``[B, T]`` long: the flat position (``r * W + w``) of padded token
      ``(b, t)`` in the packed rows, -1 on padding.
    """
    import torch

    lengths = [int(n) for n in batch["attention_mask"].sum(dim=-1).tolist()]
    width = max(lengths)
    rows = pack_rows(lengths, width=width)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    index = torch.full(batch["input_ids"].shape, -1, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for b in row:
            n = lengths[b]
            ids[r, start : start + n] = batch["input_ids"][b, :n]
            pos[r, start : start + n] = torch.arange(n)
            index[b, :n] = r * width + start + torch.arange(n)
            start += n
        pos[r, start:] = torch.arange(width - start)  # the tail: a segment of its own
    return {
        **batch,
        "packed_input_ids": ids,
        "packed_position_ids": pos,
        "packed_index": index,
    }


def packed_of(batch: Mapping[str, Any]) -> dict[str, Any] | None:
    """The packed forward's inputs of a micro-batch, or None when it was collated unpacked."""
    if "packed_index" not in batch:
        return None
    return {k: batch[k] for k in PACKED_KEYS}


def forward_rows(model: Any, packed: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Logits of the packed rows, flattened to ``[R * W, V]`` (the order of ``packed_index``).

    With a varlen attention kernel the rows are joined into one (flash-attn needs batch 1 to read
    the boundaries); the flat order is the same, so ``packed_index`` still holds.
    """
    ids, pos = packed["packed_input_ids"], packed["packed_position_ids"]
    if attention_implementation(model) in VARLEN_ATTENTION:
        ids, pos = ids.reshape(1, -1), pos.reshape(1, -1)
    out = model(input_ids=ids, attention_mask=None, position_ids=pos, use_cache=False)
    return out.logits.reshape(-1, out.logits.shape[-1])


def attention_implementation(model: Any) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "_attn_implementation", None) or "eager")


def varlen_attention_available(device: torch.device) -> bool:
    """flash-attn's varlen kernel can run: a CUDA device and the ``flash_attn`` package."""
    if device.type != "cuda":
        return False

    return importlib.util.find_spec("flash_attn") is not None


def check_packing(model: Any, *, device: torch.device, vocab_size: int, tolerance: float) -> float:
    """Refuse a model that does not honour packed ``position_ids``; returns the largest gap.

        Scores two short random sequences padded (one row each) and packed end to end in one row,
        and compares the next-token log-probs at every real position (the largest per-position mean
    over the vocabulary). A model whose attention ignores
        the boundary lets the second sequence see the first, which moves its log-probs by far more
        than rounding. Run it before sharding (``model._probe_packing``). ``tolerance``:
        about 1e-3 in fp32, 5e-2 in bf16.
    """
    import torch

    gen = torch.Generator().manual_seed(0)
    fields = [
        {"prompt_ids": torch.randint(0, vocab_size, (1,), generator=gen).tolist(),
         "response_ids": torch.randint(0, vocab_size, (n,), generator=gen).tolist()}
        for n in (10, 6)
    ]  # fmt: skip
    mb = add_packed(batching.collate(fields, [0, 1], pad_id=0), pad_id=0)
    mb = {k: v.to(device) for k, v in mb.items()}
    # Rows of width 11: [sequence 0], [sequence 1, 4 pads]; one row keeps packed_index valid.
    for k in ("packed_input_ids", "packed_position_ids"):
        mb[k] = mb[k].reshape(1, -1)
    real = mb["attention_mask"].bool()
    with torch.no_grad():
        out = model(
            input_ids=mb["input_ids"],
            attention_mask=mb["attention_mask"],
            position_ids=mb["position_ids"],
            use_cache=False,
        )
        plain = torch.log_softmax(out.logits[real].float(), dim=-1)
        rows = forward_rows(model, mb)
        joined = torch.log_softmax(rows[mb["packed_index"][real]].float(), dim=-1)
    # per position, the mean over the vocabulary: rounding averages out, a leak does not
    gap = float((plain - joined).abs().mean(dim=-1).max())
    if not gap <= tolerance:
        raise ValueError(
            f"{type(model).__name__} does not honour packed position_ids (attention "
            f"{attention_implementation(model)}): packed and padded log-probs differ by {gap:.3g} "
            f"> {tolerance}. Set learner.pack_sequences = false for this model."
        )
    return gap
