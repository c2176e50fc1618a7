"""Advantage estimators against values worked out by hand (arithmetic in the comments)."""

import math

import pytest
import torch  # noqa: TID253 - tests of torch code

from common.config.load import load_config
from services.learner.advantages import (
    compute_advantages,
    equal_reward_group_mask,
    kl_reward_advantages,
    token_rewards_with_kl,
    whiten_tokens,
)
from services.learner.cycle import Sample, as_batch_fields, assign_advantages

# Two groups, interleaved and with non-contiguous ids:
#   group 7: rewards 1, 0, 0, 0  (mean 0.25)
#   group 3: rewards 2, 4        (mean 3)
#   group 9: reward 5            (a group of one)
REWARDS = torch.tensor([1.0, 2.0, 0.0, 0.0, 4.0, 0.0, 5.0])
GROUPS = torch.tensor([7, 3, 7, 7, 3, 7, 9])
S3 = math.sqrt(3.0)


def test_grpo_population_std():
    # group 7: population var = (0.75^2 + 3 * 0.25^2) / 4 = 0.1875, std = sqrt(3)/4
    #   A = 0.75 / (sqrt(3)/4) = sqrt(3);  -0.25 / (sqrt(3)/4) = -1/sqrt(3)
    # group 3: var = (1 + 1) / 2 = 1 -> A = -1, +1.   group 9: 0 / (0 + eps) = 0
    adv = compute_advantages(REWARDS, GROUPS, estimator="grpo", eps=1e-6)
    want = torch.tensor([S3, -1.0, -1 / S3, -1 / S3, 1.0, -1 / S3, 0.0])
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)


def test_grpo_unbiased_std_matches_bessel_corrected_numbers():
    # group 7: unbiased var = 0.75 / 3 = 0.25, std 0.5 -> A = 1.5, -0.5
    # group 3: unbiased var = 2 / 1 = 2, std sqrt(2) -> A = -1/sqrt(2), +1/sqrt(2)
    # group 9: size one -> std taken as 1, A = 0
    adv = compute_advantages(REWARDS, GROUPS, estimator="grpo", unbiased_std=True, eps=0.0)
    h = 1 / math.sqrt(2.0)
    want = torch.tensor([1.5, -h, -0.5, -0.5, h, -0.5, 0.0])
    torch.testing.assert_close(adv, want)


def test_grpo_without_std_and_drgrpo_subtract_the_group_mean_only():
    want = torch.tensor([0.75, -1.0, -0.25, -0.25, 1.0, -0.25, 0.0])
    torch.testing.assert_close(
        compute_advantages(REWARDS, GROUPS, estimator="grpo", norm_by_std=False), want
    )
    # Dr. GRPO never divides by the std, whatever norm_by_std says.
    torch.testing.assert_close(
        compute_advantages(REWARDS, GROUPS, estimator="drgrpo", norm_by_std=True), want
    )


def test_rloo_leave_one_out_baseline():
    # group 7: 1 - mean(0,0,0) = 1;  0 - mean(1,0,0) = -1/3
    # group 3: 2 - 4 = -2;  4 - 2 = 2.   group 9 (size one): 0
    adv = compute_advantages(REWARDS, GROUPS, estimator="rloo")
    want = torch.tensor([1.0, -2.0, -1 / 3, -1 / 3, 2.0, -1 / 3, 0.0])
    torch.testing.assert_close(adv, want)


def test_reinforce_pp_whitens_over_the_batch_ignoring_groups():
    # rewards 0, 2, 4, 6: mean 3, population var (9 + 1 + 1 + 9) / 4 = 5
    r = torch.tensor([0.0, 2.0, 4.0, 6.0])
    adv = compute_advantages(r, torch.tensor([0, 0, 1, 1]), estimator="reinforce_pp", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-3.0, -1.0, 1.0, 3.0]) / math.sqrt(5.0))


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens():
    # groups (0, 2) and (4, 10): centred -1, 1, -3, 3; batch mean 0, var (1+1+9+9)/4 = 5
    r = torch.tensor([0.0, 2.0, 4.0, 10.0])
    g = torch.tensor([0, 0, 1, 1])
    adv = compute_advantages(r, g, estimator="reinforce_pp_baseline", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, -3.0, 3.0]) / math.sqrt(5.0))


