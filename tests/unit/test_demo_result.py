"""The result `tether demo` writes into its run directory (``tether.demo.result``): which demo,
which code and config, what it measured. A real demo run writes one in
tests/e2e/test_demo.py; here its parts, on a metrics file written by hand."""

from __future__ import annotations

import json

import pytest

from common.config.load import load_config
from tether.cli.main import main
from tether.demo.result import (
    SCHEMA,
    DemoResult,
    config_digest,
    demo_kind,
    make_result,
    read_metrics,
    run_git,
    write_result,
)
from tether.demo.run import DEMO_CONFIG, PRESETS, TASKS, preset_settings


def test_the_kind_names_the_task_the_agent_loop_and_lora():
    assert demo_kind(task="arithmetic", agent=False, lora_rank=0) == "arithmetic"
    assert demo_kind(task="arithmetic", agent=False, lora_rank=16) == "arithmetic-lora"
    assert demo_kind(task="tools", agent=False, lora_rank=0) == "tools"
    assert demo_kind(task="tools", agent=True, lora_rank=0) == "tools-agent"


def _digest(*overrides: str, preset: str = "demo", config=DEMO_CONFIG) -> str:
    cfg = load_config(config_file=str(config), overrides=list(overrides), flags={}).config
    return config_digest(cfg.to_dict(), PRESETS[preset])


def test_the_config_digest_leaves_out_the_run_s_own_paths_and_seed_and_nothing_else():
    base = _digest()
    assert len(base) == 16
    # another run of the same demo: other directory, name, model and data paths, seed
    assert base == _digest('run.run_dir="/elsewhere"', 'run.name="x-s3"', 'run.model="/m"',
                           'data.train_path="/d/train.jsonl"', 'data.eval_path="/d/eval.jsonl"',
                           "run.seed=3")  # fmt: skip
    assert base != _digest("learner.lr=5e-4")  # a setting
    assert base != _digest("run.num_cycles=10")
    assert base != _digest(preset="ci")  # the warm-up and task
    assert _digest(preset="tools", config=TASKS["tools"][1]) != base


def _metrics(path):
    rows = [
        {"kind": "eval", "eval_round": 4, "accuracy": 0.9, "n": 200, "lost": 0},
        {"kind": "step", "step": 2, "reward_mean": 0.5, "tool_call_rate": 0.75, "loss": 0.1},
        {"kind": "step", "step": 1, "reward_mean": 0.25, "tool_call_rate": 0.5, "loss": 0.2},
        {"kind": "eval", "eval_round": 0, "accuracy": 0.0, "n": 200, "lost": 0},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_result_keeps_every_round_and_step_in_order_and_reads_back(tmp_path):
    evals, steps = read_metrics(_metrics(tmp_path / "metrics.jsonl"))
    assert evals == [
        {"round": 0, "accuracy": 0.0, "n": 200},
        {"round": 4, "accuracy": 0.9, "n": 200},
    ]
    assert steps == [{"step": 1, "reward_mean": 0.25, "tool_call_rate": 0.5},
                     {"step": 2, "reward_mean": 0.5, "tool_call_rate": 0.75}]  # fmt: skip
    assert read_metrics(tmp_path / "absent.jsonl") == ([], [])

    result = make_result(
        kind="tools", task="tools", agent=False, lora_rank=0, seed=3, command="tether demo",
        git={"commit": "a" * 40, "dirty": False}, digest="0123456789abcdef", exit_code=0,
        metrics=tmp_path / "metrics.jsonl",
        warmup={"steps": 425, "first_steps": 325, "first_exact": 0.84, "reused": False,
                "out_dir": "/x", "tokens": 7},
        seconds={"assets": 1.04, "warmup": 300.0, "rl": 170.26, "total": 471.3},
        load={"before": [1.0, 1.0, 1.0], "before_rl": [2.0, 1.0, 1.0], "after": [3.0, 2.0, 1.0]},
        grading={"correct": 3, "no_answer": 60, "not_a_number": 1},
    )  # fmt: skip
    assert result.grading == {"correct": 3, "no_answer": 60, "not_a_number": 1}
    assert result.warmup == {"steps": 425, "first_steps": 325, "first_exact": 0.84, "reused": False}
    assert result.seconds == {"assets": 1.0, "warmup": 300.0, "rl": 170.3, "total": 471.3}
    assert result.machine["cpus"] >= 1 and result.schema == SCHEMA
    out = tmp_path / "demo_result.json"
    write_result(out, result)
    back = DemoResult.from_dict(json.loads(out.read_text()))
    assert back == result and not list(tmp_path.glob("*.tmp"))

    # a result written before the grading counts existed still reads back
    older = {k: v for k, v in result.to_dict().items() if k != "grading"}
    assert DemoResult.from_dict(older).grading == {}
    with pytest.raises(ValueError, match="schema"):
        DemoResult.from_dict({**result.to_dict(), "schema": SCHEMA + 1})
    with pytest.raises(ValueError, match="unknown field"):
        DemoResult.from_dict({**result.to_dict(), "note": "typed by hand"})


def test_a_run_records_the_code_it_started_with_and_a_checkout_changed_meanwhile_as_dirty():
    start = {"commit": "a" * 40, "dirty": False}
    assert run_git(start, dict(start)) == start
    # a commit made while the run went on: the services loaded the first commit's code
    assert run_git(start, {"commit": "b" * 40, "dirty": False}) == {
        "commit": "a" * 40,
        "dirty": True,
    }
    assert run_git(start, {"commit": "a" * 40, "dirty": True})["dirty"] is True


def test_a_capped_warm_up_caps_each_stage_and_changes_the_digest():
    tools = preset_settings("tools", warmup_steps=100)
    assert (tools["warmup"]["first_steps"], tools["warmup"]["steps"]) == (100, 100)
    assert tools["warmup"]["stop_at_exact"] == PRESETS["tools"]["warmup"]["stop_at_exact"]
    assert PRESETS["tools"]["warmup"]["first_steps"] == 800  # the preset itself is untouched
    # a cap above a stage's steps leaves that stage as it is; none leaves the preset
    assert preset_settings("demo", warmup_steps=1000) == PRESETS["demo"]
    assert preset_settings("demo") is PRESETS["demo"]
    cfg = load_config(config_file=str(DEMO_CONFIG), overrides=[], flags={}).config.to_dict()
    capped = config_digest(cfg, preset_settings("demo", warmup_steps=50))
    assert capped != config_digest(cfg, PRESETS["demo"])
    with pytest.raises(ValueError, match="no warm-up"):
        preset_settings("smollm2", warmup_steps=10)


def test_demo_refuses_a_warm_up_cap_where_there_is_no_warm_up_or_no_step(capsys):
    assert main(["demo", "--task", "smollm2", "--warmup-steps", "10"]) == 2
    assert "leave --warmup-steps out" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["demo", "--warmup-steps", "0"])
    assert e.value.code == 2
    assert "whole number of steps >= 1" in capsys.readouterr().err
