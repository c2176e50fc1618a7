"""End-to-end benchmark plumbing (`bench/{pipeline,runner,results_md}.py`) on recorded
data: the analysis of step records and status snapshots, the README table, the CLI dispatch.
The benchmarks themselves run real services for minutes; `tether bench pipeline --quick` is the
way to run them, not the test suite."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from bench.peer import steady_ratio
from bench.pipeline import analyse, efficiency, write_bench_config
from bench.results_md import write_readme
from bench.runner import run_bench
from bench.workload import QUICK
from common.config.load import load_config
from services.learner.dist import set_cpu_threads


def _status(gen: float, score: float, learn: float, wait: float) -> dict:
    return {
        "generator:g0": {"service": "generator", "phases": {"working": gen, "waiting_input": wait}},
        "scorer:s0": {"service": "scorer", "phases": {"working": score, "waiting_input": wait}},
        "learner:l0": {"service": "learner", "phases": {"working": learn, "checkpointing": 5.0}},
    }


def _run(times: list[float], *, busy_end: tuple[float, float, float]) -> dict:
    steps = [
        {
            "kind": "step",
            "time": t,
            "seconds": 2.0,
            "response_tokens": 3840,
            "dropped_stale": 0,
            "staleness_max": 1,
        }
        for t in times
    ]
    return {
        "steps": steps,
        "snapshots": {
            1: {"status": _status(1.0, 1.0, 1.0, 0.0)},
            len(times): {"status": _status(*busy_end, 50.0)},
        },
        "wall_s": 100.0,
        "run_dir": "x",
    }


def test_analyse_times_only_the_cycles_after_the_warm_up():
    r = analyse(_run([100.0, 110.0, 120.0, 130.0], busy_end=(16.0, 4.0, 7.0)), QUICK)
    assert r["timed_cycles"] == 3
    assert r["cycle_seconds"] == pytest.approx(10.0)
    assert r["trained_responses_per_s"] == pytest.approx(120 / 10.0)
    # busy = all phases but waiting and the final checkpoint, per timed cycle
    assert r["busy_seconds_per_cycle"] == pytest.approx(
        {"generator": 5.0, "scorer": 1.0, "learner": 2.0}
    )


def test_efficiency_uses_the_sync_runs_stage_times():
    a = analyse(_run([0.0, 6.0, 12.0], busy_end=(9.0, 3.0, 5.0)), QUICK)
    s = analyse(_run([0.0, 8.0, 16.0], busy_end=(9.0, 3.0, 5.0)), QUICK)
    e = efficiency({"async": a, "sync": s})
    assert e["bottleneck_stage"] == "generator"
    assert e["ideal_async_cycle_seconds"] == pytest.approx(4.0)
    assert e["ideal_sync_cycle_seconds"] == pytest.approx(4.0 + 1.0 + 2.0)
    assert e["efficiency_async"] == pytest.approx(4.0 / 6.0)
    assert e["ratio_async_over_sync"] == pytest.approx(8.0 / 6.0)


def test_readme_has_a_row_and_the_command_per_result(tmp_path):
    a = analyse(_run([0.0, 6.0, 12.0], busy_end=(9.0, 3.0, 5.0)), QUICK)
    s = analyse(_run([0.0, 8.0, 16.0], busy_end=(9.0, 3.0, 5.0)), QUICK)
    result = {
        "bench": "pipeline",
        "machine": {"load_average": [3.5, 3.0, 2.0], "cpu_count": 2},
        "workload": {**QUICK.describe(), "params": 400_000},
        "command": "tether bench pipeline --quick",
        "threads_per_process": None,
        "async": {**a, "max_staleness": 1},
        "sync": {**s, "max_staleness": 0},
        **efficiency({"async": a, "sync": s}),
    }
    results = tmp_path / "results"
    results.mkdir()
    (results / "pipeline_quick.json").write_text(json.dumps(result))
    (results / "bus.json").write_text(json.dumps({"ratio_bus_over_bare": 0.8}))
    text = write_readme(results, tmp_path / "README.md").read_text()
    assert "`tether bench pipeline --quick`" in text and "**1.33** (async/sync" in text
    assert "| 3.5 |" in text
    assert "bus_over_bare **0.80**" in text
    assert "Scale on paper" in text and "| sync |" in text
    assert "on a GPU (measured)" not in text and "FSDP rank, assumed" in text

    # GPU results (bench/gpu/check.py) add their section and replace the plan's assumed train rate
    gpu = results / "gpu"
    gpu.mkdir()
    (gpu / "env.json").write_text(
        json.dumps({"ok": True, "device": "H100", "torch": "2", "nccl": "2"})
    )
    for name, hidden, rate in (("learner", 256, 30000.0), ("learner3b", 2048, 9000.0)):
        rec = {"ok": True, "settings": {"hidden": hidden, "params": 3e9},
               "service_train_tokens_per_s": rate, "bare_train_tokens_per_s": rate / 0.9,
               "ratio_service_over_bare": 0.9, "service_phase_seconds": {"working": 30.0}}  # fmt: skip
        (gpu / f"{name}.json").write_text(json.dumps(rec))
    text = write_readme(results, tmp_path / "README.md").read_text()
    assert "| Qwen2.5-3B shape, 3072 tok | 3,000 M | 9,000 tok/s | 10,000 tok/s | 0.90 |" in text
    assert "Train 9,000 tokens/s per FSDP rank, measured on one H100" in text


def test_unknown_benchmark_is_refused(tmp_path):
    with pytest.raises(ValueError, match="choose one of"):
        run_bench(argparse.Namespace(what="everything", out=str(tmp_path), quick=True))


def test_variable_length_workload_lets_responses_end_at_eos(tmp_path):
    def generator_section(w) -> str:
        path = write_bench_config(
            tmp_path / "c.toml", name="n", w=w, model=tmp_path, train=tmp_path / "t.jsonl",
            run_dir=tmp_path, max_staleness=1,
        )  # fmt: skip
        return path.read_text().split("[generator]")[1]

    assert "ignore_eos = true" in generator_section(QUICK)
    assert "ignore_eos = false" in generator_section(replace(QUICK, fixed_length=False))


def test_the_peer_contests_token_budget_is_a_padded_micro_batchs_memory(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    path = write_bench_config(
        tmp_path / "c.toml", name="n", w=QUICK, model=tmp_path, train=tmp_path / "t.jsonl",
        run_dir=tmp_path, max_staleness=1, token_budget=True, learner_cpu_threads=2,
    )  # fmt: skip
    ln = load_config(config_file=path, env={}).config.learner
    assert ln.micro_batch_size is None and ln.cpu_threads == 2
    assert ln.max_tokens_per_micro_batch == QUICK.micro_batch_size * (
        QUICK.max_prompt_tokens + QUICK.response_tokens
    )


def test_learner_cpu_threads_sets_the_ranks_intra_op_threads():
    import torch

    before = torch.get_num_threads()
    try:
        set_cpu_threads(torch.device("cpu"), 1)
        assert torch.get_num_threads() == 1
        set_cpu_threads(torch.device("cpu"), 0)  # 0: as given
        assert torch.get_num_threads() == 1
        set_cpu_threads(torch.device("cuda", 0), 3)  # not a CPU rank: untouched
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_readme_rows_for_packing_and_variable_lengths(tmp_path):
    packing = {
        "max_tokens": 192, "lengths": {"mean": 105.0}, "packed_train_tokens_per_s": 3000.0,
        "padded_train_tokens_per_s": 1800.0, "ratio_packed_over_padded": 3000.0 / 1800.0,
        "packed_token_slots_per_step": 14000, "padded_token_slots_per_step": 21000,
        "real_tokens_per_step": 12600, "load_average": [4.2, 4.0, 4.0],
        "micro_batching": {"micro_batch_size": 8, "max_tokens_per_micro_batch": None},
    }  # fmt: skip
    budgeted = {**packing, "ratio_packed_over_padded": 1.8,
                "micro_batching": {"micro_batch_size": None, "max_tokens_per_micro_batch": 1536}}  # fmt: skip
    learner = {"benchmark": "learner", "settings": {"params": 3.2e6}, "packing": packing,
               "packing_token_budget": budgeted}  # fmt: skip
    side = {"cycle_seconds": 40.0, "trained_responses_per_s": 3.0, "load_average_after": [5.5]}
    variable = {
        "workload": {**QUICK.describe(), "fixed_length": False},
        "tether": side,
        "trl": {**side, "step_seconds": 120.0, "trained_responses_per_s": 1.0},
        "trl_mean_response_tokens": 150.0,
        "tether_mean_response_tokens": 148.0,
        "ratio_tether_over_trl": 3.0,
    }
    peer = {"bench": "peer_variable", "workload": {"params": 2.5e7}, "variable_length": variable,
            "command": "tether bench peer --size full"}  # fmt: skip
    results = tmp_path / "results"
    results.mkdir()
    (results / "learner_packing.json").write_text(json.dumps(learner))
    (results / "peer_full_variable.json").write_text(json.dumps(peer))
    text = write_readme(results, tmp_path / "README.md").read_text()
    assert "| learner packing | 3.2 M, 192 tok max, micro-batches of 8 samples |" in text
    assert "**1.67** (packed/padded)" in text
    assert "| learner packing | 3.2 M, 192 tok max, micro-batches of ≤ 1536 tokens |" in text
    assert "**1.80** (packed/padded)" in text
    assert "| learner_packing |" not in text  # no empty generic row beside it
    assert "| peer, variable length |" in text and "**3.00** (Tether/TRL)" in text
    assert "mean 150 tokens (TRL), 148 (Tether)" in text


def test_the_steady_ratio_leaves_out_the_uncontended_last_cycle():
    v = {
        "trl": {"step_seconds_each": [140.0, 150.0, 144.0]},
        "tether": {
            "cycle_seconds_each": [80.0, 79.0, 44.0]
        },  # the last: nothing generated beside it
    }
    assert steady_ratio(v) == 144.0 / 79.0
    assert steady_ratio({"trl": {}, "tether": {}}) is None