def test_estimator_errors_name_the_fix():
    with pytest.raises(ValueError, match="rloo"):
        compute_advantages(REWARDS, GROUPS, estimator="ppo")
    with pytest.raises(ValueError, match="group_index shape"):
        compute_advantages(REWARDS, GROUPS[:3], estimator="grpo")
    with pytest.raises(ValueError, match="integer"):
        compute_advantages(REWARDS, GROUPS.float(), estimator="grpo")


def test_token_rewards_with_kl_and_returns():
    kl = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.5, 0.2, 0.4, 0.9], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]])
    seq = torch.tensor([1.0, -1.0, 5.0])
    rewards, returns = token_rewards_with_kl(seq, kl, mask, kl_coef=0.5)
    # row 0: -0.5 * kl = -0.05, -0.1, -0.15 (+1 on the last valid token) -> 0.85; pad 0
    #   returns (gamma 1): 0.7, 0.75, 0.85, 0
    # row 1: position 0 is prompt; -0.1, -0.2 - 1 = -1.2 -> returns 0, -1.3, -1.2, 0
    # row 2: no valid token -> all zero (its sequence reward has nowhere to go)
    torch.testing.assert_close(
        rewards,
        torch.tensor([[-0.05, -0.1, 0.85, 0.0], [0.0, -0.1, -1.2, 0.0], [0.0, 0.0, 0.0, 0.0]]),
    )
    torch.testing.assert_close(
        returns,
        torch.tensor([[0.7, 0.75, 0.85, 0.0], [0.0, -1.3, -1.2, 0.0], [0.0, 0.0, 0.0, 0.0]]),
    )
    # gamma 0.5, row 0: G2 = 0.85; G1 = -0.1 + 0.5 * 0.85 = 0.325; G0 = -0.05 + 0.5 * 0.325
    _, disc = token_rewards_with_kl(seq, kl, mask, kl_coef=0.5, gamma=0.5)
    torch.testing.assert_close(disc[0], torch.tensor([0.1125, 0.325, 0.85, 0.0]))


def test_whiten_tokens_uses_valid_tokens_only():
    # valid 1, 2, 3: mean 2, population std sqrt(2/3); the masked 100 is ignored and zeroed
    v = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    m = torch.tensor([[1, 1], [1, 0]])
    s = math.sqrt(2 / 3)
    torch.testing.assert_close(
        whiten_tokens(v, m, eps=0.0), torch.tensor([[-1 / s, 0.0], [1 / s, 0.0]])
    )


def test_equal_reward_groups_are_filtered_and_counted():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 2.0, 2.0, 2.0])
    g = torch.tensor([0, 0, 1, 1, 2, 3, 3, 3])
    keep, n_filtered = equal_reward_group_mask(r, g)
    # group 0 all 1, group 2 a single sample, group 3 all 2: filtered; group 1 kept
    assert keep.tolist() == [False, False, True, True, False, False, False, False]
    assert n_filtered == 3
    keep, n_filtered = equal_reward_group_mask(
        torch.tensor([0.0, 0.05]), torch.tensor([4, 4]), atol=0.1
    )
    assert keep.tolist() == [False, False] and n_filtered == 1


# --------------------------------------------------------------------------- KL in the reward
# Three responses: two to prompt 0 (rewards 2 and 0), one alone to prompt 5 (reward 3).
# Per-token KL estimates; position 2 of row 0 is padding (its 9.0 must be ignored).
KL_REWARDS = torch.tensor([2.0, 0.0, 3.0])
KL_GROUPS = torch.tensor([0, 0, 5])
KL = torch.tensor([[0.2, 0.4, 9.0], [0.1, 0.0, 0.3], [0.5, 0.5, 0.0]])
KL_MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0]])
# KL still to come from each token on (K[i, t] = sum over k >= t), times kl_coef 0.5:
#   row 0: 0.6, 0.4 -> 0.3, 0.2;  row 1: 0.4, 0.3, 0.3 -> 0.2, 0.15, 0.15;  row 2: 1.0, 0.5 -> 0.5, 0.25
KL_TO_GO = torch.tensor([[0.3, 0.2, 0.0], [0.2, 0.15, 0.15], [0.5, 0.25, 0.0]])


