"""One optimizer step's objective in Tether's terms: this rank's micro-batches of the step, the
step's loss denominator, and the loss callback handed to ``train_step`` (clipped policy loss
anchored to the proximal or behaviour log-probs, + the KL term, − the entropy bonus).

Where things are computed (and where to look for the formulas): a cycle's advantages →
``cycle.py`` (formulas in ``advantages.py``); clipped loss, KL, aggregation → ``losses.py``;
the recomputed proximal and reference log-probs → ``logprobs.py``; micro-batches and rank
balance → ``batching.py``; the staleness rule per step → ``loop.py``
(``common.protocol.staleness``); the optimizer step → ``train_step.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.learner import batching, losses, mismatch, packing
from services.learner.cycle import Sample, as_batch_fields, sampled_tokens
from services.learner.dist import all_reduce, rank_world
from services.learner.logprobs import collate, micro_batches, proximal_is_current
from services.learner.model import token_logprobs_and_entropy

if TYPE_CHECKING:
    import torch

    from common.config.learner import LearnerConfig
    from services.learner.settings import TrainingSettings

TOKEN_FIELDS = ("behaviour_logp", "old_logp", "ref_logp", "advantage")
SEQ_FIELDS = ("weight",)


def rank_micro_batches(
    ln: LearnerConfig,
    samples: list[Sample],
    step_indices: list[int],
    *,
    pad_id: int,
    device: torch.device,
) -> list[dict[str, Any]]:
    """This rank's collated micro-batches for one step, padded to the common count."""
    import torch

    rank, world = rank_world()
    lengths = [len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in step_indices]
    mine = [step_indices[j] for j in batching.balance_across_ranks(lengths, world)[rank]]
    local = micro_batches(
        ln, [len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in mine]
    )
    count = int(all_reduce(torch.tensor([len(local)], device=device), "max").item())
    padded = batching.pad_micro_batches([[mine[j] for j in mb] for mb in local], max(count, 1))
    fields = [as_batch_fields(s) for s in samples]
    return [
        {
            k: v.to(device)
            for k, v in collate(
                ln,
                fields,
                mb,
                pad_id=pad_id,
                token_fields=TOKEN_FIELDS,
                seq_fields=SEQ_FIELDS,
                mask_field="response_mask",
            ).items()
        }
        for mb in padded
    ]


def step_denominator(ln: LearnerConfig, samples: list[Sample], step_indices: list[int]) -> float:
    """The whole step's loss denominator (all ranks): sampled tokens (an episode's tool and
    environment tokens are not counted) or sequences with weight > 0."""
    # Every rank holds the whole step's samples, so this is already the global value: no
    # collective.
    lengths = [sampled_tokens(samples[i]) for i in step_indices if samples[i].weight > 0]
    return float(max(losses.step_denominator(lengths, mode=ln.loss_agg), 1))


def make_loss_fn(
    ts: TrainingSettings,
    *,
    denominator: float,
    stats_out: list[dict[str, float]],
    proximal_from_forward: bool | None = None,
):
    """The per-micro-batch loss: policy loss (``learner.policy_loss``; + KL term, − entropy
    bonus) over the tokens the mismatch mask keeps, aggregated over the WHOLE step's
    ``denominator`` so micro-batch losses simply add up (masked tokens stay in it).

    ``proximal_from_forward`` (default: ``proximal_is_current(ts)``): anchor the ratio to this
    forward pass's own log-probs, detached, instead of the micro-batch's recomputed ``old_logp``."""

    ln = ts.learner
    want_entropy = ln.entropy_coef != 0
    masking = any(
        b is not None
        for b in (ln.mismatch_mask_token, ln.mismatch_mask_sequence, ln.mismatch_mask_geometric)
    )
    if proximal_from_forward is None:
        proximal_from_forward = proximal_is_current(ts)

    def loss_fn(model: Any, mb: dict[str, torch.Tensor]):
        mask = mb["loss_mask"] * mb["weight"].unsqueeze(-1)
        logp, entropy = token_logprobs_and_entropy(
            model,
            mb["input_ids"],
            mb["attention_mask"],
            mb["loss_mask"],
            position_ids=mb["position_ids"],
            with_entropy=want_entropy,
            temperature=ts.behaviour_temperature,
            packed=packing.packed_of(mb),
            routing=mb.get("routing"),
        )
        off = ln.off_policy
        if off == "none":
            anchor = mb["behaviour_logp"]
        else:
            anchor = logp.detach() if proximal_from_forward else mb["old_logp"]
        raw_mismatch = mismatch.mismatch_stats(logp, mb["behaviour_logp"], mask)
        if masking:
            # the learner's side of the ratio: the proximal policy, or this forward's own
            # log-probs when the ratio is anchored to the behaviour policy (off_policy none)
            keep, mask_counts = mismatch.mismatch_mask(
                logp.detach() if off == "none" else anchor,
                mb["behaviour_logp"],
                mask,
                token=ln.mismatch_mask_token,
                sequence=ln.mismatch_mask_sequence,
                geometric=ln.mismatch_mask_geometric,
            )
            mask = mask * keep.to(mask.dtype)
        token_loss, stats = losses.policy_loss(
            loss_type=ln.policy_loss,
            logp=logp,
            old_logp=anchor,
            advantages=mb["advantage"],
            mask=mask,
            behaviour_logp=mb["behaviour_logp"] if off != "none" else None,
            off_policy=off,
            is_cap=ln.is_cap,
            is_over_cap=ln.is_over_cap,
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
        stats.update({f"mismatch_{k}": v for k, v in raw_mismatch.items() if k != "tokens"})
        replay = getattr(model, "router_replay", None)
        if replay is not None:
            stats.update(replay.take_counts().as_stats())
        if masking:
            stats.update(mask_counts)
        stats_out.append(stats)
        return losses.aggregate_loss(
            token_loss, mask, mode=ln.loss_agg, global_denominator=denominator
        )

    return loss_fn
