"""The policy-optimisation step in Tether's terms: advantages for a cycle, the proximal and
reference log-probs recomputed at the start of the cycle, the staleness rule per step, and the
loss callback handed to ``train_step``.

Where things are computed (and where to look for the formulas):
advantages → ``advantages.py``; clipped loss, KL, aggregation → ``losses.py``;
micro-batches and rank balance → ``batching.py``; the optimizer step → ``train_step.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from services.learner import advantages as adv_mod
from services.learner import batching, losses
from services.learner.cycle import Sample, as_batch_fields

if TYPE_CHECKING:
    import torch

    from common.config.schema import TetherConfig

log = logging.getLogger(__name__)

TOKEN_FIELDS = ("behaviour_logp", "old_logp", "ref_logp", "advantage")
SEQ_FIELDS = ("weight",)


def _dist_info() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


def assign_advantages(samples: list[Sample], cfg: TetherConfig) -> int:
    """Every response token's advantage; zero-weight the groups filtered out. Returns #filtered.

    Sequence-level estimators give all tokens of a response its one advantage. With
    ``learner.kl_in_reward`` the KL penalty is folded into per-token rewards first
    (``advantages.kl_reward_advantages``, see ``reward_kl``): the reference log-probs must have
    been recomputed for this cycle before this is called.
    """
    import torch

    ln = cfg.learner
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    unbiased = ln.std_estimator == "unbiased"
    if ln.kl_in_reward:
        kl, mask = reward_kl(samples, cfg)
        adv = adv_mod.kl_reward_advantages(
            rewards,
            groups,
            kl,
            mask,
            estimator=ln.advantage_estimator,
            kl_coef=ln.kl_coef,
            norm_by_std=ln.norm_adv_by_std,
            unbiased_std=unbiased,
        )
        for i, s in enumerate(samples):
            s.advantages = adv[i, : len(s.response_ids)].tolist()
    else:
        seq = adv_mod.compute_advantages(
            rewards,
            groups,
            estimator=ln.advantage_estimator,
            norm_by_std=ln.norm_adv_by_std,
            unbiased_std=unbiased,
        )
        for s, a in zip(samples, seq.tolist(), strict=True):
            s.advantages = [float(a)] * len(s.response_ids)
    n_filtered = 0
    if ln.filter_equal_reward_groups:
        keep, n_filtered = adv_mod.equal_reward_group_mask(rewards, groups)
        for s, k in zip(samples, keep.tolist(), strict=True):
            if not k:
                s.weight = 0.0
    return n_filtered


def reward_kl(samples: list[Sample], cfg: TetherConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The KL penalty's per-token estimate [N, T] and the response mask [N, T] (float64).

    The estimate is ``learner.kl_type`` (clamped by ``learner.kl_clamp``) of the behaviour
    log-probs against the reference log-probs: KL(π_behaviour ‖ π_ref) at the tokens the
    generator sampled. The behaviour policy is the one that drew them, so the sample average is an
    estimate of that KL; it is also the only log-prob of that policy a stale trajectory still has
    (the learner has moved on). verl's ``old_log_probs`` are the same quantity in its synchronous
    loop, recomputed by its trainer; Tether's come from vLLM, so the engine mismatch (the
    ``mismatch_*`` metrics) adds a little noise to the penalty.
    """
    import torch

    ln = cfg.learner
    width = max((len(s.response_ids) for s in samples), default=0)
    behaviour = torch.zeros(len(samples), width, dtype=torch.float64)
    ref = torch.zeros_like(behaviour)
    mask = torch.zeros_like(behaviour)
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        assert len(s.ref_logp) == n, "reference log-probs are recomputed before the advantages"
        behaviour[i, :n] = torch.tensor(s.behaviour_logp, dtype=torch.float64)
        ref[i, :n] = torch.tensor(s.ref_logp, dtype=torch.float64)
        mask[i, :n] = 1.0
    kl = losses.kl_penalty(behaviour, ref, kind=ln.kl_type, clamp=ln.kl_clamp) * mask
    return kl, mask


def _micro_batches(cfg: TetherConfig, lengths: Sequence[int]) -> list[list[int]]:
    ln = cfg.learner
    if not lengths:
        return []
    return batching.split_micro_batches(
        lengths,
        micro_batch_size=ln.micro_batch_size,
        max_tokens_per_micro_batch=ln.max_tokens_per_micro_batch,
    )


def rank_micro_batches(
    cfg: TetherConfig,
    samples: list[Sample],
    step_indices: list[int],
    *,
    pad_id: int,
    device: torch.device,
) -> list[dict[str, Any]]:
    """This rank's collated micro-batches for one step, padded to the common count."""
    import torch

    rank, world = _dist_info()
    lengths = [len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in step_indices]
    mine = [step_indices[j] for j in batching.balance_across_ranks(lengths, world)[rank]]
    local = _micro_batches(
        cfg, [len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in mine]
    )
    count = int(_all_reduce(torch.tensor([len(local)], device=device), "max").item())
    padded = batching.pad_micro_batches([[mine[j] for j in mb] for mb in local], max(count, 1))
    fields = [as_batch_fields(s) for s in samples]
    return [
        {
            k: v.to(device)
            for k, v in batching.collate(
                fields, mb, pad_id=pad_id, token_fields=TOKEN_FIELDS, seq_fields=SEQ_FIELDS
            ).items()
        }
        for mb in padded
    ]