def _grpo_family(estimator, **kw):
    return kl_reward_advantages(
        KL_REWARDS, KL_GROUPS, KL, KL_MASK, estimator=estimator, kl_coef=0.5, **kw
    )


def test_kl_in_reward_grpo_family_subtracts_each_tokens_kl_to_go():
    # The outcome advantages are the estimator's own: grpo (population std 1 in group 0) and
    # drgrpo give +1, -1; rloo gives 2 - 0 = 2, 0 - 2 = -2; the lone response gets 0. Then each
    # token loses 0.5 x its KL-to-go, not divided by any std.
    mask = KL_MASK.float()
    for estimator, a in (("grpo", 1.0), ("drgrpo", 1.0), ("rloo", 2.0)):
        want = (torch.tensor([[a], [-a], [0.0]]) - KL_TO_GO) * mask
        torch.testing.assert_close(_grpo_family(estimator), want, atol=1e-5, rtol=1e-5)
    # row 0 by hand for grpo: 1 - 0.5 * (0.2 + 0.4) = 0.7, then 1 - 0.5 * 0.4 = 0.8
    torch.testing.assert_close(_grpo_family("grpo")[0, :2], torch.tensor([0.7, 0.8]))
    # unbiased std: group 0's std is sqrt(2), so its outcome advantages are +-1/sqrt(2)
    h = 1 / math.sqrt(2.0)
    want = (torch.tensor([[h], [-h], [0.0]]) - KL_TO_GO) * mask
    torch.testing.assert_close(_grpo_family("grpo", unbiased_std=True), want)
    # no KL: exactly the sequence advantages, broadcast over the response tokens
    seq = compute_advantages(KL_REWARDS, KL_GROUPS, estimator="rloo")
    no_kl = kl_reward_advantages(
        KL_REWARDS, KL_GROUPS, torch.zeros(3, 3), KL_MASK, estimator="rloo", kl_coef=0.5
    )
    torch.testing.assert_close(no_kl, seq.unsqueeze(1) * mask)


def test_kl_in_reward_reinforce_pp_whitens_token_returns_over_the_batch():
    # returns (reward + KL penalties to go, kl_coef 0.5):
    #   row 0 (reward 1): 1 - 0.3 = 0.7, 1 - 0.2 = 0.8;  row 1 (reward 0): -0.2, -0.15, -0.15
    # over the 5 valid tokens: mean 1.0 / 5 = 0.2, deviations 0.5, 0.6, -0.4, -0.35, -0.35,
    # sum of squares 0.25 + 0.36 + 0.16 + 0.1225 + 0.1225 = 1.015
    rewards, groups = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    dev = torch.tensor([[0.5, 0.6, 0.0], [-0.4, -0.35, -0.35]])
    for unbiased, n in ((False, 5), (True, 4)):
        adv = kl_reward_advantages(
            rewards,
            groups,
            KL[:2],
            KL_MASK[:2],
            estimator="reinforce_pp",
            kl_coef=0.5,
            unbiased_std=unbiased,
            eps=0.0,
        )
        torch.testing.assert_close(adv, dev / math.sqrt(1.015 / n))


def test_kl_in_reward_reinforce_pp_baseline_centres_rewards_per_group_first():
    # groups (1, 0) and (5, 5): centred rewards 0.5, -0.5, 0, 0; kl_coef 0.5
    # returns: row 0: 0.5 - 0.5*(0.2+0.4) = 0.2, 0.5 - 0.2 = 0.3;  row 1: -0.5 - 0.05 = -0.55, -0.5
    #          row 2: 0, 0;  row 3: 0 - 0.5*(0.2+0.2) = -0.2, -0.1
    rewards, groups = torch.tensor([1.0, 0.0, 5.0, 5.0]), torch.tensor([0, 0, 1, 1])
    kl = torch.tensor([[0.2, 0.4], [0.1, 0.0], [0.0, 0.0], [0.2, 0.2]])
    returns = torch.tensor(
        [[0.2, 0.3], [-0.55, -0.5], [0.0, 0.0], [-0.2, -0.1]], dtype=torch.float64
    )
    want = (returns - returns.mean()) / returns.std(unbiased=False)
    adv = kl_reward_advantages(
        rewards,
        groups,
        kl,
        torch.ones(4, 2),
        estimator="reinforce_pp_baseline",
        kl_coef=0.5,
        eps=0.0,
    )
    torch.testing.assert_close(adv, want.float())


