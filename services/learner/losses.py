"""Per-token losses for the learner: the policy loss (PPO-clip, GSPO or CISPO) with off-policy
correction, KL, entropy and aggregation. The behaviour-vs-learner mismatch (statistics and the
MIS / ICEPOP mask) is in ``mismatch.py``.

Tensors are [B, T] and token-aligned: position t holds the quantity for token t of the padded
sequence (see `token_logprobs`), and `mask` is 1 on the response tokens that carry a loss.

Names of the three log-probs of one token, used throughout:
- ``logp``: the policy being optimised (has grad);
- ``old_logp``: the policy the PPO ratio and its clip are anchored to. Plain PPO: the
  behaviour log-probs, or the learner's log-probs recomputed at the start of the cycle. For
  decoupled PPO / TIS it MUST be the recomputed (proximal) log-probs;
- ``behaviour_logp``: the log-probs the generator (vLLM) reported when it sampled the token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, get_args

from common.config.learner import OFF_POLICY_DEFAULTS, IsOverCap, LossAgg, OffPolicy, PolicyLoss

if TYPE_CHECKING:
    import torch

KL_KINDS = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
KL_KINDS["abs"] = "abs"
OFF_POLICY_MODES = get_args(OffPolicy)  # the names are the config's (common/config/learner.py)
LOSS_TYPES = get_args(PolicyLoss)
IS_OVER_CAP = get_args(IsOverCap)
AGG_MODES = get_args(LossAgg)
# exp() of a log-ratio above this overflows float32 soon after; clamping keeps loss finite.
MAX_LOG_RATIO = 20.0
# GSPO's sequence log-ratio is clamped above at 10, as verl does (its loss and gradient there:
# |A|·e^10 and 0 for a negative advantage); no lower clamp (exp of a large negative is 0).
GSPO_MAX_LOG_RATIO = 10.0


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, *, kind: str, clamp: float | None = None
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens; same shape as inputs.

    With d = logp - ref_logp:  k1 = d;  k2 = d^2 / 2;  k3 = exp(-d) + d - 1 (>= 0, low variance;
    -d is clamped to <= 20 so exp stays finite);  abs = |d|. Accepted names: k1/kl, k2/mse,
    k3/low_var_kl, abs. verl's ``full`` (KL over the whole vocabulary) needs full distributions
    and is not supported here. Gradient flows through `logp` (and `ref_logp` if it has one).

    `clamp` (> 0, or None for none) bounds the estimate to [-clamp, clamp]; a token outside the
    bound then has no gradient. verl clamps its ``low_var_kl`` (k3) to [-10, 10]; the unclamped
    value is the true estimator, so Tether clamps only when asked (``learner.kl_clamp``).
    """
    import torch

    if kind not in KL_KINDS:
        raise ValueError(
            f"unknown KL kind {kind!r}; valid ones: {sorted(KL_KINDS)} "
            "(k1=kl, k2=mse, k3=low_var_kl, abs)"
        )
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be > 0 (or None for no clamp), got {clamp}")
    d = logp - ref_logp
    canon = KL_KINDS[kind]
    if canon == "k1":
        kl = d
    elif canon == "k2":
        kl = 0.5 * d * d
    elif canon == "abs":
        kl = d.abs()
    else:
        neg = torch.clamp(-d, max=MAX_LOG_RATIO)
        kl = torch.exp(neg) - neg - 1.0
    return kl if clamp is None else torch.clamp(kl, min=-clamp, max=clamp)


def _masked_stats(x: torch.Tensor, valid: torch.Tensor, prefix: str) -> dict:
    """{prefix_mean, prefix_min, prefix_max} of x over valid entries (NaN when none)."""
    sel = x[valid]
    if sel.numel() == 0:
        sel = x.new_tensor([float("nan")])
    return {f"{prefix}_mean": sel.mean(), f"{prefix}_min": sel.min(), f"{prefix}_max": sel.max()}


