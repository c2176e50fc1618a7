"""Losses against numbers derived by hand (arithmetic in the comments)."""

import math

import pytest
import torch  # noqa: TID253 - tests of torch code

from services.learner.losses import (
    aggregate_loss,
    entropy_from_logits,
    kl_penalty,
    merge_stats,
    policy_loss,
    step_denominator,
    token_entropy,
    token_logprobs,
)
from services.learner.mismatch import mismatch_stats

LN2 = math.log(2.0)


def lp(*probs):
    """Log-probs [1, T] from probabilities, float64 so hand values compare tightly."""
    return torch.tensor([probs], dtype=torch.float64).log()


def test_kl_penalty_kinds_and_aliases():
    logp, ref = lp(0.5, 0.25), lp(0.25, 0.5)  # d = logp - ref = +ln2, -ln2
    torch.testing.assert_close(
        kl_penalty(logp, ref, kind="k1"), torch.tensor([[LN2, -LN2]], dtype=torch.float64)
    )
    # k2 = d^2 / 2 = ln2^2 / 2 for both signs
    want_k2 = torch.tensor([[LN2**2 / 2, LN2**2 / 2]], dtype=torch.float64)
    torch.testing.assert_close(kl_penalty(logp, ref, kind="k2"), want_k2)
    torch.testing.assert_close(kl_penalty(logp, ref, kind="mse"), want_k2)
    # k3 = exp(-d) + d - 1:  d = ln2 -> 0.5 + ln2 - 1;  d = -ln2 -> 2 - ln2 - 1
    want_k3 = torch.tensor([[LN2 - 0.5, 1 - LN2]], dtype=torch.float64)
    torch.testing.assert_close(kl_penalty(logp, ref, kind="k3"), want_k3)
    torch.testing.assert_close(kl_penalty(logp, ref, kind="low_var_kl"), want_k3)
    torch.testing.assert_close(kl_penalty(logp, ref, kind="kl"), kl_penalty(logp, ref, kind="k1"))
    torch.testing.assert_close(
        kl_penalty(logp, ref, kind="abs"), torch.tensor([[LN2, LN2]], dtype=torch.float64)
    )
    for bad in ("full", "k4"):
        with pytest.raises(ValueError, match="low_var_kl"):
            kl_penalty(logp, ref, kind=bad)


def test_kl_clamp_bounds_the_estimate_and_stops_its_gradient_outside():
    # k3 of d = -15: exp(15) - 15 - 1 = 3.3e6, clamped to 10 (verl's low_var_kl bound); d = +ln2
    # gives ln2 - 0.5 = 0.19, inside the bound and unchanged
    logp = torch.tensor([[-15.0, LN2]], dtype=torch.float64, requires_grad=True)
    ref = torch.zeros(1, 2, dtype=torch.float64)
    assert float(kl_penalty(logp.detach(), ref, kind="k3")[0, 0]) == pytest.approx(
        math.exp(15) - 16
    )
    clamped = kl_penalty(logp, ref, kind="low_var_kl", clamp=10.0)
    torch.testing.assert_close(
        clamped.detach(), torch.tensor([[10.0, LN2 - 0.5]], dtype=torch.float64)
    )
    clamped.sum().backward()
    # d k3 / d logp = 1 - exp(-d): 0 where clamped, 1 - 0.5 at d = ln2
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.5]], dtype=torch.float64))
    # a symmetric bound for the signed estimators: k1 of +-ln2 within 0.5
    logp, ref = lp(0.5, 0.25), lp(0.25, 0.5)
    torch.testing.assert_close(
        kl_penalty(logp, ref, kind="k1", clamp=0.5),
        torch.tensor([[0.5, -0.5]], dtype=torch.float64),
    )
    with pytest.raises(ValueError, match="clamp must be > 0"):
        kl_penalty(logp, ref, kind="k1", clamp=0.0)


