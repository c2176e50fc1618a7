"""`tether bench staleness` logic on recorded data: the grid, the overrides of one run, the
summary of a run's step records, the aggregation over seeds, the comparison with the synchronous
baseline, and the README/HTML output. The study itself runs real services for tens of minutes:
`tether bench staleness --quick` runs it, not the test suite."""

from __future__ import annotations

import json

import pytest

from bench import staleness as st
from bench.staleness_report import readme_row, readme_section, write_report


def test_full_grid_is_the_documented_slice():
    arms = st.full_grid()
    names = [a.name for a in arms]
    assert len(names) == len(set(names)) == 14
    assert arms[0] == st.BASELINE and arms[1].name == "S4-ms15-decoupled"  # most telling first
    # synchronous baselines for every S, every correction at every depth at S = 4
    assert {a.steps_per_cycle for a in arms if a.depth == "sync"} == {1, 2, 4, 8}
    at4 = {(a.depth, a.correction) for a in arms if a.steps_per_cycle == 4}
    assert at4 == {(d, c) for d in st.DEPTHS for c in ("decoupled", "tis", "none")}
    assert {a.max_staleness for a in arms if a.steps_per_cycle == 4} == {3, 7, 15}
    assert {"S8-ms31-none", "S8-ms31-decoupled"} < set(names)
    assert set(st.quick_grid()) == {st.BASELINE, *(a for a in arms if a.name in
                                    ("S4-ms15-decoupled", "S4-ms15-none"))}  # fmt: skip


def test_the_medium_grid_holds_what_the_verdict_needs():
    arms = st.focused_grid()
    names = [a.name for a in arms]
    assert len(names) == len(set(names)) == 9 and arms[0] == st.BASELINE
    assert names[1:3] == ["S4-ms7-decoupled", "S4-ms7-none"]  # staleness ≥ 4 at the default
    assert {"S4-ms15-decoupled-cap1", "S4-ms15-decoupled-mask", "S4-ms3-decoupled"} < set(names)
    for arm in arms:  # every arm's settings are real config keys
        assert all("=" in o for o in st.overrides(arm, st.Study(arms=(arm,)), seed=0))


def test_a_new_correction_is_one_entry(monkeypatch):
    monkeypatch.setitem(st.CORRECTIONS, "mask", {"learner.is_over_cap": '"mask"'})
    arms = st.full_grid(tuple(st.CORRECTIONS))
    assert {a.name for a in arms if a.correction == "mask"} == {
        "S4-ms3-mask", "S4-ms7-mask", "S4-ms15-mask"
    }  # fmt: skip
    sets = st.overrides(st.Arm(steps_per_cycle=4, depth="deep", correction="mask"),
                        st.Study(arms=()), seed=1)  # fmt: skip
    assert 'learner.is_over_cap="mask"' in sets
    with pytest.raises(ValueError, match="correction 'masking'"):
        st.Arm(steps_per_cycle=1, depth="sync", correction="masking")


