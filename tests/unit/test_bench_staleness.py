"""`tether bench staleness`: the pre-registered design (arms, lag, the config each arm runs),
the statistics against numbers worked by hand, and the write-up generated from a result. Real
runs of the learner's code at a toy size are in tests/services/test_bench_staleness_run.py; the
study itself is a benchmark (`tether bench staleness`), not a test."""

from __future__ import annotations

import json
import math

import pytest

from bench import staleness_stats as ss
from bench.staleness_design import AA_LABEL, PREREGISTERED, SIZES, Arm, Study, grid
from bench.staleness_report import (
    CLAIM_BEGIN,
    CLAIM_END,
    RESULT,
    readme_claim,
    readme_row,
    readme_section,
    verdict_lines,
)
from tests.paths import REPO


def test_the_full_grid_is_the_issues_grid_and_fits_its_size():
    arms = grid()
    names = [a.name for a in arms]
    assert len(names) == len(set(names)) == 21
    for s in (1, 4):
        mine = [a for a in arms if a.steps_per_cycle == s and a.replicate == 0]
        assert mine[0].name == f"S{s}-eta0-sync"  # the baseline first, then the deepest lag
        lagged = {(a.eta, a.label) for a in mine if a.eta}
        assert lagged == {(e, c) for e in (1, 2, 4) for c in ("none", "decoupled", "tis")}
    (aa,) = [a for a in arms if a.replicate]  # one arm run twice: decoupled, η = 4, S = 4
    assert (aa.label, aa.correction, aa.eta, aa.steps_per_cycle) == (AA_LABEL, "decoupled", 4, 4)
    study = SIZES["full"]()
    assert len(study.seeds) >= 8 and study.steps >= 100 and study.held_out >= 1000
    assert study.steps % study.eval_every == 0 and study.steps // study.eval_every >= 5
    # staleness in optimizer steps of a lagged step: η·S … η·S + S − 1
    assert Arm(correction="decoupled", eta=4, steps_per_cycle=4).staleness_steps == (16, 19)
    assert Arm(correction="none", eta=2, steps_per_cycle=1).staleness_steps == (2, 2)


def test_the_s4_size_is_the_tests_and_every_s4_arm():
    tests = {a.name for a in SIZES["tests"]().arms}
    s4 = [a.name for a in SIZES["s4"]().arms]
    assert len(s4) == len(set(s4)) == 14 and tests <= set(s4)
    assert set(s4) - tests == {
        f"S4-eta{e}-{c}" for e in (1, 2) for c in ("none", "decoupled", "tis")
    } | {"S4-eta4-tis"}
    assert SIZES["s4"]().seeds == SIZES["full"]().seeds


def test_bad_arms_and_sizes_are_refused():
    with pytest.raises(ValueError, match="η = 0 is the synchronous arm"):
        Arm(correction="decoupled", eta=0, steps_per_cycle=1)
    with pytest.raises(ValueError, match="correction 'ppo'"):
        Arm(correction="ppo", eta=1, steps_per_cycle=1)
    with pytest.raises(ValueError, match="multiple of S"):
        Study(arms=(Arm(correction="sync", eta=0, steps_per_cycle=4),), steps=10)


def test_each_arm_runs_the_learner_config_it_names(tmp_path):
    from bench.staleness_run import arm_config  # noqa: PLC0415 - loads torch

    study = SIZES["full"]()
    (tmp_path / "m").mkdir()
    for arm in study.arms:
        cfg = arm_config(arm, study, seed=3, model_dir=tmp_path / "m", train_path=tmp_path / "t")
        s = arm.steps_per_cycle
        assert cfg.run.train_steps_per_cycle == s and cfg.run.train_batch_size == 64
        assert cfg.run.num_cycles * s == study.steps and cfg.run.seed == 3
        assert cfg.run.max_staleness == (arm.staleness_steps[1] if arm.eta else s - 1)
        assert cfg.learner.off_policy == arm.off_policy and cfg.learner.lr == study.lr
        if arm.correction == "decoupled":  # AReaL's rule; tis truncates
            assert (cfg.learner.is_cap, cfg.learner.is_over_cap) == (5.0, "mask")
        if arm.correction == "tis":
            assert (cfg.learner.is_cap, cfg.learner.is_over_cap) == (2.0, "truncate")