# Plain PPO, clip_low 0.2, clip_high 0.28, dual clip 3. Ratios are set through logp - old_logp.
#  tok  A   ratio  -A*r   -A*clip(r,0.8,1.28)  max    dual (A<0: min(., 3|A|))  grad dL/dlogp
#  0   +1   1.5   -1.5       -1.28            -1.28   -                         0 (clipped)
#  1   +1   0.5   -0.5       -0.8             -0.5    -                         -A*r = -0.5
#  2   -1   0.5    0.5        0.8              0.8    0.8                       0 (clipped)
#  3   -1   5.0    5.0        1.28             5.0    3.0 (dual)                0
#  4   -2   1.1    2.2        2.2              2.2    2.2 (cap 6)               -A*r = 2.2
#  5   +1  10.0   masked                                                        0
PPO_RATIOS = [1.5, 0.5, 0.5, 5.0, 1.1, 10.0]
PPO_ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0, -2.0, 1.0]], dtype=torch.float64)
PPO_MASK = torch.tensor([[1, 1, 1, 1, 1, 0]])


def test_ppo_clip_higher_and_dual_clip_hand_values():
    old = lp(*[0.05] * 6)
    logp = lp(*[0.05 * r for r in PPO_RATIOS]).requires_grad_(True)
    loss, stats = policy_loss(
        logp=logp,
        old_logp=old,
        advantages=PPO_ADV,
        mask=PPO_MASK,
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
    )
    want = torch.tensor([[-1.28, -0.5, 0.8, 3.0, 2.2, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(loss, want)
    loss.sum().backward()
    torch.testing.assert_close(
        logp.grad, torch.tensor([[0.0, -0.5, 0.0, 0.0, 2.2, 0.0]], dtype=torch.float64)
    )
    assert stats["tokens"] == 5
    assert stats["clip_frac_low"] == pytest.approx(1 / 5)  # token 2
    assert stats["clip_frac_high"] == pytest.approx(1 / 5)  # token 0
    assert stats["dual_clip_frac"] == pytest.approx(1 / 5)  # token 3
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.5 + 0.5 + 5.0 + 1.1) / 5)
    assert (stats["ratio_min"], stats["ratio_max"]) == pytest.approx((0.5, 5.0))
    # Without the dual clip token 3 keeps 5.0; symmetric clip 0.2 turns token 0 into -1.2.
    loss2, _ = policy_loss(logp=logp.detach(), old_logp=old, advantages=PPO_ADV, mask=PPO_MASK)
    torch.testing.assert_close(
        loss2[0, :4], torch.tensor([-1.2, -0.5, 0.8, 5.0], dtype=torch.float64)
    )


def test_sequence_level_advantages_broadcast_over_tokens():
    old = lp(0.5, 0.5)
    logp = lp(0.55, 0.45)  # ratios 1.1 and 0.9, inside the clip
    loss, _ = policy_loss(
        logp=logp,
        old_logp=old,
        advantages=torch.tensor([2.0], dtype=torch.float64),
        mask=torch.ones(1, 2),
    )
    torch.testing.assert_close(loss, torch.tensor([[-2.2, -1.8]], dtype=torch.float64))


# Decoupled PPO where proximal (old_logp) and behaviour differ, clip 0.2, is_cap 2:
#  tok A   pi    prox  behav  ratio=pi/prox      w=prox/behav      loss            grad
#  0  +1  0.55  0.5   0.4    1.1 (inside)      1.25              -1.1*1.25=-1.375  -1.375
#  1  -1  0.3   0.5   0.2    0.6 -> clip 0.8   2.5 -> cap 2      0.8*2 = 1.6       0
# Anchoring the clip to the behaviour policy instead (the peers' bug) gives, for token 0,
# ratio 0.55/0.4 = 1.375 -> clipped to 1.2: loss -1.2*1.25 = -1.5 and gradient 0.
DEC_ADV = torch.tensor([[1.0, -1.0]], dtype=torch.float64)


def test_decoupled_ppo_anchors_the_clip_to_the_proximal_policy():
    logp = lp(0.55, 0.3).requires_grad_(True)
    prox, behav = lp(0.5, 0.5), lp(0.4, 0.2)
    loss, stats = policy_loss(
        logp=logp,
        old_logp=prox,
        behaviour_logp=behav,
        off_policy="decoupled",
        is_cap=2.0,
        is_over_cap="truncate",  # TIS's rule, chosen explicitly
        advantages=DEC_ADV,
        mask=torch.ones(1, 2),
    )
    torch.testing.assert_close(loss, torch.tensor([[-1.375, 1.6]], dtype=torch.float64))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.375, 0.0]], dtype=torch.float64))
    assert loss[0, 0].item() != pytest.approx(-1.5)  # the wrong anchor's number
    assert stats["is_weight_mean"] == pytest.approx((1.25 + 2.0) / 2)
    assert (stats["is_weight_min"], stats["is_weight_max"]) == pytest.approx((1.25, 2.0))
    assert stats["is_over_cap_frac"] == pytest.approx(0.5)
    assert stats["clip_frac_low"] == pytest.approx(0.5)
    # Decoupled PPO's own rule (AReaL's): the over-cap token is dropped, not truncated.
    masked, _ = policy_loss(
        logp=logp.detach(),
        old_logp=prox,
        behaviour_logp=behav,
        off_policy="decoupled",
        is_cap=2.0,
        advantages=DEC_ADV,
        mask=torch.ones(1, 2),
    )
    torch.testing.assert_close(masked, torch.tensor([[-1.375, 0.0]], dtype=torch.float64))