def step_denominator(
    cfg: TetherConfig, samples: list[Sample], step_indices: list[int], device: torch.device
) -> float:
    """The whole step's loss denominator (all ranks): tokens or sequences with weight > 0."""
    # Every rank holds the whole step's samples, so this is already the global value: no
    # collective. (``device`` is unused; the callers' signature is kept.)
    lengths = [len(samples[i].response_ids) for i in step_indices if samples[i].weight > 0]
    return float(max(losses.step_denominator(lengths, mode=cfg.learner.loss_agg), 1))


def recompute_logprobs(
    model: Any, cfg: TetherConfig, samples: list[Sample], *, pad_id: int, device: torch.device
) -> list[list[float]]:
    """Log-probs of every response token under ``model`` (no grad), for the whole cycle.

    Each rank computes a balanced share; the results meet in one flat buffer summed over ranks,
    so every rank ends with all of them (FSDP needs every rank in every forward pass).
    """
    import torch

    from services.learner.model import token_logprobs_and_entropy

    rank, world = _dist_info()
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    offsets, total = [], 0
    for s in samples:
        offsets.append(total)
        total += len(s.response_ids)
    mine = batching.balance_across_ranks(lengths, world)[rank]
    local = [[mine[j] for j in mb] for mb in _micro_batches(cfg, [lengths[i] for i in mine])]
    count = int(_all_reduce(torch.tensor([len(local)], device=device), "max").item())
    flat = torch.zeros(max(total, 1), dtype=torch.float64, device=device)
    fields = [{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids} for s in samples]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for mb in batching.pad_micro_batches(local, max(count, 1)):
            batch = {
                k: v.to(device) for k, v in batching.collate(fields, mb, pad_id=pad_id).items()
            }
            logp, _ = token_logprobs_and_entropy(
                model,
                batch["input_ids"],
                batch["attention_mask"],
                batch["loss_mask"],
                position_ids=batch["position_ids"],
                temperature=cfg.behaviour_temperature,
            )
            for row, i in enumerate(mb):
                n_p, n_r = len(samples[i].prompt_ids), len(samples[i].response_ids)
                flat[offsets[i] : offsets[i] + n_r] = logp[row, n_p : n_p + n_r].double()
    model.train(was_training)
    flat = _all_reduce(flat)
    values = flat.cpu().tolist()
    return [values[o : o + len(s.response_ids)] for o, s in zip(offsets, samples, strict=True)]


def proximal_is_current(cfg: TetherConfig) -> bool:
    """True when the proximal policy of decoupled PPO / TIS is the very policy being trained.

    The proximal log-probs are the learner's, recomputed with the weights a cycle starts with.
    With one optimizer step per cycle and one pass over its data, every sample is trained on by
    exactly those weights, so the training forward's own log-probs (detached) are the proximal
    ones: the separate recompute pass over the whole cycle (a forward of every token, about a
    quarter of a step's compute) is skipped. This is what TRL does with ``num_iterations = 1``.
    """
    return (
        cfg.learner.off_policy != "none"
        and cfg.run.train_steps_per_cycle == 1
        and cfg.run.passes_per_cycle == 1
    )


def make_loss_fn(
    cfg: TetherConfig,
    *,
    denominator: float,
    stats_out: list[dict[str, float]],
    proximal_from_forward: bool | None = None,
):
    """The per-micro-batch loss: clipped policy loss (+ KL term, − entropy bonus), aggregated
    over the WHOLE step's ``denominator`` so micro-batch losses simply add up.

    ``proximal_from_forward`` (default: ``proximal_is_current(cfg)``): anchor the ratio to this
    forward pass's own log-probs, detached, instead of the micro-batch's recomputed ``old_logp``."""

    from services.learner.model import token_logprobs_and_entropy

    ln = cfg.learner
    want_entropy = ln.entropy_coef != 0
    if proximal_from_forward is None:
        proximal_from_forward = proximal_is_current(cfg)

    def loss_fn(model: Any, mb: dict[str, torch.Tensor]):
        mask = mb["loss_mask"] * mb["weight"].unsqueeze(-1)
        logp, entropy = token_logprobs_and_entropy(
            model,
            mb["input_ids"],
            mb["attention_mask"],
            mb["loss_mask"],
            position_ids=mb["position_ids"],
            with_entropy=want_entropy,
            temperature=cfg.behaviour_temperature,
        )
        off = ln.off_policy
        if off == "none":
            anchor = mb["behaviour_logp"]
        else:
            anchor = logp.detach() if proximal_from_forward else mb["old_logp"]
        token_loss, stats = losses.policy_loss(
            logp=logp,
            old_logp=anchor,
            advantages=mb["advantage"],
            mask=mask,
            behaviour_logp=mb["behaviour_logp"] if off != "none" else None,
            off_policy=off,
            is_cap=ln.is_cap,
            clip_low=ln.clip_low,
            clip_high=ln.clip_high,
            dual_clip=ln.dual_clip,
        )
        if ln.kl_coef > 0:
            # In the reward the penalty is already in the advantages: here only its metric.
            kl = losses.kl_penalty(
                logp if not ln.kl_in_reward else logp.detach(),
                mb["ref_logp"],
                kind=ln.kl_type,
                clamp=ln.kl_clamp,
            )
            if not ln.kl_in_reward:
                token_loss = token_loss + ln.kl_coef * kl
            stats["kl_ref_mean"] = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
        if want_entropy:
            assert entropy is not None
            token_loss = token_loss - ln.entropy_coef * entropy
            stats["entropy_mean"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
        stats.update(
            {
                f"mismatch_{k}": v
                for k, v in losses.mismatch_stats(logp, mb["behaviour_logp"], mask).items()
                if k != "tokens"
            }
        )
        stats_out.append(stats)
        return losses.aggregate_loss(
            token_loss, mask, mode=ln.loss_agg, global_denominator=denominator
        )

    return loss_fn
