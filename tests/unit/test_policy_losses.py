"""GSPO, CISPO and the rollout-train mismatch mask against numbers derived by hand (the
arithmetic is in the comments)."""

import math

import pytest
import torch  # noqa: TID253 - tests of torch code

from common.config.learner import OFF_POLICY_DEFAULTS
from services.learner.losses import aggregate_loss, merge_stats, policy_loss
from services.learner.mismatch import mismatch_mask

LN2 = math.log(2.0)


def lp(*rows):
    """Log-probs [B, T] from rows of probabilities, float64 so hand values compare tightly."""
    return torch.tensor(rows, dtype=torch.float64).log()


def test_gspo_clips_whole_sequences_on_the_length_normalised_ratio():
    # Sequence 0: token ratios 2 and 0.5, so s = exp((ln 2 - ln 2) / 2) = 1 (inside the clip);
    # sequence 1: one token of ratio 1.5 (its second position is padding), s = 1.5 > 1.2.
    old = lp([0.25, 0.25], [0.4, 0.4])
    logp = lp([0.5, 0.125], [0.6, 0.4]).requires_grad_(True)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    loss, stats = policy_loss(logp=logp, old_logp=old, advantages=adv, mask=mask, loss_type="gspo")
    # seq 0: -A·s = -1 on both tokens; seq 1: max(-1.5, -1.2) = -1.2; padding 0.
    torch.testing.assert_close(loss, torch.tensor([[-1.0, -1.0], [-1.2, 0.0]], dtype=torch.float64))
    loss.sum().backward()
    # d(-A·s·exp(logp - sg logp))/d logp_t = -A·s = -1 on sequence 0; clipped sequence 1: 0.
    torch.testing.assert_close(
        logp.grad, torch.tensor([[-1.0, -1.0], [0.0, 0.0]], dtype=torch.float64)
    )
    assert stats["ratio_mean"] == pytest.approx((1 + 1 + 1.5) / 3)
    assert stats["clip_frac_high"] == pytest.approx(1 / 3)  # the one token of sequence 1
    # Token-level PPO on the same numbers clips token 0 of sequence 0 (ratio 2) instead.
    ppo, _ = policy_loss(logp=logp.detach(), old_logp=old, advantages=adv, mask=mask)
    torch.testing.assert_close(ppo[0], torch.tensor([-1.2, -0.5], dtype=torch.float64))


def test_gspo_seq_mean_token_mean_is_the_papers_sequence_objective():
    # With seq-mean-token-mean each sequence's loss is -A·s (its tokens' mean), and the
    # gradient per token is -A·s / |y|: sequence 0 above gives -1/2 per token.
    old = lp([0.25, 0.25])
    logp = lp([0.5, 0.125]).requires_grad_(True)
    mask = torch.tensor([[1, 1]])
    loss, _ = policy_loss(
        logp=logp,
        old_logp=old,
        advantages=torch.tensor([-2.0], dtype=torch.float64),
        mask=mask,
        loss_type="gspo",
    )
    total = aggregate_loss(loss, mask, mode="seq-mean-token-mean", global_denominator=1)
    assert float(total.detach()) == pytest.approx(2.0)  # -(-2)·1
    total.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[1.0, 1.0]], dtype=torch.float64))


