"""Per-token losses for the learner: PPO-clip with off-policy correction, KL, entropy,
aggregation, and the behaviour-vs-learner mismatch statistics.

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KL_KINDS = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
KL_KINDS["abs"] = "abs"
OFF_POLICY_MODES = ("none", "tis", "decoupled")
IS_OVER_CAP = ("truncate", "mask")
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
# exp() of a log-ratio above this overflows float32 soon after; clamping keeps loss finite.
_MAX_LOG_RATIO = 20.0


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
        neg = torch.clamp(-d, max=_MAX_LOG_RATIO)
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
        raw = torch.exp(torch.clamp(old_logp - behaviour_logp, max=_MAX_LOG_RATIO))
        if is_cap is None:
            return raw, torch.zeros_like(raw, dtype=torch.bool)
        over = raw > is_cap
        if over_cap == "truncate":
            return torch.clamp(raw, max=is_cap), over
        return torch.where(over, torch.zeros_like(raw), raw), over


def _check_policy_args(
    off_policy, behaviour_logp, is_cap, is_over_cap, clip_low, clip_high, dual_clip
) -> None:
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
    if is_over_cap not in IS_OVER_CAP:
        raise ValueError(f"unknown is_over_cap {is_over_cap!r}; valid ones: {IS_OVER_CAP}")
    if not (0.0 <= clip_low < 1.0) or clip_high < 0.0:
        raise ValueError(
            f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, "
            f"clip_high={clip_high}"
        )
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be a constant > 1 (e.g. 3.0) or None, got {dual_clip}")


def policy_loss(
    *,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    behaviour_logp: torch.Tensor | None = None,
    off_policy: str = "none",
    is_cap: float | None = 2.0,
    is_over_cap: str = "truncate",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token clipped policy-gradient loss [B, T] (0 where masked) and a stats dict.

    `advantages` is [B] (broadcast over tokens) or [B, T]. Per token, with A the advantage:

        ratio = exp(logp - old_logp)                      (the clip's anchor is old_logp)
        L     = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))
        L     = min(L, dual_clip * |A|)      if A < 0 and dual_clip is set (dual-clip PPO)
        L     = w * L                        (w = 1 for off_policy="none")

    Off-policy corrections (w is computed without grad):
    - ``none``: standard PPO; old_logp is whatever the caller anchors to (the behaviour
      log-probs when nothing is recomputed).
    - ``decoupled`` (AReaL's decoupled PPO): old_logp is the PROXIMAL policy (learner log-probs
      recomputed at the start of the cycle) and w = min(exp(old_logp - behaviour_logp), is_cap).
    - ``tis`` (truncated importance sampling): the ratio is anchored to old_logp (the learner's
      recomputed log-probs) as in PPO and w = min(exp(old_logp - behaviour_logp), is_cap).
    The two share one formula; they differ in intent (decoupled: a stale behaviour policy; tis:
    the generator-vs-learner numerical mismatch of the same weights). `is_over_cap="mask"`
    drops tokens whose weight exceeds `is_cap` (w = 0) instead of truncating to it, which is
    what AReaL does with `behav_imp_weight_cap`. `is_cap=None` means no cap.

    Stats (python floats over valid tokens; NaN when there are none; `tokens` = their count):
    clip_frac_low (A < 0, ratio < 1 - clip_low), clip_frac_high (A > 0, ratio > 1 + clip_high),
    dual_clip_frac (the dual clip is the active term), ratio_mean/min/max, and for off-policy
    modes is_weight_mean/min/max (after cap) and is_over_cap_frac. Merge micro-batches'
    stats with `merge_stats`.
    """
    import torch

    _check_policy_args(
        off_policy, behaviour_logp, is_cap, is_over_cap, clip_low, clip_high, dual_clip
    )
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    adv = advantages.detach().to(logp.dtype).expand_as(logp)
    valid = mask.detach().bool()

    log_ratio = torch.clamp(logp - old_logp.detach(), min=-_MAX_LOG_RATIO, max=_MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(valid)
    if dual_clip is not None:
        cap = dual_clip * adv.abs()
        dual_active = (adv < 0) & (loss > cap)
        loss = torch.where(dual_active, cap, loss)

    weights = over = None
    if off_policy != "none":
        assert behaviour_logp is not None
        weights, over = _is_weights(
            old_logp.detach(), behaviour_logp.detach(), is_cap=is_cap, over_cap=is_over_cap
        )
        loss = loss * weights
    loss = torch.where(valid, loss, torch.zeros_like(loss))

    stats = _policy_stats(
        adv,
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
    import torch

    with torch.no_grad():
        vals = {
            "tokens": valid.sum(),
            "clip_frac_low": _frac((adv < 0) & (r < 1.0 - clip_low), valid),
            "clip_frac_high": _frac((adv > 0) & (r > 1.0 + clip_high), valid),
            "dual_clip_frac": _frac(dual_active, valid),
        }
        vals.update(_masked_stats(r, valid, "ratio"))
        if weights is not None:
            vals.update(_masked_stats(weights, valid, "is_weight"))
            vals["is_over_cap_frac"] = _frac(over, valid)
        # One device-to-host copy for all stats.
        floats = torch.stack([v.to(r.dtype) for v in vals.values()]).tolist()
    return dict(zip(vals, floats, strict=True))


def merge_stats(stats: Sequence[dict[str, float]]) -> dict[str, float]:
    """Combine per-micro-batch stats: token-weighted means for *_mean/*_frac, min/max else."""
    live = [s for s in stats if s.get("tokens", 0) > 0]
    if not live:
        return {"tokens": 0.0}
    total = sum(s["tokens"] for s in live)
    out: dict[str, float] = {"tokens": total}
    for key in live[0]:
        if key == "tokens":
            continue
        values = [s[key] for s in live]
        if key.endswith("_min"):
            out[key] = min(values)
        elif key.endswith("_max"):
            out[key] = max(values)
        else:
            out[key] = sum(v * s["tokens"] for v, s in zip(values, live, strict=True)) / total
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
        dc = d.clamp(max=_MAX_LOG_RATIO)
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
