"""Gathering the sharded model's whole weights (Hugging Face names) onto rank 0, one unit or one
tensor at a time: a weight publish (``stream_publish``: rank 0 holds a window of buckets, never
the model), an export (``whole_tensors``). Every function here is a collective under FSDP:
every rank calls it, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from services.learner.dist import broadcast_int, rank_world

if TYPE_CHECKING:
    import torch


def full_state_dict_cpu(
    model: torch.nn.Module, *, drop_tied: bool = True, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """The whole (unsharded) weights with Hugging Face names, on CPU, on rank 0 (``{}``
    elsewhere): the whole model in rank 0's memory, for tests, benchmarks and small models (the
    learner itself publishes and exports unit by unit: ``stream_publish``, ``whole_tensors``).

    A collective under FSDP: every rank must call it. Tensors are gathered one at a time on the
    device, cast to ``dtype`` when given, and copied to CPU on rank 0. With ``drop_tied`` the
    ``lm_head.weight`` of a tied-embedding model is left out (HF and vLLM loaders re-tie it).
    """
    from torch.distributed.tensor import DTensor

    rank0 = rank_world()[0] == 0
    tied = drop_tied and getattr(model.config, "tie_word_embeddings", False)
    state: dict[str, Any] = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        t = tensor.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()  # all-gather: every rank takes part, only rank 0 keeps it
        if rank0:
            state[name] = t.to(_out_dtype(t, dtype)).to("cpu", copy=True)
    return state


def publish_items(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """The tensors a weight publish sends, by name (sorted): the state dict without a tied
    ``lm_head.weight`` (HF and vLLM loaders re-tie it)."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    items = [(n, t) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")]
    return sorted(items, key=lambda nt: nt[0])


def publish_specs(items: list[tuple[str, Any]], dtype: torch.dtype | None) -> list[tuple[str, Any]]:
    """Meta tensors of each published tensor's dtype and whole shape (no data)."""
    import torch

    return [(n, torch.empty(t.shape, dtype=_out_dtype(t, dtype), device="meta")) for n, t in items]


def _out_dtype(t: Any, dtype: Any) -> Any:
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def stream_units(
    items: list[tuple[str, Any]],
    layout: dict,
    *,
    dtype: torch.dtype | None,
    rank0: bool,
    device: torch.device | None = None,
) -> Iterator[tuple[int, list[Any]]]:
    """Every rank: each unit of ``layout`` gathered in turn, ``(k, its whole tensors)`` on rank
    0 (``(k, [])`` elsewhere). A collective per tensor under FSDP; at most one unit's tensors
    exist at a time here (the caller sends them before asking for the next). ``device``: where
    the gather runs; a shard held elsewhere (``learner.cpu_offload``: in host memory) is moved
    there first, so that the all-gather runs on the device's backend (NCCL), not on gloo."""
    from torch.distributed.tensor import DTensor

    for k, (_, _, first, last) in enumerate(layout["units"]):
        tensors = []
        for _, tensor in items[first:last]:
            # cast the shard first: the gather moves (and rank 0 holds) the published dtype
            t = tensor.detach().to(device=device, dtype=_out_dtype(tensor, dtype))
            if isinstance(t, DTensor):
                t = t.full_tensor()  # all-gather: every rank takes part, only rank 0 keeps it
            if rank0:
                tensors.append(t)
        yield k, tensors


def stream_publish(
    items: list[tuple[str, Any]],
    *,
    layout: dict,
    dtype: torch.dtype | None,
    session: Any,
    device: torch.device,
) -> None:
    """Every rank: make each pass the publish asks for (``session``, a
    ``common.weights.publisher.StreamedPublish`` on rank 0, ``None`` elsewhere): rank 0 says
    whether there is one, then every rank gathers the units in turn and rank 0 hands each to
    the session, which sends it while the next is gathered. ``items``: ``publish_items`` of
    the model; ``layout``: the update's (the same on every rank: ``build_layout`` of
    ``publish_specs``)."""
    rank0 = rank_world()[0] == 0
    while True:
        feed = session.next_pass() if session is not None else None
        if not broadcast_int(int(feed is not None), device):
            return
        for k, tensors in stream_units(items, layout, dtype=dtype, rank0=rank0, device=device):
            if session is not None:
                session.put(feed, k, tensors)


def whole_tensors(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """Every rank: each state-dict tensor whole, in name order, one at a time: ``(name,
    tensor)`` on rank 0 (fp32 master weights, on CPU), ``(name, None)`` elsewhere. What an
    export of the live model writes (a tied ``lm_head.weight`` included)."""
    from torch.distributed.tensor import DTensor

    rank0 = rank_world()[0] == 0
    for name, tensor in sorted(model.state_dict().items(), key=lambda nt: nt[0]):
        t = tensor.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        yield name, t.to("cpu", copy=True) if rank0 else None