def _is_weights(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, *, is_cap: float | None, over_cap: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Behaviour importance weights (no grad) and the bool map of tokens above the cap."""
    import torch

    with torch.no_grad():
        raw = torch.exp(torch.clamp(old_logp - behaviour_logp, max=MAX_LOG_RATIO))
        if is_cap is None:
            return raw, torch.zeros_like(raw, dtype=torch.bool)
        over = raw > is_cap
        if over_cap == "truncate":
            return torch.clamp(raw, max=is_cap), over
        return torch.where(over, torch.zeros_like(raw), raw), over


def _check_policy_args(
    loss_type, off_policy, behaviour_logp, is_cap, is_over_cap, clip_low, clip_high, dual_clip
) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; valid ones: {LOSS_TYPES}")
    if off_policy not in OFF_POLICY_MODES:
        raise ValueError(f"unknown off_policy {off_policy!r}; valid ones: {OFF_POLICY_MODES}")
    if off_policy == "none" and behaviour_logp is not None:
        raise ValueError(
            "behaviour_logp is only used with off_policy='tis' or 'decoupled'; for plain PPO "
            "pass the behaviour log-probs as old_logp (or choose an off-policy correction)"
        )
    if off_policy != "none" and behaviour_logp is None:
        raise ValueError(f"off_policy={off_policy!r} needs behaviour_logp (the generator's)")
    if is_cap is not None and is_cap <= 0:
        raise ValueError(f"is_cap must be > 0 (or None for no cap), got {is_cap}")
    if is_over_cap is not None and is_over_cap not in IS_OVER_CAP:
        raise ValueError(f"unknown is_over_cap {is_over_cap!r}; valid ones: {IS_OVER_CAP}")
    # CISPO may drop its lower bound (clip_low = 1: the weight is only capped above).
    low_ok = clip_low <= 1.0 if loss_type == "cispo" else clip_low < 1.0
    if not (clip_low >= 0.0 and low_ok) or clip_high < 0.0:
        raise ValueError(
            f"need 0 <= clip_low < 1 (<= 1 for cispo) and clip_high >= 0, got "
            f"clip_low={clip_low}, clip_high={clip_high}"
        )
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be a constant > 1 (e.g. 3.0) or None, got {dual_clip}")
    if dual_clip is not None and loss_type != "ppo":
        raise ValueError(f"dual_clip applies to loss_type='ppo' only, not {loss_type!r}")


def policy_loss(
    *,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    behaviour_logp: torch.Tensor | None = None,
    off_policy: str = "none",
    is_cap: float | None = 2.0,
    is_over_cap: str | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    loss_type: str = "ppo",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token policy loss [B, T] (0 where masked) and a stats dict.

    `advantages` is [B] (broadcast over tokens) or [B, T]. Per token, with A the advantage and
    r = exp(logp - old_logp) (old_logp is the anchor, see below):

    ``ppo`` (clipped surrogate):
        L = max(-A * r, -A * clamp(r, 1 - clip_low, 1 + clip_high))
        L = min(L, dual_clip * |A|)          if A < 0 and dual_clip is set (dual-clip PPO)
    ``gspo`` (GSPO, Zheng et al. 2025, in its GSPO-token form): the ratio of a sequence is the
    length-normalised s = exp(mean_t (logp - old_logp)) over its valid tokens, and every token
    of the sequence carries s' = s * exp(logp - sg(logp)) (value s, gradient s * d logp):
        L = max(-A * s', -A * clamp(s', 1 - clip_low, 1 + clip_high))
      so a whole sequence is clipped or not. With loss_agg = seq-mean-token-mean this is the
      paper's objective (and verl's, which always aggregates GSPO that way); the paper's clip
      range is small (clip_low 3e-4, clip_high 4e-4). log s' is clamped above at 10, as verl
      clamps it (`GSPO_MAX_LOG_RATIO`): beyond it the loss is |A|·e^10 with no gradient.
    ``cispo`` (CISPO, MiniMax-M1): a clipped, detached IS weight on a policy gradient through
    every token, so clipped tokens still get a gradient:
        L = -sg(clamp(r, 1 - clip_low, 1 + clip_high)) * A * logp
      clip_low = 1 removes the lower bound (the canonical setting, with clip_high ~ 4).

    Then L = w * L (w = 1 for off_policy="none"). Off-policy corrections (w has no grad):
    - ``none``: old_logp is whatever the caller anchors to (the behaviour log-probs when
      nothing is recomputed).
    - ``decoupled`` (AReaL's decoupled PPO): old_logp is the PROXIMAL policy (learner log-probs
      recomputed at the start of the cycle) and w = min(exp(old_logp - behaviour_logp), is_cap).
    - ``tis`` (truncated importance sampling): the ratio is anchored to old_logp (the learner's
      recomputed log-probs) as in PPO and w = min(exp(old_logp - behaviour_logp), is_cap).
    They differ in what a token whose weight exceeds `is_cap` gets (`is_over_cap`; None = the
    mode's own, ``OFF_POLICY_DEFAULTS``): decoupled drops it (w = 0, "mask"), as AReaL does
    with `behav_imp_weight_cap`, the token staying in the loss denominator as in AReaL; tis
    truncates it (w = is_cap, "truncate"), as the TIS papers do. `is_cap=None` means no cap.
    Log-ratios are clamped to [-20, 20] (GSPO: above at 10) so exp stays finite.

    Stats (python floats over valid tokens; NaN when there are none; `tokens` = their count):
    clip_frac_low and clip_frac_high (ppo and gspo: A < 0 with r < 1 - clip_low, A > 0 with
    r > 1 + clip_high; cispo: the weight is clipped below / above, whatever the sign of A),
    dual_clip_frac, ratio_mean/min/max (gspo: the sequence ratio s on each token), and for
    off-policy modes is_weight_mean/min/max (after cap) and is_over_cap_frac. Merge
    micro-batches' stats with `merge_stats`.
    """
    import torch

    _check_policy_args(
        loss_type, off_policy, behaviour_logp, is_cap, is_over_cap, clip_low, clip_high, dual_clip
    )
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    adv = advantages.detach().to(logp.dtype).expand_as(logp)
    valid = mask.detach().bool()
    old = old_logp.detach()

    dual_active = torch.zeros_like(valid)
    if loss_type == "cispo":
        ratio = torch.exp(torch.clamp(logp.detach() - old, -MAX_LOG_RATIO, MAX_LOG_RATIO))
        loss = -torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv * logp
        sign = None  # the clip acts whatever the advantage's sign
    else:
        if loss_type == "gspo":
            m = valid.to(logp.dtype)
            seq = ((logp.detach() - old) * m).sum(-1) / m.sum(-1).clamp(min=1.0)
            log_ratio = torch.clamp(
                logp - logp.detach() + seq.unsqueeze(-1), max=GSPO_MAX_LOG_RATIO
            )
        else:
            log_ratio = torch.clamp(logp - old, min=-MAX_LOG_RATIO, max=MAX_LOG_RATIO)
        ratio = torch.exp(log_ratio)
        unclipped = -adv * ratio
        clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        loss = torch.maximum(unclipped, clipped)
        if dual_clip is not None:
            cap = dual_clip * adv.abs()
            dual_active = (adv < 0) & (loss > cap)
            loss = torch.where(dual_active, cap, loss)
        sign = adv

    weights = over = None
    if off_policy != "none":
        assert behaviour_logp is not None
        over_cap = is_over_cap or OFF_POLICY_DEFAULTS[off_policy][1]
        weights, over = _is_weights(old, behaviour_logp.detach(), is_cap=is_cap, over_cap=over_cap)
        loss = loss * weights
    loss = torch.where(valid, loss, torch.zeros_like(loss))

    stats = _policy_stats(
        sign,
        ratio.detach(),
        valid,
        dual_active,
        weights,
        over,
        clip_low=clip_low,
        clip_high=clip_high,
    )
    return loss, stats


def _frac(flag: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # Integer true division: 0 / 0 gives NaN, which is what an empty micro-batch reports.
    return (flag & valid).sum() / valid.sum()


def _policy_stats(adv, r, valid, dual_active, weights, over, *, clip_low, clip_high) -> dict:
    """``adv`` None: count clipped ratios whatever the advantage's sign (CISPO)."""
    import torch

    with torch.no_grad():
        neg = valid if adv is None else adv < 0
        pos = valid if adv is None else adv > 0
        vals = {
            "tokens": valid.sum(),
            "clip_frac_low": _frac(neg & (r < 1.0 - clip_low), valid),
            "clip_frac_high": _frac(pos & (r > 1.0 + clip_high), valid),
            "dual_clip_frac": _frac(dual_active, valid),
        }
        vals.update(_masked_stats(r, valid, "ratio"))
        if weights is not None:
            vals.update(_masked_stats(weights, valid, "is_weight"))
            vals["is_over_cap_frac"] = _frac(over, valid)
        # One device-to-host copy for all stats.
        floats = torch.stack([v.to(r.dtype) for v in vals.values()]).tolist()
    return dict(zip(vals, floats, strict=True))


# Fractions computed from summed counts after merging (numerator, denominator).
_COUNT_FRACTIONS = {
    "mismatch_masked_frac": ("mismatch_masked_tokens_count", "mismatch_tokens_count"),
    "mismatch_masked_seq_frac": ("mismatch_masked_seqs_count", "mismatch_seqs_count"),
    # routing replay (services/learner/router_replay.py): tokens the learner routed itself, and
    # routing decisions where its own top-k differed from the replayed (generator's) one
    "router_replay_fallback_frac": ("router_replay_fallback_count", "router_replay_tokens_count"),
    "router_replay_differing_frac": (
        "router_replay_differing_count",
        "router_replay_decisions_count",
    ),
}


def merge_stats(stats: Sequence[dict[str, float]]) -> dict[str, float]:
    """Combine per-micro-batch stats: token-weighted means for *_mean/*_frac, min/max else.

    Keys ending in ``_count`` are summed over every micro-batch (an all-masked one included),
    and the fractions of ``_COUNT_FRACTIONS`` are computed from those sums."""
    live = [s for s in stats if s.get("tokens", 0) > 0]
    counts = {
        k: sum(s.get(k, 0.0) for s in stats) for s in stats for k in s if k.endswith("_count")
    }
    out: dict[str, float] = {"tokens": sum(s["tokens"] for s in live)} if live else {"tokens": 0.0}
    if live:
        total = out["tokens"]
        for key in live[0]:
            if key == "tokens" or key.endswith("_count"):
                continue
            values = [s[key] for s in live]
            if key.endswith("_min"):
                out[key] = min(values)
            elif key.endswith("_max"):
                out[key] = max(values)
            else:
                out[key] = sum(v * s["tokens"] for v, s in zip(values, live, strict=True)) / total
    out.update(counts)
    for key, (num, den) in _COUNT_FRACTIONS.items():
        if den in counts:
            out[key] = counts[num] / counts[den] if counts[den] else float("nan")
    return out


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: H = logsumexp(l) - sum softmax(l) * l.

    Raw, not shifted: entry t is the entropy of the distribution predicting token t + 1. Use
    `token_entropy` for the token-aligned version.
    """
    import torch

    probs = torch.softmax(logits, dim=-1)
    # -inf logits (banned tokens) have probability 0; clamping avoids 0 * -inf = NaN.
    finite = logits.clamp(min=torch.finfo(logits.dtype).min)
    return torch.logsumexp(logits, dim=-1) - (probs * finite).sum(dim=-1)


def _shift_right(x: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Token-aligned log-probs [B, T]: out[:, t] = log p(input_ids[:, t] | tokens < t); out[:, 0] = 0.

    `logits` is the causal LM output [B, T, V] (logits[:, t] predicts token t + 1). Computed as
    gathered logit minus logsumexp, so no [B, T, V] log-softmax is materialised.
    """
    import torch

    target = input_ids[:, 1:].unsqueeze(-1)
    picked = logits[:, :-1].gather(-1, target).squeeze(-1)
    lp = picked - torch.logsumexp(logits[:, :-1], dim=-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Token-aligned entropy [B, T]: out[:, t] = entropy of the distribution that sampled token t."""
    return _shift_right(entropy_from_logits(logits))


def step_denominator(items: Sequence[int] | Sequence[torch.Tensor], *, mode: str) -> int:
    """The denominator of `aggregate_loss` for the local part of one optimizer step.

    `items` is either the response lengths (valid-token counts) of every sequence, or the loss
    masks ([B, T] or [T] tensors) of every micro-batch. token-mean: total valid tokens;
    seq-mean-*: number of sequences with at least one valid token (empty rows, e.g. in a
    zero-weight padding micro-batch, do not count). With several data-parallel ranks, sum the
    local values over ranks (all_reduce SUM) to get the step's `global_denominator`.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid ones: {AGG_MODES}")
    lengths: list[int] = []
    for item in items:
        if isinstance(item, int):
            if item < 0:
                raise ValueError(f"lengths must be >= 0, got {item}")
            lengths.append(item)
        else:
            rows = item.reshape(-1, item.shape[-1]) if item.dim() > 0 else item.reshape(1, 1)
            lengths.extend(int(n) for n in (rows != 0).sum(dim=-1).tolist())
    if mode == "token-mean":
        return sum(lengths)
    return sum(1 for n in lengths if n > 0)


def aggregate_loss(
    token_loss: torch.Tensor, mask: torch.Tensor, *, mode: str, global_denominator: float
) -> torch.Tensor:
    """Scalar loss of one micro-batch, normalised by the WHOLE optimizer step's denominator.

    - ``token-mean``: sum_{i,t} loss[i,t] * m[i,t] / D, D = valid tokens in the step;
    - ``seq-mean-token-sum``: sum_i (sum_t loss[i,t] * m[i,t]) / D, D = sequences in the step;
    - ``seq-mean-token-mean``: sum_i (sum_t loss[i,t] * m[i,t] / sum_t m[i,t]) / D, same D.
    D comes from `step_denominator` (summed over ranks), so the sum over all micro-batches
    of all ranks of these values is the step's loss, and the gradient does not depend on how
    the batch was split. FSDP averages gradients over data-parallel ranks: either multiply
    this loss by the world size or turn the averaging off, else the step is shrunk by it.
    A micro-batch whose mask is all zero contributes exactly 0 (with a graph, for FSDP).
    """

    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid ones: {AGG_MODES}")
    if not global_denominator > 0:
        raise ValueError(
            f"global_denominator must be > 0, got {global_denominator}: the optimizer step has "
            "no valid tokens (compute it with step_denominator over the whole step)"
        )
    m = mask.to(token_loss.dtype)
    masked = token_loss * m
    if mode == "token-mean":
        return masked.sum() / global_denominator
    per_seq = masked.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / m.sum(dim=-1).clamp(min=1.0)
    return per_seq.sum() / global_denominator