def _kl_samples():
    # k1 = behaviour - ref: row 0: 0.2, 0.4;  row 1: 0.1, 0.0, 0.3 (KL above, prompt 0)
    return [
        Sample(sample_id="a", group=0, prompt_ids=[5], response_ids=[6, 7],
               behaviour_logp=[-1.0, -2.0], reward=2.0, policy_version=0,
               ref_logp=[-1.2, -2.4]),
        Sample(sample_id="b", group=0, prompt_ids=[5], response_ids=[8, 9, 10],
               behaviour_logp=[-0.5, -1.5, -0.7], reward=0.0, policy_version=0,
               ref_logp=[-0.6, -1.5, -1.0]),
    ]  # fmt: skip


def _token_advantages(*sets):
    cfg = load_config(overrides=["learner.kl_coef=0.5", *sets], env={}).config
    samples = _kl_samples()
    assign_advantages(samples, cfg.learner)
    return [as_batch_fields(s)["advantage"] for s in samples]


def test_learner_kl_in_reward_changes_the_advantages_per_token():
    # As a loss term the KL leaves the advantages alone: grpo's +1, -1 on every token.
    got = _token_advantages('learner.kl_type="k1"')
    assert got[0] == pytest.approx([1.0, 1.0], abs=1e-5)
    assert got[1] == pytest.approx([-1.0, -1.0, -1.0], abs=1e-5)
    # In the reward: 1 - 0.5 * (0.2 + 0.4) = 0.7, 1 - 0.5 * 0.4 = 0.8;
    #                -1 - 0.5 * (0.1 + 0.0 + 0.3) = -1.2, -1 - 0.15 = -1.15, -1.15
    got = _token_advantages('learner.kl_type="k1"', "learner.kl_in_reward=true")
    assert got[0] == pytest.approx([0.7, 0.8], abs=1e-5)
    assert got[1] == pytest.approx([-1.2, -1.15, -1.15], abs=1e-5)
    # kl_clamp 0.3 bounds row 0's second estimate 0.4 to 0.3: 1 - 0.5 * 0.5 = 0.75, 1 - 0.15
    got = _token_advantages(
        'learner.kl_type="k1"', "learner.kl_in_reward=true", "learner.kl_clamp=0.3"
    )
    assert got[0] == pytest.approx([0.75, 0.85], abs=1e-5)
    assert got[1] == pytest.approx([-1.2, -1.15, -1.15], abs=1e-5)
    # kl_type picks the reward's estimator: k2 = d^2 / 2 -> row 0: 0.02, 0.08
    got = _token_advantages('learner.kl_type="k2"', "learner.kl_in_reward=true")
    assert got[0] == pytest.approx([1 - 0.05, 1 - 0.04], abs=1e-5)


def test_learner_std_estimator_scales_grpo_and_reinforce_pp():
    def advantages(*sets):
        cfg = load_config(overrides=list(sets), env={}).config
        samples = [
            Sample(sample_id=str(i), group=0, prompt_ids=[1], response_ids=[2],
                   behaviour_logp=[-1.0], reward=float(i == 0), policy_version=0)
            for i in range(8)
        ]  # fmt: skip
        assign_advantages(samples, cfg.learner)
        return torch.tensor([as_batch_fields(s)["advantage"][0] for s in samples])

    # one group of 8: the unbiased std is sqrt(8/7) times the population std
    for est in ("grpo", "reinforce_pp"):
        pop = advantages(f'learner.advantage_estimator="{est}"')
        unb = advantages(f'learner.advantage_estimator="{est}"', 'learner.std_estimator="unbiased"')
        torch.testing.assert_close(unb, pop * math.sqrt(7 / 8), atol=1e-5, rtol=1e-5)
    # by hand: rewards 1, 0 x 7: mean 1/8, population var 7/64, unbiased var 1/8
    assert float(unb[0]) == pytest.approx((7 / 8) / math.sqrt(1 / 8), rel=1e-5)
