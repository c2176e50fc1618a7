"""`tether bench demos` (``bench.demos``) and the README's demo tables generated from its files
(``bench.demos_report``): which command each kind runs, which earlier runs a file keeps, what a
table shows, and that README.md holds exactly the tables the committed results give."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from bench.demos import KINDS, SEEDS, demo_command, merge
from bench.demos_report import RESULTS, begin, end, table, write_tables
from bench.provenance import CLONE
from bench.runner import ORDER
from tether.cli.tool_verbs import BENCHMARKS, DEMO_KINDS, _seeds

CLEAN = {"commit": "a" * 40, "dirty": False}


def test_the_cli_offers_every_kind_and_the_runner_every_benchmark():
    assert DEMO_KINDS == tuple(KINDS) and BENCHMARKS == ORDER
    assert _seeds("3,4,5") == (3, 4, 5)
    for bad in ("", "1,1", "-1", "a"):
        with pytest.raises(Exception, match="distinct seeds"):
            _seeds(bad)
    assert SEEDS["tools"] == (0, 1, 2, 3, 4, 5)  # the untuned seeds 3, 4, 5 with 0, 1, 2


def test_each_kind_runs_its_demo_and_shares_the_warm_up_of_its_preset(tmp_path):
    def args(kind: str) -> list[str]:
        cmd = demo_command(kind, 4, root=tmp_path, quick=False)
        assert cmd[1:4] == ["-m", "tether.cli", "demo"]
        return cmd[4:]

    agent = args("tools-agent")
    assert agent[:3] == ["--task", "tools", "--agent"]
    assert ["--set", "run.seed=4"] == agent[agent.index("run.seed=4") - 1 :][:2]
    assert '--set run.name="tools-agent-s4"' in " ".join(agent)
    assets = agent[agent.index("--assets") + 1]
    assert (
        assets
        == args("tools")[args("tools").index("--assets") + 1]
        == str(tmp_path / "assets" / "tools-s4")
    )
    lora = args("arithmetic-lora")
    assert "learner.lora_rank=16" in lora and "learner.lr=5e-4" in lora
    assert lora[lora.index("--assets") + 1] == str(tmp_path / "assets" / "demo-s4")
    assert "--num-cycles" in demo_command("tools", 0, root=tmp_path, quick=True)
    real = args("smollm2")
    assert real[:2] == ["--task", "smollm2"]
    assert real[real.index("--assets") + 1] == str(tmp_path / "assets" / "smollm2-s4")


def test_a_file_keeps_earlier_seeds_only_from_the_same_clean_commit():
    previous = {"kind": "tools", "git": CLEAN, "runs": [{"seed": 0}], "sittings": [{"seeds": [0]}]}
    assert merge(previous, CLEAN) == ([{"seed": 0}], [{"seeds": [0]}])
    assert merge(previous, {"commit": "b" * 40, "dirty": False}) == ([], [])
    assert merge(previous, {**CLEAN, "dirty": True}) == ([], [])
    assert merge({**previous, "git": {**CLEAN, "dirty": True}}, CLEAN) == ([], [])
    assert merge(None, CLEAN) == ([], [])


def _run(seed: int, *, kind: str, accs: list[float], git=CLEAN) -> dict:
    tools = kind.startswith("tools")
    return {
        "kind": kind, "seed": seed, "git": git, "config_digest": "0123456789abcdef",
        "evals": [{"round": 12 * i, "accuracy": a, "n": 200} for i, a in enumerate(accs)],
        "steps": [{"step": s, "reward_mean": s / 10, **({"tool_call_rate": s / 20} if tools else {})}
                  for s in range(1, 7)],
        "warmup": {"steps": 425, "reused": seed == 1, **({"first_steps": 325, "first_exact": 0.92} if tools else {})},
        "seconds": {"assets": 1.2, "warmup": 300.4, "rl": 170.6, "total": 472.2},
        "load_average": {"before": [1.5, 1, 1], "before_rl": [2, 1, 1], "after": [3.25, 2, 1]},
        "machine": {"cpu": "AMD EPYC", "cpus": 2},
    }  # fmt: skip


def _doc(kind: str, runs: list[dict], git=CLEAN) -> dict:
    return {"bench": "demos", "kind": kind, "quick": False, "git": git,
            "seeds": [r["seed"] for r in runs], "sittings": [], "runs": runs}  # fmt: skip


def _write(results: Path, doc: dict) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{doc['kind']}.json").write_text(json.dumps(doc))


def test_a_table_shows_every_round_the_tool_use_the_wall_time_and_the_untuned_seeds(tmp_path):
    assert "Not measured: `tether bench demos --kind tools --seeds 0,1,2,3,4,5`" in table(
        "tools", tmp_path
    )
    runs = [_run(s, kind="tools", accs=[0.0, 0.75, 0.8]) for s in (0, 1, 3)]
    _write(tmp_path, _doc("tools", runs))
    text = table("tools", tmp_path)
    lines = text.splitlines()
    assert lines[0] == begin("tools") and lines[-1] == end("tools")
    assert "`tether bench demos --kind tools --seeds 0,1,3`" in lines[1]
    assert "commit aaaaaaa," in lines[1] and "load average 1.5–3.2" in lines[1]
    header = next(x for x in lines if x.startswith("| seed"))
    assert header == (
        "| seed | recipe tuned on it | careful-stage steps (exact at its last check) | before RL (v0) | v12 | after RL (v24)"
        " | gain | tool-call rate, first → last 3 steps | reward, first → last 3 steps"
        " | wall time: assets + warm-up, RL |"
    )
    rows = [
        x for x in lines if x.startswith("| 0 ") or x.startswith("| 1 ") or x.startswith("| 3 ")
    ]
    assert rows[0] == ("| 0 | yes | 325 (92 %) | 0.000 | 0.750 | **0.800** | +0.800 | 0.10 → 0.25 "
                       "| 0.20 → 0.50 | 302 s + 171 s |")  # fmt: skip
    assert "302 s (reused) + 171 s" in rows[1] and rows[2].startswith("| 3 | no |")
    assert "Mean after RL over 3 seeds: 0.800" in text


def test_a_comparison_between_tables_is_made_at_one_commit_only(tmp_path):
    full = _doc("arithmetic", [_run(s, kind="arithmetic", accs=[0.6, 0.9, 0.95]) for s in (0, 1)])
    lora = _doc("arithmetic-lora",
                [_run(s, kind="arithmetic-lora", accs=[0.6, 0.9, 0.97]) for s in (0, 1)])  # fmt: skip
    _write(tmp_path, full)
    _write(tmp_path, lora)
    text = table("arithmetic-lora", tmp_path)
    assert "full fine-tuning after RL |" in text
    assert next(x for x in text.splitlines() if x.startswith("| 0 ")).endswith("| 0.950 |")
    other = copy.deepcopy(full)
    other["git"] = {"commit": "b" * 40, "dirty": False}
    _write(tmp_path, other)
    text = table("arithmetic-lora", tmp_path)
    assert "full fine-tuning after RL" not in text
    assert "are of commit bbbbbbb: not compared" in text


def test_write_tables_replaces_each_block_and_nothing_else(tmp_path):
    readme = tmp_path / "README.md"
    blocks = "\n\n".join(f"{begin(k)}\nold {k}\n{end(k)}" for k in KINDS)
    readme.write_text(f"# Title\n\n{blocks}\n\ntail\n")
    write_tables(readme, tmp_path / "results")
    text = readme.read_text()
    assert text.startswith("# Title\n\n") and text.endswith("\n\ntail\n") and "old " not in text
    assert all(table(k, tmp_path / "results") in text for k in KINDS)


def test_the_readme_tables_are_the_ones_the_committed_results_give():
    readme = (CLONE / "README.md").read_text()
    for kind in KINDS:
        start, stop = readme.index(begin(kind)), readme.index(end(kind)) + len(end(kind))
        assert readme[start:stop] == table(kind, RESULTS), (
            f"the README's {kind} table is not the one bench/results/demos/{kind}.json gives; "
            "regenerate with: python -m bench.demos_report --write README.md"
        )