def test_plain_ppo_on_behaviour_logp_differs_from_decoupled():
    # Plain PPO with old_logp = behaviour: token 0 ratio 1.375 -> clipped 1.2 -> -1.2;
    # token 1 ratio 1.5 with A = -1 -> max(1.5, 1.2) = 1.5.
    logp = lp(0.55, 0.3)
    loss, _ = policy_loss(
        logp=logp, old_logp=lp(0.4, 0.2), advantages=DEC_ADV, mask=torch.ones(1, 2)
    )
    torch.testing.assert_close(loss, torch.tensor([[-1.2, 1.5]], dtype=torch.float64))


# TIS: ratio to the learner's recomputed log-probs, weight min(learner/behaviour, cap 2):
#  tok A   pi    old   behav  ratio  w                 loss
#  0  +1  0.5   0.5   0.45   1.0    0.5/0.45 = 10/9   -10/9
#  1  +2  0.6   0.5   0.1    1.2    5 -> 2            -2 * 1.2 * 2 = -4.8 (1.2 at the clip edge)
def test_tis_truncates_the_behaviour_weight():
    loss, stats = policy_loss(
        logp=lp(0.5, 0.6),
        old_logp=lp(0.5, 0.5),
        behaviour_logp=lp(0.45, 0.1),
        off_policy="tis",
        is_cap=2.0,
        advantages=torch.tensor([[1.0, 2.0]], dtype=torch.float64),
        mask=torch.ones(1, 2),
    )
    torch.testing.assert_close(loss, torch.tensor([[-10 / 9, -4.8]], dtype=torch.float64))
    assert stats["is_weight_max"] == pytest.approx(2.0)
    # No cap: token 1 keeps weight 5 -> -2 * 1.2 * 5 = -12
    loss, _ = policy_loss(
        logp=lp(0.5, 0.6),
        old_logp=lp(0.5, 0.5),
        behaviour_logp=lp(0.45, 0.1),
        off_policy="tis",
        is_cap=None,
        mask=torch.ones(1, 2),
        advantages=torch.tensor([[1.0, 2.0]], dtype=torch.float64),
    )
    torch.testing.assert_close(loss[0, 1], torch.tensor(-12.0, dtype=torch.float64))


def test_policy_loss_rejects_inconsistent_settings():
    x, m = lp(0.5), torch.ones(1, 1)
    a = torch.ones(1, dtype=torch.float64)
    with pytest.raises(ValueError, match="behaviour_logp is only used"):
        policy_loss(logp=x, old_logp=x, behaviour_logp=x, advantages=a, mask=m)
    with pytest.raises(ValueError, match="needs behaviour_logp"):
        policy_loss(logp=x, old_logp=x, advantages=a, mask=m, off_policy="decoupled")
    with pytest.raises(ValueError, match="valid ones"):
        policy_loss(logp=x, old_logp=x, advantages=a, mask=m, off_policy="ppo")
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp=x, old_logp=x, advantages=a, mask=m, dual_clip=1.0)


