"""`tether bench race` (bench/race.py): the shared settings are real settings of the demo's
config, the reward both arms train on is the scorer's strict one, and the curves and the time
ratio are read the way the module says."""

from __future__ import annotations

import json

import pytest

from bench import race
from common.config.load import load_config
from tether.demo.tasks import ONE_SHOT


def test_the_shared_settings_are_the_demo_configs_own_keys_and_take_effect(tmp_path):
    cfg = load_config(config_file=race.DEMO_CONFIG, overrides=race.TETHER_SETTINGS).config
    assert (cfg.run.prompts_per_cycle, cfg.run.responses_per_prompt) == (race.PROMPTS, race.GROUP)
    assert cfg.run.max_response_tokens == race.MAX_TOKENS
    assert cfg.generator.temperature == race.TEMPERATURE and cfg.learner.lr == race.LR
    # both arms train on every group: TRL has no filter of equal-reward groups
    assert not cfg.learner.filter_equal_reward_groups and not cfg.learner.dynamic_sampling
    assert cfg.learner.std_estimator == "unbiased"  # TRL's group std
    assert cfg.learner.async_checkpoint and cfg.learner.keep_checkpoints >= 1000


def test_both_arms_reward_is_the_scorers_strict_boxed_answer(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(json.dumps({"prompt": [*ONE_SHOT], "answer": "5"}) + "\n")
    scorer = race.reward_scorer(tmp_path / "model", data)
    try:
        got = race.correct(scorer, ["So \\boxed{12}.", "It is 12.", "\\boxed{13}", "\\boxed{3*4}"],
                           ["12", "12", "12", "12"])  # fmt: skip
    finally:
        scorer.pool.close()
    # the demo grades strictly (a boxed answer only), with math-verify: 3*4 is 12
    assert got == [1.0, 0.0, 0.0, 1.0]


def _arm(launched, start, snaps):
    return {"launched": launched, "start": start,
            "snapshots": [{"step": s, "rl_s": t, "dir": f"d{s}"} for s, t in snaps]}  # fmt: skip


def test_curves_start_at_the_base_model_and_stop_at_the_budget():
    evals = {"d2": {"accuracy": 0.3}, "d4": {"accuracy": 0.5}, "d6": {"accuracy": 0.9}}
    arm = _arm(100.0, 130.0, [(2, 50.0), (4, 100.0), (6, 200.0)])
    points = race.curve(arm, evals, {"accuracy": 0.2}, budget_s=150.0)
    assert [p["step"] for p in points] == [0, 2, 4]  # step 6 ended after the budget
    assert [p["accuracy"] for p in points] == [0.2, 0.3, 0.5]
    assert [p["launch_s"] for p in points] == [30.0, 80.0, 130.0]  # + 30 s of start-up


def test_compare_times_each_arm_to_trls_final_accuracy():
    trl = [{"rl_s": 0.0, "launch_s": 10.0, "accuracy": 0.2},
           {"rl_s": 100.0, "launch_s": 110.0, "accuracy": 0.4}]  # fmt: skip
    tether = [{"rl_s": 0.0, "launch_s": 90.0, "accuracy": 0.2},
              {"rl_s": 50.0, "launch_s": 140.0, "accuracy": 0.45},
              {"rl_s": 90.0, "launch_s": 180.0, "accuracy": 0.5}]  # fmt: skip
    got = race.compare(trl, tether)
    assert (got["trl_final"], got["tether_final"]) == (0.4, 0.5)
    assert got["trl_mean_after_base"] == pytest.approx(0.4)
    assert got["tether_mean_after_base"] == pytest.approx(0.475)
    assert got["time_ratio_rl_s"] == pytest.approx(0.5)
    assert got["time_ratio_launch_s"] == pytest.approx(140.0 / 110.0)
    never = race.compare(trl, tether[:1])
    assert never["tether_rl_s_to_trl_final"] is None and never["time_ratio_rl_s"] is None
