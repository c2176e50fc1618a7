"""`tether bench race` (bench/race.py): the shared settings are real settings of the demo's
config, the reward both arms train on is the scorer's strict one, and the curves and the time
ratio are read the way the module says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import race, race_report
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


def _runs(*pairs):
    return [{"seed": i, "tether_mean_after_base": te, "trl_mean_after_base": tr}
            for i, (te, tr) in enumerate(pairs)]  # fmt: skip


def test_a_difference_is_claimed_only_with_an_interval_clear_of_zero_and_a_smaller_control():
    steady = _runs((0.50, 0.40), (0.52, 0.41), (0.49, 0.40))  # Tether ahead by about 0.1
    got = race.noise(steady, {"difference": 0.01})
    assert got["diff"] == pytest.approx(0.1, abs=1e-9) and got["ci"][0] > 0
    assert got["verdict"] == "Tether ahead"
    # the same arm twice differs by as much as the arms do: the difference is the machine's noise
    assert race.noise(steady, {"difference": -0.12})["verdict"].startswith("cannot tell")
    assert (
        race.noise(steady, None)["verdict"]
        == "cannot tell: no control (the same arm twice) was run"
    )
    # the two seeds of bench/results/race.json at 7fcac66: opposite signs, the interval holds 0
    mixed = race.noise(_runs((0.377, 0.417), (0.469, 0.426)), {"difference": 0.0})
    assert mixed["ci"][0] < 0 < mixed["ci"][1] and "contains 0" in mixed["verdict"]
    assert race.noise(_runs((0.5, 0.4)), None)["verdict"] == "cannot tell: fewer than two seeds"


def test_a_control_run_and_a_seed_run_are_told_apart_in_the_work_directory(tmp_path):
    for name in ("s1-100", "control-s1-200", "s11-300"):
        (tmp_path / name).mkdir()
        for f in ("arms.json", "evals.json"):
            (tmp_path / name / f).write_text("{}")
    assert race.finished(tmp_path, 1) == tmp_path / "s1-100"
    assert race.finished(tmp_path, 1, prefix="control-") == tmp_path / "control-s1-200"
    assert race.finished(tmp_path, 2, prefix="control-") is None


def test_the_report_shows_the_control_and_the_verdict(tmp_path):
    pts = [{"step": 0, "rl_s": 0.0, "launch_s": 9.0, "accuracy": 0.2},
           {"step": 2, "rl_s": 60.0, "launch_s": 69.0, "accuracy": 0.4}]  # fmt: skip
    run = {"seed": 0, "curves": {"trl": pts, "tether": pts}, **race.compare(pts, pts),
           "startup_s": {"trl": 9.0, "tether": 70.0}, "steps_in_budget": {"trl": 2, "tether": 2},
           "load_average": {"trl_before": [1.0]}}  # fmt: skip
    control = {"seed": 0, "curve": pts, "final": 0.4, "mean_after_base": 0.4, "first_final": 0.4,
               "first_mean_after_base": 0.4, "difference": 0.0, "base_accuracy": 0.2,
               "startup_s": 70.0, "steps_in_budget": 2}  # fmt: skip
    r = {"settings": {"budget_s": 600.0, "snapshot_every_steps": 2}, "runs": [run, {**run, "seed": 1}],
         "control": control, "noise": race.noise([run, {**run, "seed": 1}], control),
         "command": "tether bench race --seeds 0,1", "machine": {"load_average": [1.0]}}  # fmt: skip
    (tmp_path / "race.json").write_text(json.dumps(r))
    text = race_report.format_race(r)
    assert "control: Tether's arm run again on seed 0" in text and "Verdict: cannot tell" in text
    section = race_report.readme_section(tmp_path)
    assert "| 0 | Tether, again (control) | 70 | 2 |" in section
    assert race_report.write_plot(r, tmp_path / "race.json").exists()


def test_a_sitting_is_run_once_scored_then_its_snapshots_deleted_and_reused(tmp_path, monkeypatch):
    """``run_or_reuse``, shared by the seeds and the control: the evaluator and the arms are
    fakes here (each is a whole model run); the bookkeeping around them is the real code."""
    scored: list[list[str]] = []

    def fake_evaluate(base, dirs, eval_path, work, *, timeout_s):
        scored.append(list(dirs))
        rows = [{"dir": d, "accuracy": 0.5} for d in [str(base), *dirs]]
        (work / "evals.json").write_text(json.dumps(rows))
        return {r["dir"]: r for r in rows}

    def run_arms(work):
        snaps = []
        for step in (2, 4):
            (work / "tether" / f"snap{step}").mkdir(parents=True)
            snaps.append(
                {"step": step, "rl_s": 10.0 * step, "dir": str(work / "tether" / f"snap{step}")}
            )
        return {"tether": {"snapshots": snaps}}, {"before": [1.0], "after": [2.0]}

    monkeypatch.setattr(race, "evaluate", fake_evaluate)
    monkeypatch.setattr(race, "git_state", lambda: {"commit": "abc", "dirty": False})
    base = tmp_path / "model"
    arms, evals, made = race.run_or_reuse(tmp_path, 3, "control-", base, tmp_path / "eval.jsonl",
                                          run_arms, timeout_s=1.0)  # fmt: skip
    work = race.finished(tmp_path, 3, prefix="control-")
    assert work is not None and work.name.startswith("control-s3-")
    assert made == {"made_at": {"commit": "abc", "dirty": False},
                    "load_average": {"before": [1.0], "after": [2.0]}}  # fmt: skip
    dirs = [s["dir"] for s in arms["tether"]["snapshots"]]
    assert scored == [dirs] and set(evals) == {str(base), *dirs}
    assert not any(Path(d).exists() for d in dirs)  # scored, then deleted

    def must_not_run(work):
        raise AssertionError("a finished sitting is reused, not run again")

    again = race.run_or_reuse(tmp_path, 3, "control-", base, tmp_path / "eval.jsonl",
                              must_not_run, timeout_s=1.0)  # fmt: skip
    assert again[0] == arms and again[1] == evals and scored == [dirs]
    assert again[2] == {"reused_from": str(work), **made}
    assert race.finished(tmp_path, 3) is None  # the control is not seed 3's own run