def test_empty_micro_batch_stats_are_nan_and_merge_skips_them():
    x = lp(0.5, 0.5)
    loss, empty = policy_loss(
        logp=x, old_logp=x, advantages=torch.ones(1, dtype=torch.float64), mask=torch.zeros(1, 2)
    )
    assert loss.abs().sum() == 0 and empty["tokens"] == 0 and math.isnan(empty["ratio_mean"])
    a = {"tokens": 1.0, "ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0}
    b = {"tokens": 3.0, "ratio_mean": 2.0, "ratio_min": 0.5, "ratio_max": 4.0}
    merged = merge_stats([a, empty, b])
    assert merged == {"tokens": 4.0, "ratio_mean": 1.75, "ratio_min": 0.5, "ratio_max": 4.0}


def test_entropy_and_token_logprobs():
    # uniform over 4: ln 4;  (0.5, 0.25, 0.25): 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2
    logits = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0], [math.log(0.5), math.log(0.25), math.log(0.25), -math.inf]]
    )
    # (a -inf logit is a banned token: probability 0, no NaN)
    ent = entropy_from_logits(logits)
    torch.testing.assert_close(ent, torch.tensor([math.log(4.0), 1.5 * LN2]))
    # token_logprobs: position t scores token t with the logits at t - 1; position 0 is 0.
    step_logits = torch.tensor(
        [[[math.log(0.5), math.log(0.25), math.log(0.25)], [0.0, 0.0, 0.0], [5.0, 5.0, 5.0]]]
    )
    ids = torch.tensor([[2, 1, 0]])
    torch.testing.assert_close(
        token_logprobs(step_logits, ids), torch.tensor([[0.0, math.log(0.25), -math.log(3.0)]])
    )
    torch.testing.assert_close(
        token_entropy(step_logits), torch.tensor([[0.0, 1.5 * LN2, math.log(3.0)]])
    )


def test_aggregation_modes_hand_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # token-mean: (1 + 2 + 4 + 5 + 7) / 5 tokens = 3.8
    assert aggregate_loss(loss, mask, mode="token-mean", global_denominator=5).item() == (
        pytest.approx(3.8)
    )
    # seq-mean-token-sum: (3 + 16) / 2 sequences = 9.5
    assert aggregate_loss(loss, mask, mode="seq-mean-token-sum", global_denominator=2).item() == (
        pytest.approx(9.5)
    )
    # seq-mean-token-mean: (3/2 + 16/3) / 2 = 3.41666...
    assert aggregate_loss(loss, mask, mode="seq-mean-token-mean", global_denominator=2).item() == (
        pytest.approx((1.5 + 16 / 3) / 2)
    )
    with pytest.raises(ValueError, match="no valid tokens"):
        aggregate_loss(loss, mask, mode="token-mean", global_denominator=0)
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(loss, mask, mode="sum", global_denominator=1)


def test_step_denominator_from_lengths_or_masks():
    assert step_denominator([2, 3, 0], mode="token-mean") == 5
    assert step_denominator([2, 3, 0], mode="seq-mean-token-sum") == 2
    masks = [torch.tensor([[1, 1, 0], [0, 0, 0]]), torch.tensor([[0, 1, 1, 1]])]
    assert step_denominator(masks, mode="token-mean") == 5
    assert step_denominator(masks, mode="seq-mean-token-mean") == 2


def test_mismatch_stats_hand_values():
    # d = learner - behaviour = ln2, 0 (the third token is masked out)
    learner = lp(0.5, 0.5, 0.9)
    behaviour = lp(0.25, 0.5, 0.001)
    s = mismatch_stats(learner, behaviour, torch.tensor([[1, 1, 0]]))
    assert s["tokens"] == 2
    assert s["kl_k3_mean"] == pytest.approx((2 - LN2 - 1 + 0) / 2)  # exp(d) - d - 1
    assert s["kl_k1_mean"] == pytest.approx(-LN2 / 2)
    assert s["abs_diff_mean"] == pytest.approx(LN2 / 2)
    assert (s["ratio_mean"], s["ratio_min"], s["ratio_max"]) == pytest.approx((1.5, 1.0, 2.0))
