"""`tether config import` of the peers' dynamic sampling, over-long penalty, GSPO / CISPO and
rollout-correction names: what each becomes, the notes that say where the peer differs, and
that the imported TOML loads."""

from __future__ import annotations

from common.config.load import load_config
from tether.config_import.render import render_toml
from tether.config_import.translate import import_peer_config

VERL = (
    "python3 -m verl.trainer.main_ppo data.train_batch_size=8 actor_rollout_ref.rollout.n=2 "
    "actor_rollout_ref.actor.ppo_mini_batch_size=4 algorithm.adv_estimator=grpo "
)
OPENRLHF = (
    "python3 -m openrlhf.cli.train_ppo_ray --rollout_batch_size 8 --n_samples_per_prompt 4 "
    "--train_batch_size 32 --advantage_estimator group_norm "
)
SLIME = "python3 train.py --rollout-batch-size 8 --n-samples-per-prompt 4 --global-batch-size 32 "


def _import(tmp_path, peer, line):
    script = tmp_path / "run.sh"
    script.write_text(line + "\n")
    result = import_peer_config(peer, script)
    assert result.problems == [], result.problems
    toml = tmp_path / "imported.toml"
    toml.write_text(render_toml(result))
    return result, load_config(config_file=toml, env={}).config


def _note(result, key):
    return next(row.note for row in result.mapping if row.tether_key == key)


def test_verl_filter_groups_gspo_and_rollout_correction(tmp_path):
    r, cfg = _import(
        tmp_path,
        "verl",
        VERL + "algorithm.filter_groups.enable=True algorithm.filter_groups.metric=acc "
        "algorithm.filter_groups.max_num_gen_batches=4 actor_rollout_ref.actor.policy_loss.loss_mode=gspo "
        "actor_rollout_ref.actor.clip_ratio_low=0.0003 actor_rollout_ref.actor.clip_ratio_high=0.0004 "
        "algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_threshold=3.0 "
        "algorithm.rollout_correction.rollout_rs=token_k1,seq_mean_k1 "
        "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0,0.9_1.1 "
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True "
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=64",
    )
    ln = cfg.learner
    assert (ln.dynamic_sampling, ln.filter_equal_reward_groups) == (True, True)
    assert ln.max_extra_prompts_per_cycle == 3 * 8  # (4 − 1) generation batches of 8 prompts
    assert "'acc'" in _note(r, "learner.dynamic_sampling")
    assert (ln.policy_loss, ln.loss_agg, ln.clip_low, ln.clip_high) == (
        "gspo", "seq-mean-token-mean", 0.0003, 0.0004,
    )  # fmt: skip
    assert (ln.off_policy, ln.is_cap) == ("tis", 3.0)
    # verl's "low_high" of a *_k1 option keeps r in [1/high, 1/low]: imported as that range
    assert ln.mismatch_mask_token == [0.5, 2.0]
    assert ln.mismatch_mask_geometric == [1 / 1.1, 1 / 0.9]
    assert "denominator" in _note(r, "learner.mismatch_mask_token")
    assert "[1/1.1, 1/0.9]" in _note(r, "learner.mismatch_mask_geometric")
    assert (ln.is_over_cap, ln.is_cap) == ("truncate", 3.0)  # tis truncates, as verl does
    assert (cfg.scorer.overlong_buffer_tokens, cfg.scorer.overlong_penalty) == (64, 1.0)


def test_verl_cispo_drops_the_dual_clip_and_unlimited_backfill_gets_a_cap(tmp_path):
    r, cfg = _import(
        tmp_path,
        "verl",
        VERL
        + "actor_rollout_ref.actor.policy_loss.loss_mode=cispo actor_rollout_ref.actor.clip_ratio_c=3.0 "
        "algorithm.filter_groups.enable=True algorithm.filter_groups.max_num_gen_batches=0 "
        "algorithm.rollout_correction.rollout_rs=seq_max_k2",
    )
    assert cfg.learner.policy_loss == "cispo" and cfg.learner.dual_clip is None
    assert cfg.learner.max_extra_prompts_per_cycle == 9 * 8
    assert "no limit" in _note(r, "learner.max_extra_prompts_per_cycle")
    reasons = " ".join(why for _, _, why in r.unmapped)
    assert "no dual clip" in reasons and "'seq_max_k2' has no Tether equivalent" in reasons


def test_openrlhf_dynamic_filtering_gspo_and_vllm_is_correction(tmp_path):
    r, cfg = _import(
        tmp_path,
        "openrlhf",
        OPENRLHF + "--dynamic_filtering --dynamic_filtering_reward_range 0 1 "
        "--enable_vllm_is_correction --vllm_is_truncated_threshold 0.5 5.0 "
        "--vllm_is_correction_type icepop --overlong_buffer_len 128 --overlong_penalty_factor 0.5",
    )
    ln = cfg.learner
    assert ln.dynamic_sampling and ln.max_extra_prompts_per_cycle == 16  # derived
    assert "mean reward" in _note(r, "learner.dynamic_sampling")
    assert (ln.off_policy, ln.is_cap, ln.mismatch_mask_token) == ("tis", 5.0, [0.5, 5.0])
    assert (cfg.scorer.overlong_buffer_tokens, cfg.scorer.overlong_penalty) == (128, 0.5)
    _, cfg = _import(
        tmp_path,
        "openrlhf",
        OPENRLHF + "--policy_loss_type gspo --enable_vllm_is_correction",
    )
    # OpenRLHF applies its vLLM correction to the ppo loss only
    assert cfg.learner.policy_loss == "gspo" and cfg.learner.off_policy == "decoupled"


def test_slime_dynamic_sampling_cispo_and_tis(tmp_path):
    r, cfg = _import(
        tmp_path,
        "slime",
        SLIME + "--dynamic-sampling-filter-path "
        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std "
        "--over-sampling-batch-size 16 --advantage-estimator cispo --eps-clip 1.0 "
        "--eps-clip-high 4.0 --use-tis --tis-clip 3.0",
    )
    ln = cfg.learner
    assert ln.dynamic_sampling and ln.advantage_estimator == "grpo"
    assert (ln.policy_loss, ln.clip_low, ln.clip_high) == ("cispo", 1.0, 4.0)
    assert (ln.off_policy, ln.is_cap) == ("tis", 3.0)
    assert "--over-sampling-batch-size" in {key for key, _, _ in r.unmapped}


def test_verl_cispo_example_clip_ratio_low_10_means_no_lower_bound(tmp_path):
    """verl's own CISPO example sets clip_ratio_low=10: its clamp's lower bound 1 − 10 is below
    any ratio, so there is none. Tether's schema writes that as clip_low = 1."""
    r, cfg = _import(
        tmp_path,
        "verl",
        VERL + "actor_rollout_ref.actor.policy_loss.loss_mode=cispo "
        "actor_rollout_ref.actor.clip_ratio_low=10 actor_rollout_ref.actor.clip_ratio_high=0.2",
    )
    assert (cfg.learner.policy_loss, cfg.learner.clip_low, cfg.learner.clip_high) == (
        "cispo", 1.0, 0.2,
    )  # fmt: skip
    assert "≤ 0: none" in _note(r, "learner.clip_low")


def test_verl_bypass_mode_leaves_no_cap_behind(tmp_path):
    _, cfg = _import(
        tmp_path,
        "verl",
        VERL + "algorithm.rollout_correction.rollout_is=token "
        "algorithm.rollout_correction.rollout_is_threshold=2.0 "
        "algorithm.rollout_correction.bypass_mode=True",
    )
    assert (cfg.learner.off_policy, cfg.learner.is_cap) == ("none", None)
