"""Splitting an optimizer step's samples over data-parallel ranks and micro-batches, and
collating samples into padded tensors.

A "length" is the number of tokens a sample costs in the forward pass (prompt + response).
All functions return sample *indices* into the caller's list, sorted ascending inside each
group, so the caller keeps ownership of the samples.

Typical use on one rank, for one optimizer step:

    ranks = balance_across_ranks(lengths, world_size)             # same on every rank
    mine = ranks[rank]
    mbs = split_micro_batches([lengths[i] for i in mine], max_tokens_per_micro_batch=...)
    n = all_reduce_max(len(mbs))                                  # caller's collective
    mbs = pad_micro_batches(mbs, n)                                # [] = zero-weight pass
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _check_lengths(lengths: Sequence[int]) -> None:
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"sample {i} has negative length {n}")


def _pack_into(lengths: Sequence[int], order: list[int], n_bins: int) -> list[list[int]]:
    """Longest-first into the least-loaded of `n_bins` bins (ties: lowest bin)."""
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    loads = [0] * n_bins
    for i in order:
        b = min(range(n_bins), key=lambda k: (loads[k], len(bins[k]), k))
        bins[b].append(i)
        loads[b] += lengths[i]
    return bins


def _first_fit_count(lengths: Sequence[int], order: list[int], budget: int) -> int:
    loads: list[int] = []
    for i in order:
        for k, load in enumerate(loads):
            if load + lengths[i] <= budget:
                loads[k] += lengths[i]
                break
        else:
            loads.append(lengths[i])
    return len(loads)


def split_micro_batches(
    lengths: Sequence[int],
    *,
    micro_batch_size: int | None = None,
    max_tokens_per_micro_batch: int | None = None,
    min_micro_batches: int = 1,
) -> list[list[int]]:
    """Split samples into micro-batches; returns lists of indices into `lengths`.

    Exactly one of:
    - `micro_batch_size`: consecutive chunks of that many samples (the last may be smaller);
    - `max_tokens_per_micro_batch` (the peers' "dynamic batch size"): every micro-batch's total
      length is <= the budget. The number of micro-batches is the first-fit-decreasing count
      (or `min_micro_batches` if larger); samples are then dealt longest-first to the least-
      loaded micro-batch, so micro-batches carry similar token counts; if that breaks the
      budget, one more micro-batch is tried. A single sample longer than the budget raises
      ValueError (it could only run by breaking the budget the user set for memory).
    Empty input gives no micro-batches. Micro-batches are ordered by their first index.
    """
    _check_lengths(lengths)
    if (micro_batch_size is None) == (max_tokens_per_micro_batch is None):
        raise ValueError(
            "set exactly one of micro_batch_size (samples per micro-batch) and "
            "max_tokens_per_micro_batch (token budget per micro-batch)"
        )
    if min_micro_batches < 1:
        raise ValueError(f"min_micro_batches must be >= 1, got {min_micro_batches}")
    n = len(lengths)
    if n == 0:
        return []
    if micro_batch_size is not None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        return [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]

    budget = max_tokens_per_micro_batch
    assert budget is not None
    if budget < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {budget}")
    longest = max(range(n), key=lambda i: lengths[i])
    if lengths[longest] > budget:
        raise ValueError(
            f"sample {longest} has {lengths[longest]} tokens, more than "
            f"max_tokens_per_micro_batch={budget}: raise max_tokens_per_micro_batch to at least "
            "the longest prompt + response, or filter over-long samples before training"
        )
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    n_bins = min(n, max(min_micro_batches, _first_fit_count(lengths, order, budget)))
    while True:
        bins = _pack_into(lengths, order, n_bins)
        if all(sum(lengths[i] for i in b) <= budget for b in bins) or n_bins >= n:
            break
        n_bins += 1
    bins = [sorted(b) for b in bins if b]
    return sorted(bins, key=lambda b: b[0])


def balance_across_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Assign samples to data-parallel ranks: equal counts, then balanced tokens.

    Every rank gets floor(N / W) or ceil(N / W) samples (exactly N mod W ranks get the extra
    one). Samples are dealt longest-first to the rank with the fewest tokens that still has
    room (ties: fewest samples, then lowest rank). Deterministic, so every rank computes the
    same assignment from the same lengths. With N < W some ranks get nothing; they must still
    run zero-weight passes (see `pad_micro_batches`).
    """
    _check_lengths(lengths)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = len(lengths)
    base, extra = divmod(n, world_size)
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        n_full = sum(1 for r in ranks if len(r) > base)
        open_ranks = [
            k
            for k in range(world_size)
            if len(ranks[k]) < base or (len(ranks[k]) == base and n_full < extra)
        ]
        assert open_ranks, "capacity equals the number of samples, so a rank is always open"
        k = min(open_ranks, key=lambda k: (loads[k], len(ranks[k]), k))
        ranks[k].append(i)
        loads[k] += lengths[i]
    return [sorted(r) for r in ranks]


def common_micro_batch_count(per_rank_counts: Sequence[int]) -> int:
    """The number of forward/backward passes every rank must run: the maximum over ranks.

    FSDP issues collectives (all-gather, reduce-scatter) in every pass, so all ranks must run
    the same number of passes or the step deadlocks. Each rank computes its own count, the
    caller all-reduces it with MAX (or passes all counts here), and ranks with fewer real
    micro-batches run empty, zero-weight ones. At least 1, so every rank joins the step.
    """
    if any(c < 0 for c in per_rank_counts):
        raise ValueError(f"micro-batch counts must be >= 0, got {list(per_rank_counts)}")
    return max([1, *per_rank_counts])


def pad_micro_batches(micro_batches: list[list[int]], count: int) -> list[list[int]]:
    """Append empty micro-batches up to `count` passes.

    An empty micro-batch ([]) means: run one forward/backward on a dummy one-token input whose
    loss mask is all zero (see `collate` with no indices), so its loss is exactly 0 but the
    rank takes part in FSDP's collectives.
    """
    if count < len(micro_batches):
        raise ValueError(
            f"cannot pad {len(micro_batches)} micro-batches down to {count}; count must be the "
            "maximum over ranks (common_micro_batch_count)"
        )
    return [*micro_batches, *([] for _ in range(count - len(micro_batches)))]


def _field(sample: Any, name: str) -> Any:
    if isinstance(sample, Mapping):
        if name not in sample:
            raise ValueError(f"sample has no field {name!r} (has {sorted(sample)})")
        return sample[name]
    if not hasattr(sample, name):
        raise ValueError(f"sample {type(sample).__name__} has no field {name!r}")
    return getattr(sample, name)


def collate(
    samples: Sequence[Any],
    indices: Sequence[int],
    *,
    pad_id: int,
    token_fields: Sequence[str] = (),
    seq_fields: Sequence[str] = (),
    mask_field: str | None = None,
    routing_field: str | None = None,
) -> dict[str, torch.Tensor]:
    """Right-padded tensors for the samples at `indices` (each a mapping or an object with
    `prompt_ids` and `response_ids`, lists of token ids).

    Layout, B = len(indices), L = longest prompt + response among them:
    - input_ids [B, L] long: prompt then response, then `pad_id`;
    - attention_mask [B, L] long: 1 on real tokens;
    - position_ids [B, L] long: 0..len-1 on real tokens, 0 on padding;
    - loss_mask [B, L] float: 1 on response tokens only (token-aligned, like
      `losses.token_logprobs`: position t scores token t); with `mask_field` (a per-response-
      token 0/1 list, e.g. "response_mask"), that field's values on the response positions,
      so an episode's tool and environment tokens carry no loss;
    - each name in `token_fields` (per-response-token float lists, e.g. "behaviour_logp"):
      [B, L] float32 placed on the response positions, 0 elsewhere;
    - each name in `seq_fields` (one number per sample, e.g. "advantage"): [B] float32;
    - `routing` [B, L, layers, top_k] long, with `routing_field` when any sample has one (an
      array of every prompt and response id's experts, `router_replay`): -1 where not recorded.
    No indices gives a dummy batch of one pad token with loss_mask 0 (a zero-weight pass).
    """
    import torch

    if not indices:
        one = torch.zeros(1, 1, dtype=torch.long)
        out = {
            "input_ids": one + pad_id,
            "attention_mask": one + 1,
            "position_ids": one,
            "loss_mask": torch.zeros(1, 1),
        }
        out.update({f: torch.zeros(1, 1) for f in token_fields})
        out.update({f: torch.zeros(1) for f in seq_fields})
        return out
    rows = [
        (list(_field(samples[i], "prompt_ids")), list(_field(samples[i], "response_ids")))
        for i in indices
    ]
    for i, (prompt, _) in zip(indices, rows, strict=True):
        if not prompt:
            raise ValueError(
                f"sample {i} has an empty prompt: its first response token has "
                "nothing to be predicted from"
            )
    width = max(len(p) + len(r) for p, r in rows)
    b = len(rows)
    out = {
        "input_ids": torch.full((b, width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros(b, width, dtype=torch.long),
        "position_ids": torch.zeros(b, width, dtype=torch.long),
        "loss_mask": torch.zeros(b, width),
    }
    out.update({f: torch.zeros(b, width) for f in token_fields})
    for row, (i, (prompt, response)) in enumerate(zip(indices, rows, strict=True)):
        n_p, n = len(prompt), len(prompt) + len(response)
        out["input_ids"][row, :n] = torch.tensor(prompt + response, dtype=torch.long)
        out["attention_mask"][row, :n] = 1
        out["position_ids"][row, :n] = torch.arange(n)
        if mask_field is None:
            out["loss_mask"][row, n_p:n] = 1.0
        else:
            mask = list(_field(samples[i], mask_field))
            if len(mask) != len(response):
                raise ValueError(
                    f"sample {i}: {mask_field!r} has {len(mask)} values for "
                    f"{len(response)} response tokens"
                )
            out["loss_mask"][row, n_p:n] = torch.tensor(mask, dtype=torch.float32)
        for f in token_fields:
            values = list(_field(samples[i], f))
            if len(values) != len(response):
                raise ValueError(
                    f"sample {i}: field {f!r} has {len(values)} values for "
                    f"{len(response)} response tokens"
                )
            out[f][row, n_p:n] = torch.tensor(values, dtype=torch.float32)
    for f in seq_fields:
        out[f] = torch.tensor([float(_field(samples[i], f)) for i in indices])
    if routing_field is not None:
        routes = [_field(samples[i], routing_field) for i in indices]
        given = [r for r in routes if r is not None]
        if given:
            out["routing"] = torch.full((b, width, *given[0].shape[1:]), -1, dtype=torch.long)
            for row, (r, (prompt, response)) in enumerate(zip(routes, rows, strict=True)):
                if r is None:
                    continue
                if len(r) != len(prompt) + len(response):
                    raise ValueError(f"sample {indices[row]}: routing for {len(r)} ids, it has "
                                     f"{len(prompt) + len(response)}")  # fmt: skip
                out["routing"][row, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out
