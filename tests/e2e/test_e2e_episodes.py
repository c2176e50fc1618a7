"""Episodes through a real run, with a generator SIGKILLed mid-episode: the prompts it held are
redone from the start (by its restarted self: same id, its pending entries first), every episode
is trained once, and the books of episodes and of their tool calls balance."""

from __future__ import annotations

import pytest

from tests.e2e_support import (
    assert_trained_exactly_once,
    leftover_processes,
    run_training,
    tools_assets,
)
from tests.paths import REPO

pytestmark = pytest.mark.slow

CYCLES, PROMPTS, RESPONSES = 4, 4, 4
EVAL_PROMPTS = 32


def tools_config(tmp_path, name: str, *, cycles: int, tools: str) -> object:
    """A short episodes run on the tools task's model after a short warm-up (``tools_assets``:
    it calls the calculator in the teacher's format; the demo's warm-up, until it copies, costs
    CI minutes), the one the reduced tools demo uses."""
    assets = tools_assets(tmp_path.parent)
    # a held-out round before and after, on the first EVAL_PROMPTS of the task's 200: each is
    # episodes too, and with the slow calculator 200 of them took ~50 s a round
    held_out = tmp_path / "eval.jsonl"
    rows = (assets.data_dir / "eval.jsonl").read_text().splitlines(keepends=True)
    held_out.write_text("".join(rows[:EVAL_PROMPTS]))
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
[run]
name = "{name}"
run_dir = "{tmp_path / "runs"}"
model = "{assets.model_dir}"
prompts_per_cycle = {PROMPTS}
responses_per_prompt = {RESPONSES}
num_cycles = {cycles}
max_prompt_tokens = 128
max_response_tokens = 128
seed = 1

[data]
train_path = "{assets.data_dir / "train.jsonl"}"
eval_path = "{held_out}"

[generator]
kv_cache_gib = 1
temperature = 1.0
max_turns = 3
tools = [{tools}]
tool_workers = 2

[learner]
lr = 1e-4
checkpoint_every_steps = 2

[weights]
timeout_s = 20.0

[bus]
block_ms = 300
claim_idle_s = 20.0
""")
    return path


def test_a_generator_killed_mid_episode_redoes_it_and_nothing_counts_twice(redis_server, tmp_path):
    slow = f'"{REPO / "tests" / "slow_tools.py"}:calculator"'  # 0.5 s per call
    config = tools_config(tmp_path, "episodes-kill", cycles=CYCLES, tools=slow)
    r = run_training(config, redis_url=redis_server.url, name="episodes-kill",
                     kill_plan=[("generator-0", 1)])  # fmt: skip
    assert r.returncode == 0, r.output[-4000:]
    assert r.killed == ["generator-0"] and "generator-0 exited with code" in r.output
    assert leftover_processes(redis_server.url) == []  # engine core and sandbox workers too
    assert_trained_exactly_once(r, cycles=CYCLES, responses=CYCLES * PROMPTS * RESPONSES)
    learner = next(d for d in r.status.values() if d["service"] == "learner")
    books = learner["books"]
    # every trained episode's tool calls, once: the step records' per-episode means agree
    per_step = sum(s["tool_calls_per_episode"] * PROMPTS * RESPONSES for s in r.steps)
    assert books["episode_tool_calls"] == pytest.approx(per_step)
    assert books["episode_tool_calls"] > 0, "the warmed-up model calls the calculator"
    assert all(s["episode_turns_mean"] >= 1 for s in r.steps)
    # the held-out rounds before and after, each of EVAL_PROMPTS episodes
    assert [(e["eval_round"], e["n"]) for e in r.evals] == [
        (0, EVAL_PROMPTS),
        (CYCLES, EVAL_PROMPTS),
    ]
    for name in ("tether_generator_tool_calls_total", "tether_generator_episodes_total",
                 "tether_generator_tool_seconds", "tether_generator_episode_turns"):  # fmt: skip
        assert name in r.metric_names, name