def test_cispo_detached_clipped_weight_keeps_every_tokens_gradient():
    # ratios 2, 0.5, 1 (old 0.25 each); A = 1, -1, 2.
    old = lp([0.25, 0.25, 0.25])
    logp = lp([0.5, 0.125, 0.25]).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    # No lower bound (clip_low = 1), weight capped at 1 + 0.5 = 1.5:
    # L = -w·A·logp: t0 -1.5·1·ln(1/2) = 1.5 ln2; t1 -0.5·(-1)·ln(1/8) = -1.5 ln2;
    # t2 -1·2·ln(1/4) = 4 ln2. Gradient -w·A: -1.5, +0.5, -2.
    loss, stats = policy_loss(
        logp=logp,
        old_logp=old,
        advantages=adv,
        mask=mask,
        loss_type="cispo",
        clip_low=1.0,
        clip_high=0.5,
    )
    torch.testing.assert_close(
        loss, torch.tensor([[1.5 * LN2, -1.5 * LN2, 4 * LN2]], dtype=torch.float64)
    )
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5, 0.5, -2.0]], dtype=torch.float64))
    assert stats["clip_frac_high"] == pytest.approx(1 / 3)
    assert stats["clip_frac_low"] == 0.0
    # PPO would give token 0 (A > 0, ratio 2 above 1.5) no gradient at all.
    logp.grad = None
    ppo, _ = policy_loss(logp=logp, old_logp=old, advantages=adv, mask=mask, clip_high=0.5)
    ppo.sum().backward()
    assert float(logp.grad[0, 0]) == 0.0
    # A lower bound 1 - 0.2 = 0.8 lifts token 1's weight from 0.5 to 0.8 (gradient +0.8).
    logp.grad = None
    loss, stats = policy_loss(
        logp=logp, old_logp=old, advantages=adv, mask=mask, loss_type="cispo", clip_high=0.5
    )
    loss.sum().backward()
    assert float(logp.grad[0, 1]) == pytest.approx(0.8)
    assert stats["clip_frac_low"] == pytest.approx(1 / 3)


def test_loss_type_settings_are_checked():
    t = torch.zeros(1, 2)
    base = {"logp": t, "old_logp": t, "advantages": torch.zeros(1), "mask": torch.ones(1, 2)}
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(**base, loss_type="grpo")
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(**base, clip_low=1.0)  # only CISPO may drop its lower bound
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(**base, loss_type="gspo", dual_clip=3.0)
    policy_loss(**base, loss_type="cispo", clip_low=1.0)


# Two responses: ratios (learner / behaviour) 1, 3, 1 and 1.5, 1.5 (+ one padding position).
LEARNER = lp([0.3, 0.3, 0.3], [0.3, 0.3, 0.3])
BEHAVIOUR = lp([0.3, 0.1, 0.3], [0.2, 0.2, 0.9])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _masked(**bounds):
    keep, counts = mismatch_mask(LEARNER, BEHAVIOUR, MASK, **bounds)
    return keep.int().tolist(), counts


def test_mismatch_mask_token_level_drops_only_the_stray_token():
    keep, counts = _masked(token=[0.5, 2.0])
    assert keep == [[1, 0, 1], [1, 1, 0]]  # ratio 3 > 2; padding is never kept
    assert counts == {
        "mismatch_masked_tokens_count": 1.0,
        "mismatch_tokens_count": 5.0,
        "mismatch_masked_seqs_count": 1.0,
        "mismatch_seqs_count": 2.0,
    }


def test_mismatch_mask_sequence_level_product_and_geometric():
    # Products: 1·3·1 = 3 and 1.5·1.5 = 2.25, both above 2: every token goes.
    keep, counts = _masked(sequence=[0.5, 2.0])
    assert keep == [[0, 0, 0], [0, 0, 0]]
    assert counts["mismatch_masked_tokens_count"] == 5.0
    # Geometric means: 3^(1/3) = 1.442 and 1.5. Inside [0.5, 2]: nothing is masked;
    # inside [0.8, 1.45]: the second response goes.
    assert _masked(geometric=[0.5, 2.0])[0] == [[1, 1, 1], [1, 1, 0]]
    keep, counts = _masked(geometric=[0.8, 1.45])
    assert keep == [[1, 1, 1], [0, 0, 0]]
    assert counts["mismatch_masked_seqs_count"] == 1.0
    # Criteria combine: token [0.5, 2] and geometric [0.8, 1.45] mask 3 tokens, 2 sequences.
    keep, counts = _masked(token=[0.5, 2.0], geometric=[0.8, 1.45])
    assert keep == [[1, 0, 1], [0, 0, 0]]
    assert (counts["mismatch_masked_tokens_count"], counts["mismatch_masked_seqs_count"]) == (3, 2)
    with pytest.raises(ValueError, match="low < high"):
        _masked(token=[2.0, 0.5])