def test_every_run_trains_the_same_responses():
    study = st.Study(arms=tuple(st.full_grid()))
    seen = set()
    for arm in study.arms:
        sets = dict(x.split("=", 1) for x in st.overrides(arm, study, seed=2))
        s = int(sets["run.train_steps_per_cycle"])
        responses = int(sets["run.prompts_per_cycle"]) * st.RESPONSES_PER_PROMPT
        seen.add((responses // s, responses * int(sets["run.num_cycles"])))
        assert int(sets["run.max_staleness"]) == arm.max_staleness
        assert sets["run.seed"] == "2" and sets["learner.checkpoint_every_steps"] == "0"
    assert seen == {(64, 24 * 64)}  # 64 responses per optimizer step, 1536 in all
    with pytest.raises(ValueError, match="not a multiple of S"):
        st.Study(arms=(st.Arm(steps_per_cycle=8, depth="sync", correction="none"),), steps=20)


def _rows(lags_per_step, *, acc=(0.6, 0.9), clip=0.01, capped=0.002):
    rows = [{"kind": "eval", "eval_round": 0, "accuracy": acc[0], "time": 100.0, "seconds": 5.0}]
    for i, lags in enumerate(lags_per_step, start=1):
        rows.append({
            "kind": "step", "step": i, "time": 100.0 + 2 * i, "reward_mean": 0.5 + 0.01 * i,
            "staleness_max": max(lags), "dropped_stale": 0,
            "staleness_counts": [lags.count(k) for k in range(max(lags) + 1)],
            "clip_frac_low": clip, "clip_frac_high": clip, "is_over_cap_frac": capped,
        })  # fmt: skip
    rows.append({"kind": "eval", "eval_round": len(lags_per_step), "accuracy": acc[1],
                 "time": 200.0, "policy_versions": [len(lags_per_step)]})  # fmt: skip
    return rows


def test_summarize_run_pools_the_measured_staleness():
    s = st.summarize_run(_rows([[0, 0, 1], [1, 3, 3]], clip=0.02, capped=0.004))
    assert s["staleness_counts"] == [2, 2, 0, 2]
    assert s["staleness_max"] == 3 and s["staleness_mean"] == pytest.approx(8 / 6)
    assert s["clipped_frac"] == pytest.approx(0.04) and s["is_capped_frac"] == pytest.approx(0.004)
    assert s["final_accuracy"] == 0.9 and s["accuracy_curve"] == [[0, 0.6], [2, 0.9]]
    assert s["reward_curve"] == pytest.approx([0.51, 0.52])
    # an evaluation is placed at the weights that answered it, not the step that asked
    late = _rows([[0], [1]])
    late[-1]["policy_versions"] = [2, 4]
    assert st.summarize_run(late)["accuracy_curve"][-1] == [3.0, 0.9]
    assert s["rl_seconds"] == pytest.approx(104.0 - 100.0)
    # an older record without the distribution counts its largest staleness once
    old = _rows([[2]])
    del old[1]["staleness_counts"]
    assert st.summarize_run(old)["staleness_counts"] == [0, 0, 1]
    with pytest.raises(ValueError, match="no optimizer step"):
        st.summarize_run([r for r in old if r["kind"] == "eval"])


def _run(seed, acc, lags=((0, 1, 3),)):
    s = st.summarize_run(_rows([list(x) for x in lags], acc=(0.6, acc)))
    return {"seed": seed, **s, "wall_s": 60.0 + seed}


def test_aggregate_and_compare():
    deep = st.Arm(steps_per_cycle=4, depth="deep", correction="decoupled")
    bad = st.Arm(steps_per_cycle=4, depth="deep", correction="none")
    lags = ((0, 15, 15), (12, 14, 15))
    configs = [
        st.aggregate(st.BASELINE, [_run(0, 0.90, ((0, 0),)), _run(1, 0.94, ((0, 0),))]),
        st.aggregate(deep, [_run(0, 0.88, lags), _run(1, 0.90, lags)]),
        st.aggregate(bad, [_run(0, 0.60, lags), _run(1, 0.70, lags)]),
    ]
    base, dec, none = configs
    assert base["final_accuracy_mean"] == pytest.approx(0.92)
    assert base["final_accuracy_std"] == pytest.approx(0.0282843, rel=1e-4)  # sample sd
    assert dec["staleness_counts"][15] == 6 and dec["at_bound_frac"] == pytest.approx(0.5)
    assert dec["wall_s_mean"] == pytest.approx(60.5)
    assert dec["accuracy_curve"] == [[0, 0.6], [2, pytest.approx(0.89)]]
    cmp = st.compare(configs)
    assert cmp["ratio_over_baseline"]["S4-ms15-decoupled"] == pytest.approx(0.89 / 0.92)
    assert cmp["worst_at_staleness"]["none"]["ratio"] == pytest.approx(0.65 / 0.92)
    assert cmp["worst_at_staleness"]["tis"] is None
    assert cmp["decoupled_within_tolerance"] is True  # 0.967 ≥ 0.95
    assert st.compare(configs, tolerance=0.01)["decoupled_within_tolerance"] is False
    with pytest.raises(ValueError, match="baseline"):
        st.compare(configs[1:])


def test_readme_and_html_report(tmp_path):
    deep = st.Arm(steps_per_cycle=4, depth="deep", correction="decoupled")
    configs = [st.aggregate(st.BASELINE, [_run(0, 0.9, ((0,),))]),
               st.aggregate(deep, [_run(0, 0.88, ((7, 15),))])]  # fmt: skip
    r = {
        "bench": "staleness", "quick": True, "command": "tether bench staleness --quick",
        "machine": {"load_average": [2.0, 2.0, 2.0], "time": "now"},
        "load_average_after": [3.0, 2.0, 2.0], "wall_seconds": 400.0,
        "study": st.Study(arms=(st.BASELINE, deep), seeds=(0,)).describe(),
        "configurations": configs, "comparison": st.compare(configs),
    }  # fmt: skip
    out = tmp_path / "staleness_quick.json"
    out.write_text(json.dumps(r))
    paths = write_report(r, out)
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    page = paths["html"].read_text()
    assert "S4-ms15-decoupled" in page and "data:image/png;base64," in page
    assert "decoupled/sync **0.98**" in readme_row(r)
    section = readme_section(tmp_path)
    assert "| S4-ms15-decoupled | 4 | 15 | decoupled | 0.880 ± 0.000 | 0.978 |" in section
    assert "decoupled PPO is within 5% of synchronous training" in section


def test_the_bench_runs_seed_by_seed_and_writes_its_outputs(tmp_path, monkeypatch):
    """The orchestration with a FAKE run (a stand-in for `tether train`, which takes minutes)
    and fake assets (no warm-up): order of runs, the partial file, JSON, PNG and HTML."""
    import tether.demo.run as demo_run

    order, partials = [], []
    out = tmp_path / "results" / "staleness_x.json"

    def fake_run(arm, study, *, seed, root, assets, threads):
        order.append((arm.name, seed))
        if out.with_suffix(".partial").exists():
            partials.append(
                len(json.loads(out.with_suffix(".partial").read_text())["configurations"])
            )
        acc = 0.9 if arm.correction == "decoupled" else 0.5
        return _run(seed, acc, ((arm.max_staleness,),))

    class Assets:
        warmup_report = {"reused": True}

    monkeypatch.setattr(st, "run_one", fake_run)
    monkeypatch.setattr(demo_run, "prepare_assets", lambda root, seed: Assets())
    study = st.Study(arms=tuple(st.quick_grid()), seeds=(0, 1))
    r = st.run_staleness_bench(out_path=out, work_dir=tmp_path, study=study)
    assert order == [(a.name, s) for s in (0, 1) for a in study.arms]
    assert partials == [1, 2, 3, 3, 3]  # every configuration once before any twice
    assert not out.with_suffix(".partial").exists()
    assert (
        json.loads(out.read_text())["comparison"]["worst_at_staleness"]["none"]["ratio"]
        == 0.5 / 0.9
    )
    assert out.with_suffix(".png").exists() and out.with_suffix(".html").exists()
    assert [c["seeds"] for c in r["configurations"]] == [[0, 1]] * 3


def test_the_learning_rate_is_a_setting_of_the_study(tmp_path, monkeypatch):
    """`tether bench staleness --lr` runs the grid at that lr, says so in the command it records,
    and writes its own file beside the default study's."""
    import tether.demo.run as demo_run
    from bench import runner

    seen = []

    def fake_run(arm, study, *, seed, root, assets, threads):
        seen.append(study.lr)
        assert f"learner.lr={study.lr!r}" in st.overrides(arm, study, seed=seed)
        return _run(seed, 0.9, ((arm.max_staleness,),))

    class Assets:
        warmup_report = {"reused": True}

    monkeypatch.setattr(st, "run_one", fake_run)
    monkeypatch.setattr(demo_run, "prepare_assets", lambda root, seed: Assets())
    r = runner.run_one(
        "staleness", out_dir=tmp_path, quick=True, work_dir=tmp_path, size="quick", lr=1e-4
    )
    assert seen == [1e-4] * 3
    assert r is not None and r["command"] == "tether bench staleness --quick --lr 0.0001"
    assert (tmp_path / "staleness_quick_lr0.0001.json").exists()


def test_a_study_without_the_synchronous_baseline_is_refused_before_any_run(tmp_path):
    deep = st.Arm(steps_per_cycle=4, depth="deep", correction="none")
    with pytest.raises(ValueError, match="needs the synchronous baseline S1-ms0-decoupled"):
        st.run_staleness_bench(out_path=tmp_path / "x.json", study=st.Study(arms=(deep,)))