def test_auc_is_the_mean_of_the_curve_over_its_steps():
    # trapezoids: (0.5 + 0.7) / 2 · 4 + (0.7 + 0.9) / 2 · 4 = 5.6 over 8 steps = 0.7
    assert ss.auc([[0, 0.5], [4, 0.7], [8, 0.9]]) == pytest.approx(0.7)
    assert ss.auc([[8, 0.9], [0, 0.5], [4, 0.7]]) == pytest.approx(0.7)  # any order
    with pytest.raises(ValueError):
        ss.auc([[0, 0.5]])


def test_paired_interval_and_exact_sign_flip_p_by_hand():
    a = {0: 0.70, 1: 0.62, 2: 0.66, 3: 0.71}
    b = {0: 0.60, 1: 0.60, 2: 0.60, 3: 0.60}
    got = ss.paired(a, b)
    d = [0.10, 0.02, 0.06, 0.11]
    mean = sum(d) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 3)
    half = 3.182 * sd / 2  # t(0.975, 3) · sd / √4
    assert got["diff"] == pytest.approx(mean)
    assert got["ci"] == pytest.approx([mean - half, mean + half])
    assert got["relative"] == pytest.approx(mean / 0.60)
    # all four differences positive: only the all-plus and all-minus patterns reach |sum|
    assert got["p_sign_flip"] == pytest.approx(2 / 16)
    assert ss.sign_flip_p([0.1, -0.1]) == 1.0


def test_non_inferiority_holds_fails_or_stays_open():
    sync = {s: 0.80 for s in range(8)}
    close = {s: 0.80 + (0.01 if s % 2 else -0.01) for s in range(8)}  # ±1 %: inside 5 %
    far = {s: 0.60 + (0.01 if s % 2 else -0.01) for s in range(8)}  # −25 %
    noisy = {s: 0.80 + (0.2 if s % 2 else -0.2) for s in range(8)}  # an interval wider than 5 %
    assert ss.non_inferiority(close, sync, margin=0.05)["verdict"] == "holds"
    assert ss.non_inferiority(far, sync, margin=0.05)["verdict"] == "fails"
    assert ss.non_inferiority(noisy, sync, margin=0.05)["verdict"] == "open"


def _run(arm: Arm, seed: int, accs: list[float]) -> dict:
    return {
        "arm": arm.name, "label": arm.label, "correction": arm.correction, "eta": arm.eta,
        "steps_per_cycle": arm.steps_per_cycle, "replicate": arm.replicate, "seed": seed,
        "evals": [[4 * i, x] for i, x in enumerate(accs)], "seconds": 10.0,
        "steps": [{"kl_behaviour_learner": 0.01 * arm.eta, "is_over_5_frac": 0.0, "ess_frac": 1.0}] * 8,
    }  # fmt: skip


def _result(tmp_path) -> dict:
    study = Study(arms=tuple(grid(steps_per_cycle=(1,))), seeds=(0, 1, 2), steps=8, eval_every=4)
    prereg = {
        **PREREGISTERED,
        "non_inferiority": {**PREREGISTERED["non_inferiority"], "steps_per_cycle": [1]},
        "aa_control": {**PREREGISTERED["aa_control"], "steps_per_cycle": 1},
    }
    runs = []
    for seed in study.seeds:
        for arm in study.arms:
            level = 0.8 - 0.02 * arm.eta * (arm.correction == "none") + 0.001 * seed
            runs.append(_run(arm, seed, [0.6, level, level + 0.05 * (seed % 2)]))
    arms = ss.per_arm(runs)
    return {
        "bench": "staleness", "command": "tether bench staleness", "size": "full",
        "machine": {"load_average": [0.5, 0.5, 0.5]}, "git": {"commit": "abc123def456", "dirty": False},
        "study": study.describe(), "preregistered": PREREGISTERED,
        "made": {"run_seconds": 120.0}, "arms": arms,
        "verdicts": ss.verdicts(arms, prereg),
        "exploratory": ss.exploratory(arms),
    }  # fmt: skip


