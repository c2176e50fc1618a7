"""Rollout-train mismatch: the behaviour (generator) log-probs against the learner's, as
statistics (``mismatch_stats``) and as a mask that drops tokens or whole sequences whose ratio
strays too far (``mismatch_mask``, MIS / ICEPOP style).

When to use which correction (``learner.off_policy`` and the ``mismatch_mask_*`` settings):
- ``decoupled`` (the default): the data is stale by design (asynchronous generation, several
  optimizer steps per cycle). The clip is anchored to the recomputed proximal policy and the
  behaviour weight min(pi_prox / pi_behav, is_cap) corrects the staleness.
- ``tis``: the generator runs the learner's own weights but its numbers differ (bf16, other
  kernels); the truncated weight removes most of the bias at little variance.
- masking: the weight is not trusted at all for outliers. A truncated weight still trains on a
  token the learner would almost never sample; masking drops it. Use token masking (ICEPOP)
  when a few tokens go wrong (e.g. MoE routing flips), sequence or geometric masking when whole
  responses drift (long generations, a broken engine) - and watch ``mismatch_masked_frac``: a
  rising fraction means the engines disagree more, not that training is healthy.
The mask composes with either correction (it applies before the weight).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.learner.losses import MAX_LOG_RATIO

if TYPE_CHECKING:
    import torch


def mismatch_mask(
    learner_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    token: Sequence[float] | None = None,
    sequence: Sequence[float] | None = None,
    geometric: Sequence[float] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rollout-train mismatch masking: which valid tokens keep their loss (bool [B, T], no grad).

    With rho_t = exp(learner_logp - behaviour_logp), the learner's over the generator's
    probability of the sampled token (log-ratios clamped to [-20, 20]), and each bound a pair
    [low, high] that keeps rho (or the sequence's ratio) in [low, high]:
    - ``token`` (ICEPOP; verl ``token_k1``; OpenRLHF ``icepop``): token t is masked when rho_t
      leaves [low, high];
    - ``sequence`` (sequence-level MIS; verl ``seq_sum_k1``): every token of a sequence is
      masked when its product ratio prod_t rho_t leaves [low, high];
    - ``geometric`` (verl ``seq_mean_k1``; OpenRLHF ``seq-mask-tis``): the same with the
      length-normalised ratio exp(mean_t log rho_t).
    verl's bounds mean something else: its ``"low_high"`` for a ``*_k1`` option tests
    -log rho against [log low, log high], so it keeps rho in [1/high, 1/low] (the same range
    only when low = 1/high); ``tether config import`` turns verl's pair into [1/high, 1/low].
    Criteria combine (a token survives only if every one set keeps it). A masked token is
    zeroed in the loss but stays in the step's denominator (as OpenRLHF does; verl drops it
    from the denominator). Under ``token-mean`` and ``seq-mean-token-sum`` that makes a step
    with masked tokens a smaller step, not a re-weighted one. Under ``seq-mean-token-mean`` a
    sequence is averaged over its own kept tokens, so the kept tokens of a partly masked
    sequence share its whole weight (they are re-weighted); only a fully masked sequence makes
    the step smaller. Rows are sequences: each row of [B, T] holds one response.

    Stats (summed by `merge_stats`): mismatch_masked_tokens_count / mismatch_tokens_count (valid
    tokens masked / valid tokens) and mismatch_masked_seqs_count / mismatch_seqs_count
    (sequences with any masked token / sequences with a valid token).
    """
    import torch

    with torch.no_grad():
        valid = mask.detach().bool()
        d = torch.clamp(
            (learner_logp.detach() - behaviour_logp.detach()).to(torch.float64),
            -MAX_LOG_RATIO,
            MAX_LOG_RATIO,
        )
        d = torch.where(valid, d, torch.zeros_like(d))
        keep = valid.clone()
        n_valid = valid.sum(-1)

        def inside(x: torch.Tensor, bounds: Sequence[float]) -> torch.Tensor:
            low, high = bounds
            if not 0 < low < high:
                raise ValueError(f"mismatch bounds must be 0 < low < high, got {list(bounds)}")
            return (x >= math.log(low)) & (x <= math.log(high))

        if token is not None:
            keep &= inside(d, token)
        if sequence is not None:
            keep &= inside(d.sum(-1), sequence).unsqueeze(-1)
        if geometric is not None:
            mean = d.sum(-1) / n_valid.clamp(min=1)
            keep &= inside(mean, geometric).unsqueeze(-1)
        masked = valid & ~keep
        vals = torch.stack(
            [
                masked.sum(),
                valid.sum(),
                masked.any(-1).sum(),
                (n_valid > 0).sum(),
            ]
        ).tolist()
    names = (
        "mismatch_masked_tokens_count",
        "mismatch_tokens_count",
        "mismatch_masked_seqs_count",
        "mismatch_seqs_count",
    )
    return keep, {k: float(v) for k, v in zip(names, vals, strict=True)}


def mismatch_stats(
    learner_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Training-inference mismatch over valid tokens (no grad), as python floats.

    With d = learner_logp - behaviour_logp (tokens were sampled from the behaviour policy):
    kl_k3_mean = mean(exp(d) - d - 1), an unbiased, non-negative per-token estimate of
    KL(behaviour || learner); kl_k1_mean = mean(-d), the plain estimate of the same KL;
    abs_diff_mean = mean|d|; ratio_mean/min/max of exp(d) = pi_learner / pi_behaviour.
    `tokens` is the count (all stats NaN when it is 0); merge micro-batches with `merge_stats`.
    """
    import torch

    with torch.no_grad():
        valid = mask.detach().bool()
        d = (learner_logp.detach() - behaviour_logp.detach()).to(torch.float64)[valid]
        if d.numel() == 0:
            nan = float("nan")
            return {
                "tokens": 0.0,
                "kl_k3_mean": nan,
                "kl_k1_mean": nan,
                "abs_diff_mean": nan,
                "ratio_mean": nan,
                "ratio_min": nan,
                "ratio_max": nan,
            }
        dc = d.clamp(max=MAX_LOG_RATIO)
        ratio = torch.exp(dc)
        vals = torch.stack(
            [
                d.new_tensor(float(d.numel())),
                (ratio - dc - 1.0).mean(),
                (-d).mean(),
                d.abs().mean(),
                ratio.mean(),
                ratio.min(),
                ratio.max(),
            ]
        )
        names = [
            "tokens",
            "kl_k3_mean",
            "kl_k1_mean",
            "abs_diff_mean",
            "ratio_mean",
            "ratio_min",
            "ratio_max",
        ]
        return dict(zip(names, vals.tolist(), strict=True))
