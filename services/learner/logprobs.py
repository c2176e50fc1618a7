"""Log-probs recomputed at the start of a cycle: the proximal policy's (the weights the cycle
starts from; decoupled PPO and TIS anchor to them) and the frozen reference's (the KL term), for
every response token of the cycle, shared over ranks. ``proximal_is_current`` says when the
training forward's own log-probs are the proximal ones and the pass is skipped."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from services.learner import batching, packing
from services.learner.cycle import Sample
from services.learner.dist import all_reduce, rank_world
from services.learner.model import token_logprobs_and_entropy

if TYPE_CHECKING:
    import torch

    from common.config.learner import LearnerConfig
    from services.learner.settings import TrainingSettings


def micro_batches(ln: LearnerConfig, lengths: Sequence[int]) -> list[list[int]]:
    """The learner's micro-batches (by count or by token budget, ``[learner]``) of samples of
    these lengths: one rule for the training step and the recompute passes."""
    if not lengths:
        return []
    return batching.split_micro_batches(
        lengths,
        micro_batch_size=ln.micro_batch_size,
        max_tokens_per_micro_batch=ln.max_tokens_per_micro_batch,
    )


def collate(
    ln: LearnerConfig, fields: Sequence[Any], indices: Sequence[int], *, pad_id: int, **kw: Any
) -> dict[str, torch.Tensor]:
    """``batching.collate``, plus the packed forward's inputs with ``learner.pack_sequences``:
    one rule for the training step and the recompute passes."""
    batch = batching.collate(fields, indices, pad_id=pad_id, routing_field="routing", **kw)
    return packing.add_packed(batch, pad_id=pad_id) if ln.pack_sequences else batch


def recompute_logprobs(
    model: Any, ts: TrainingSettings, samples: list[Sample], *, pad_id: int, device: torch.device
) -> list[list[float]]:
    """Log-probs of every response token under ``model`` (no grad), for the whole cycle.

    Each rank computes a balanced share; the results meet in one flat buffer summed over ranks,
    so every rank ends with all of them (FSDP needs every rank in every forward pass).
    """
    import torch

    rank, world = rank_world()
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    offsets, total = [], 0
    for s in samples:
        offsets.append(total)
        total += len(s.response_ids)
    mine = batching.balance_across_ranks(lengths, world)[rank]
    local = [[mine[j] for j in mb] for mb in micro_batches(ts.learner, [lengths[i] for i in mine])]
    count = int(all_reduce(torch.tensor([len(local)], device=device), "max").item())
    flat = torch.zeros(max(total, 1), dtype=torch.float64, device=device)
    fields = [{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "routing": s.routing}
              for s in samples]  # fmt: skip
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for mb in batching.pad_micro_batches(local, max(count, 1)):
            batch = {
                k: v.to(device) for k, v in collate(ts.learner, fields, mb, pad_id=pad_id).items()
            }
            logp, _ = token_logprobs_and_entropy(
                model,
                batch["input_ids"],
                batch["attention_mask"],
                batch["loss_mask"],
                position_ids=batch["position_ids"],
                temperature=ts.behaviour_temperature,
                packed=packing.packed_of(batch),
                routing=batch.get("routing"),
            )
            for row, i in enumerate(mb):
                n_p, n_r = len(samples[i].prompt_ids), len(samples[i].response_ids)
                flat[offsets[i] : offsets[i] + n_r] = logp[row, n_p : n_p + n_r].double()
    model.train(was_training)
    replay = getattr(model, "router_replay", None)
    if replay is not None:  # the step record counts the training forwards only
        replay.take_counts()
    flat = all_reduce(flat)
    values = flat.cpu().tolist()
    return [values[o : o + len(s.response_ids)] for o, s in zip(offsets, samples, strict=True)]


def proximal_is_current(ts: TrainingSettings) -> bool:
    """True when the proximal policy of decoupled PPO / TIS is the very policy being trained.

    The proximal log-probs are the learner's, recomputed with the weights a cycle starts with.
    With one optimizer step per cycle and one pass over its data, every sample is trained on by
    exactly those weights, so the training forward's own log-probs (detached) are the proximal
    ones: the separate recompute pass over the whole cycle (a forward of every token, about a
    quarter of a step's compute) is skipped. This is what TRL does with ``num_iterations = 1``.
    """
    return (
        ts.learner.off_policy != "none"
        and ts.train_steps_per_cycle == 1
        and ts.passes_per_cycle == 1
    )