def test_the_verdicts_and_the_write_up_come_from_the_runs(tmp_path):
    r = _result(tmp_path)
    v = r["verdicts"]["S1"]
    assert v["non_inferiority"]["verdict"] == "holds"  # decoupled = sync at every seed
    assert r["verdicts"]["aa_control"]["equal_within_interval"] and r["verdicts"]["resolvable"]
    # AUC = (0.6 + 3·level + δ) / 4 over steps 0, 4, 8: a level 0.08 lower costs 3 · 0.08 / 4
    assert v["decoupled_vs_none"]["diff"] == pytest.approx(3 * 0.08 / 4)
    assert r["arms"]["S1-eta4-none"]["diagnostics"]["kl_behaviour_learner"][0] == pytest.approx(
        0.04
    )
    (tmp_path / "staleness.json").write_text(json.dumps(r))
    section = readme_section(tmp_path)
    assert "What it does not measure" in section and "non-inferiority at −5 %: **holds**" in section
    assert "| decoupled | 1 | 4 | 4–4 |" in section
    assert "holds" in readme_row(r) and "`tether bench staleness`" in readme_row(r)
    claim = readme_claim(tmp_path / "staleness.json")
    assert claim.startswith(CLAIM_BEGIN) and claim.endswith(CLAIM_END) and "A/A" in claim
    assert "Not measured" in readme_claim(tmp_path / "absent.json")


def test_a_failed_aa_control_resolves_nothing(tmp_path):
    """The A/A pair differing (or absent) turns every non-inferiority verdict into "cannot
    resolve", and the write-up says so; the same result with the A/A pair equal says "holds"."""
    r = _result(tmp_path)
    assert r["verdicts"]["S1"]["non_inferiority"]["verdict"] == "holds"
    prereg = {
        **PREREGISTERED,
        "non_inferiority": {**PREREGISTERED["non_inferiority"], "steps_per_cycle": [1]},
        "aa_control": {**PREREGISTERED["aa_control"], "steps_per_cycle": 1},
    }
    arms = json.loads(json.dumps(r["arms"]))
    arms = {n: {**a, "auc": {int(s): v for s, v in a["auc"].items()}} for n, a in arms.items()}
    aa = arms[f"S1-eta4-{AA_LABEL}"]
    aa["auc"] = {s: v + 0.05 + 0.001 * s for s, v in aa["auc"].items()}  # a real difference
    v = ss.verdicts(arms, prereg)
    assert v["resolvable"] is False and not v["aa_control"]["equal_within_interval"]
    assert v["S1"]["non_inferiority"]["verdict"] == "cannot resolve"
    lines = "\n".join(verdict_lines({**r, "verdicts": v}))
    assert "NOT equal: the study cannot resolve the question" in lines
    assert "**cannot resolve**" in lines and "**holds**" not in lines
    del arms[f"S1-eta4-{AA_LABEL}"]  # no A/A control at all
    v = ss.verdicts(arms, prereg)
    assert v["S1"]["non_inferiority"]["verdict"] == "cannot resolve"
    assert "A/A control: not run" in "\n".join(verdict_lines({**r, "verdicts": v}))


def test_each_arm_records_how_off_policy_it_was():
    arm = Arm(correction="none", eta=4, steps_per_cycle=1)
    runs = [_run(arm, seed, [0.6, 0.7, 0.8]) for seed in range(3)]
    runs[2]["steps"] = [dict(st) for st in runs[2]["steps"]]
    runs[2]["steps"][5] = {**runs[2]["steps"][5], "kl_behaviour_learner": 0.5}
    o = ss.per_arm(runs)[arm.name]["off_policy"]["kl_behaviour_learner"]
    assert o["max"] == 0.5 and o["max_seed"] == 2
    assert o["mean"] == pytest.approx((0.04 * 23 + 0.5) / 24)


def test_the_readme_claim_is_the_one_the_committed_result_gives():
    readme = (REPO / "README.md").read_text()
    start, end = readme.index(CLAIM_BEGIN), readme.index(CLAIM_END) + len(CLAIM_END)
    assert readme[start:end] == readme_claim(RESULT), (
        "regenerate with: python -m bench.staleness_report --write README.md"
    )
