"""Learning direction of the policy-loss options (GSPO, CISPO), of rollout-train mismatch
masking, of over-long filtering and of dynamic sampling's selection, through the real learner
path (``train_three_cycles``: advantages → proximal log-probs → micro-batches → loss →
train_step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.config.load import load_config
from services.learner import sampling
from services.learner.cycle import mask_overlong
from tests.unit.test_learning_direction import train_three_cycles


def _up_and_down(samples, delta, skip=()):
    up = [
        d
        for i, (d, s) in enumerate(zip(delta, samples, strict=True))
        if s.reward > 0 and i not in skip
    ]
    down = [d for i, (d, s) in enumerate(zip(delta, samples, strict=True)) if s.reward == 0 and i not in skip]  # fmt: skip
    return up, down


@pytest.mark.parametrize(
    "sets",
    [
        ('learner.policy_loss="gspo"', 'learner.loss_agg="seq-mean-token-mean"'),
        ('learner.policy_loss="cispo"', "learner.clip_low=1.0", "learner.clip_high=4.0"),
        ('learner.policy_loss="cispo"', 'learner.off_policy="none"'),
    ],
)
def test_gspo_and_cispo_make_rewarded_responses_more_likely(tmp_path, sets):
    samples, delta, stats = train_three_cycles(tmp_path, *sets)
    up, down = _up_and_down(samples, delta)
    assert min(up) > 0 and max(down) < 0, (up, down)
    assert stats["tokens"] == 3 * 8 * 5  # every token of every step took part


def test_mismatch_masking_takes_a_stray_response_out_of_the_update(tmp_path):
    """Response 1 (rewarded) claims the generator gave its tokens e^-3 of the learner's
    probability: a ratio of 20, outside [0.1, 10]. Masked, it gets no push of its own (it still
    moves with the shared weights) and the masked fraction is exactly its share of tokens;
    unmasked, the truncated IS weight (2) pushes it up harder than the others. (Truncation is
    chosen explicitly: decoupled PPO's own rule would drop that response at its cap of 5.)"""

    def stray(samples):
        samples[1].behaviour_logp = [x - 3.0 for x in samples[1].behaviour_logp]

    truncate = ("learner.is_cap=2.0", 'learner.is_over_cap="truncate"')
    free_samples, free, free_stats = train_three_cycles(tmp_path / "a", *truncate, edit=stray)
    samples, masked, stats = train_three_cycles(
        tmp_path / "b", "learner.mismatch_mask_token=[0.1, 10.0]", *truncate, edit=stray
    )
    up, down = _up_and_down(samples, masked, skip=(1,))
    assert min(up) > 0 and max(down) < 0, (up, down)
    assert masked[1] < free[1] - 0.05, (masked[1], free[1])
    assert stats["mismatch_masked_frac"] == pytest.approx(5 / 40)  # 5 of 40 tokens, each cycle
    assert stats["mismatch_masked_seq_frac"] == pytest.approx(1 / 8)
    assert "mismatch_masked_frac" not in free_stats
    # sequence-level: the product ratio 20^5 of response 1 leaves [0.01, 100] too
    _, _, seq_stats = train_three_cycles(
        tmp_path / "c", "learner.mismatch_mask_sequence=[0.01, 100.0]", edit=stray
    )
    assert seq_stats["mismatch_masked_frac"] == pytest.approx(5 / 40)


def test_decoupled_drops_an_over_cap_token_and_the_setting_reaches_the_loss(tmp_path):
    """Response 1's behaviour weight π_prox / μ is e^3 ≈ 20. Decoupled PPO's own rule (AReaL:
    above behav_imp_weight_cap, here 5) drops its tokens: they carry no loss and are counted
    in is_over_cap_frac. ``learner.is_over_cap = "truncate"`` (TIS's rule) keeps them at
    weight 5, which pushes the rewarded response up harder than the others."""

    def stray(samples):
        samples[1].behaviour_logp = [x - 3.0 for x in samples[1].behaviour_logp]

    samples, dropped, stats = train_three_cycles(tmp_path / "a", edit=stray)
    _, truncated, t_stats = train_three_cycles(
        tmp_path / "b", 'learner.is_over_cap="truncate"', edit=stray
    )
    up, down = _up_and_down(samples, dropped, skip=(1,))
    assert min(up) > 0 and max(down) < 0, (up, down)
    assert stats["is_over_cap_frac"] == pytest.approx(5 / 40)  # its 5 of 40 tokens per step
    assert stats["is_weight_max"] < 5.0  # the dropped tokens' weight is 0, not 5
    assert t_stats["is_weight_max"] == pytest.approx(5.0)
    assert dropped[1] < truncated[1] - 0.05, (dropped[1], truncated[1])


def test_overlong_filter_masks_cut_off_responses_from_the_update(tmp_path):
    """Responses 1 and 2 were cut off at the length limit. With learner.overlong_filter they are
    masked (weight 0, counted): the others still move the right way, and the cut-off rewarded
    response 1 rises less than without the filter (it gets no push of its own)."""
    masked_counts = []

    def cut_off(samples):
        samples[1].truncated = samples[2].truncated = True

    def cut_off_and_mask(samples):
        cut_off(samples)

        cfg = load_config(overrides=["learner.overlong_filter=true"], env={}).config
        masked_counts.append(mask_overlong(samples, cfg.learner))

    _, free, _ = train_three_cycles(tmp_path / "a", edit=cut_off)
    samples, masked, stats = train_three_cycles(tmp_path / "b", edit=cut_off_and_mask)
    assert masked_counts == [2]
    assert [s.weight for s in samples] == [1, 0, 0, 1, 1, 1, 1, 1]
    up, down = _up_and_down(samples, masked, skip=(1, 2))
    assert min(up) > 0 and max(down) < 0, (up, down)
    assert masked[1] < free[1] - 0.05, (masked[1], free[1])
    assert stats["tokens"] == 3 * 6 * 5  # the two masked responses carry no loss tokens


def test_dynamic_sampling_fills_the_step_with_groups_that_teach(tmp_path):
    """Four candidate groups in sampler order, rewards as the helper's (0, 1, 0, 1) except that
    groups 0 and 2 answered all alike. The plain filter trains the first two: group 0 at weight
    0, so half of every step teaches nothing. Dynamic sampling's selection takes groups 1 and 3:
    every response of every step carries signal, and the rewarded ones of both groups rise."""

    def group(i: int) -> SimpleNamespace:
        rewards = [1.0] * 4 if i % 2 == 0 else [0.0, 1.0, 0.0, 1.0]
        return SimpleNamespace(group=SimpleNamespace(index=i), rewards=rewards)

    sel = sampling.select([group(i) for i in range(4)], 2, fill=True)
    assert [g.group.index for g in sel.chosen] == [1, 3]
    assert [g.group.index for g in sel.filtered] == [0, 2]

    def first_group_all_alike(samples):  # the plain filter's batch: positions 0 and 1
        for s in samples[:4]:
            s.reward = 1.0

    filter_on = "learner.filter_equal_reward_groups=true"
    plain_samples, plain, plain_stats = train_three_cycles(
        tmp_path / "a", filter_on, edit=first_group_all_alike
    )
    samples, dynamic, stats = train_three_cycles(
        tmp_path / "b", filter_on, "learner.dynamic_sampling=true"
    )
    assert [s.weight for s in plain_samples] == [0.0] * 4 + [1.0] * 4
    assert plain_stats["tokens"] == 3 * 4 * 5  # half of every step carries no loss
    assert stats["tokens"] == 3 * 8 * 5
    up, down = _up_and_down(samples, dynamic)
    assert min(up) > 0 and max(down) < 0, (up, down)
    up, down = _up_and_down(plain_samples, plain, skip=(0, 1, 2, 3))
    assert min(up) > 0 and max(down) < 0, (up, down)
