"""Every result under bench/results came from code and says where from: the git commit and
whether the tree was clean, the command, the machine and its load; and the figures a result
computes from its own raw records are what its benchmark's ``derive`` computes (a hand edit of a
summary, a verdict, a ratio or a total fails here). Results written before stamping are kept,
uncited, under bench/results/unstamped/ and bench/results/superseded/."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from bench import staleness
from bench.derived import check
from bench.results_md import TABLE_BEGIN, TABLE_END, readme_table, write_readme
from bench.staleness_design import PREREGISTERED, Study, grid
from tests.paths import REPO
from tests.unit.test_bench_staleness import _run

RESULTS = REPO / "bench" / "results"
HISTORY = ("unstamped", "superseded")  # kept for history; no table or claim reads them
RAW = ("staleness_runs",)  # raw records a result is computed from (each stamped by its run)

# results stamped with their commit before the runner also stamped the command and the machine:
# rerun them (`tether bench NAME`) and drop them from this list
WITHOUT_COMMAND = {
    "episodes.json": "episodes (2fbe593)",
    "lora.json": "lora (dd7d8fc)",
    "memory.json": "memory (b95404e)",
    "reproducibility.json": "reproducibility (0aa688e)",
    "memory_lora.json": "memory --size lora (64922da, dirty, load 19.7)",
    "memory_scale.json": "memory --size scale (14e50bf)",
}


def cited_results() -> list[Path]:
    return sorted(
        p for p in RESULTS.rglob("*.json")
        if not any(part in HISTORY + RAW for part in p.relative_to(RESULTS).parts)
    )  # fmt: skip


def git_of(r: dict) -> dict:
    g = r.get("git")
    if isinstance(g, dict):
        return g
    return {"commit": r.get("git_commit"), "dirty": r.get("git_dirty")}


@pytest.mark.parametrize("path", cited_results(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_cited_result_records_its_commit_command_and_machine(path):
    r = json.loads(path.read_text())
    g = git_of(r)
    assert re.fullmatch(r"[0-9a-f]{40}", g.get("commit") or ""), (
        f"{path.name}: no git commit recorded; results are written by `tether bench`, which "
        "stamps it (bench/provenance.py). Rerun it, or move the file to bench/results/unstamped/"
    )
    assert isinstance(g.get("dirty"), bool), f"{path.name}: whether the tree was clean"
    if path.name in WITHOUT_COMMAND:
        return
    assert isinstance(r.get("command"), str) and r["command"].startswith("tether "), path.name
    load = (r.get("machine") or {}).get("load_average")
    assert isinstance(load, list) and len(load) == 3, f"{path.name}: the machine's load average"


@pytest.mark.parametrize("path", cited_results(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_what_a_result_computes_from_its_records_is_what_its_code_computes(path):
    assert check(json.loads(path.read_text())) == []


def test_the_unstamped_history_is_documented():
    readme = (RESULTS / "unstamped" / "README.md").read_text()
    for p in (RESULTS / "unstamped").rglob("*.json"):
        assert p.name in readme, p


def _one(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def test_a_hand_edited_result_is_caught():
    """Edited copies of committed results: a verdict, a ratio, a field no code writes."""
    r = copy.deepcopy(_one("staleness_lr5e-06.json"))
    assert check(r) == []
    r["verdicts"]["S4"]["non_inferiority"]["verdict"] = "fails"
    assert any("verdict" in d for d in check(r))
    r = copy.deepcopy(_one("staleness_lr5e-06.json"))
    r["made"]["note"] = "made in two sittings"
    assert check(r) == [".made.note: no code writes it"]
    r = copy.deepcopy(_one("staleness_lr5e-06.json"))
    r["arms"]["S4-eta4-none"]["auc"]["3"] += 0.01  # a raw number: the verdicts move with it
    assert check(r)
    m = copy.deepcopy(_one("memory.json"))
    m["ratio_peak_rss"] = 0.5
    assert check(m) == [f".ratio_peak_rss: 0.5 != {_one('memory.json')['ratio_peak_rss']!r}"]
    lo = copy.deepcopy(_one("lora.json"))
    lo["lora"]["step_seconds_median"] *= 0.9
    assert any("step_seconds_median_lora_over_full" in d for d in check(lo))


def test_a_staleness_result_is_recomputed_from_its_runs(tmp_path):
    """The study's runs are kept beside its JSON (``made.runs_dir``): arms, verdicts,
    exploratory rows and the totals of ``made`` are all recomputed from them."""
    study = Study(arms=tuple(grid()), seeds=(0, 1, 2), steps=8, eval_every=4)
    runs = [
        _run(arm, seed, [0.6, 0.7 + 0.01 * seed - 0.02 * arm.eta * (arm.label == "none"), 0.75])
        for seed in study.seeds for arm in study.arms
    ]  # fmt: skip
    runs_dir = tmp_path / "staleness_runs" / "abc"
    runs_dir.mkdir(parents=True)
    for run in runs:
        (runs_dir / f"{run['arm']}-seed{run['seed']}.json").write_text(json.dumps(run))
    got = staleness.derive(staleness.load_runs(runs_dir))
    made = {"runs_dir": str(runs_dir), "run_seconds": 1.0, "runs_reused": 0, **got["totals"]}
    result = json.loads(json.dumps({
        "bench": "staleness", "preregistered": PREREGISTERED, "made": made,
        "arms": got["arms"], "verdicts": got["verdicts"], "exploratory": got["exploratory"],
    }))  # fmt: skip
    assert check(result) == []
    edited = copy.deepcopy(result)
    edited["made"]["cpu_seconds_total"] += 100.0
    assert check(edited) == [
        f".made.cpu_seconds_total: {edited['made']['cpu_seconds_total']!r} != "
        f"{result['made']['cpu_seconds_total']!r}"
    ]
    edited = copy.deepcopy(result)
    edited["arms"]["S4-eta4-none"]["auc_mean"] += 0.01
    assert check(edited) == [
        f".arms.S4-eta4-none.auc_mean: {edited['arms']['S4-eta4-none']['auc_mean']!r} != "
        f"{result['arms']['S4-eta4-none']['auc_mean']!r}"
    ]
    one = runs_dir / "S4-eta4-none-seed1.json"
    run = json.loads(one.read_text())
    run["evals"][-1][1] += 0.05  # a raw record changed: the summaries no longer follow from it
    one.write_text(json.dumps(run))
    assert any(d.startswith(".arms.S4-eta4-none") for d in check(result))
    one.unlink()  # a run gone: the count says so
    assert f".made.runs: {len(runs)} != {len(runs) - 1}" in check(result)


def test_the_readme_benchmark_table_is_the_one_the_results_give():
    readme = (REPO / "README.md").read_text()
    start, end = readme.index(TABLE_BEGIN), readme.index(TABLE_END) + len(TABLE_END)
    assert readme[start:end] == readme_table(RESULTS), (
        "regenerate with: python -m bench.results_md --write README.md"
    )


def test_the_bench_readme_is_the_one_the_results_give(tmp_path):
    got = write_readme(RESULTS, tmp_path / "README.md").read_text()
    assert got == (REPO / "bench" / "README.md").read_text(), (
        "regenerate with: tether bench (or bench.results_md.write_readme)"
    )