def test_merge_stats_sums_counts_over_every_micro_batch_and_derives_fractions():
    a = {"tokens": 4.0, "ratio_mean": 1.0, "mismatch_masked_tokens_count": 1.0,
         "mismatch_tokens_count": 5.0, "mismatch_masked_seqs_count": 1.0,
         "mismatch_seqs_count": 2.0}  # fmt: skip
    # A micro-batch whose every token was masked has no policy tokens but still counts.
    b = {"tokens": 0.0, "ratio_mean": float("nan"), "mismatch_masked_tokens_count": 3.0,
         "mismatch_tokens_count": 3.0, "mismatch_masked_seqs_count": 1.0,
         "mismatch_seqs_count": 1.0}  # fmt: skip
    out = merge_stats([a, b])
    assert out["tokens"] == 4.0 and out["ratio_mean"] == 1.0
    assert out["mismatch_masked_frac"] == pytest.approx(4 / 8)
    assert out["mismatch_masked_seq_frac"] == pytest.approx(2 / 3)


def test_gspo_clamps_the_sequence_log_ratio_at_10_as_verl_does():
    # One token, A = -1, log-ratio 12: verl's loss is |A|·e^10 = 22026.47 with no gradient
    # (its clamp is flat there); unclamped it would be e^12 = 162754.79 with a full gradient.
    old = torch.zeros(1, 1, dtype=torch.float64)
    logp = torch.full((1, 1), 12.0, dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(
        logp=logp,
        old_logp=old,
        advantages=torch.tensor([-1.0], dtype=torch.float64),
        mask=torch.ones(1, 1),
        loss_type="gspo",
    )
    assert loss.item() == pytest.approx(math.exp(10.0))
    loss.sum().backward()
    assert logp.grad is not None and logp.grad.item() == 0.0


# One stale batch, three tokens, A = +1, clip 0.2, learner = proximal (ratio 1, no clipping):
#  tok  prox  behav  w = prox/behav   decoupled (mask > 5)   tis (truncate at 2)   none (ratio
#  0    0.5   0.4    1.25             -1.25                  -1.25                 to behav, clip)
#  1    0.6   0.2    3                -3                     -2                    -1.2
#  2    0.6   0.1    6                 0 (dropped)           -2                    -1.2
# "none" anchors the ratio to the behaviour policy: 1.25, 3, 6 clipped at 1.2 -> -1.2 each.
STALE = {"prox": (0.5, 0.6, 0.6), "behav": (0.4, 0.2, 0.1)}


def test_the_corrections_compute_different_losses_on_stale_data():
    prox, behav = lp(STALE["prox"]), lp(STALE["behav"])
    adv, mask = torch.ones(1, dtype=torch.float64), torch.ones(1, 3)
    got = {}
    for mode in ("decoupled", "tis"):
        cap, _ = OFF_POLICY_DEFAULTS[mode]
        got[mode], stats = policy_loss(
            logp=prox, old_logp=prox, behaviour_logp=behav, off_policy=mode, is_cap=cap,
            advantages=adv, mask=mask,
        )  # fmt: skip
        assert stats["is_over_cap_frac"] == pytest.approx(1 / 3 if mode == "decoupled" else 2 / 3)
    got["none"], _ = policy_loss(logp=prox, old_logp=behav, advantages=adv, mask=mask)
    torch.testing.assert_close(got["decoupled"], torch.tensor([[-1.25, -3.0, 0.0]]).double())
    torch.testing.assert_close(got["tis"], torch.tensor([[-1.25, -2.0, -2.0]]).double())
    torch.testing.assert_close(got["none"], torch.tensor([[-1.2, -1.2, -1.2]]).double())
    # the dropped token stays in the denominator (AReaL's loss_mask_count): 4.25 / 3, not / 2
    agg = aggregate_loss(got["decoupled"], mask, mode="token-mean", global_denominator=3)
    assert agg.item() == pytest.approx(-4.25 / 3)
