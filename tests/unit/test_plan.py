"""`tether.runs.plan`: the on-paper cycle-time model (pure arithmetic; no services)."""

from __future__ import annotations

import json

import pytest

from tether.cli.main import main
from tether.runs.plan import (
    GPU_ASSUMED,
    ClusterShape,
    StageRates,
    gpu_rates,
    held_memory,
    plan,
    rates_from_pipeline,
)

RATES = StageRates(
    generate_tokens_per_s=1000.0,
    score_responses_per_s=10.0,
    train_tokens_per_s=2000.0,
    sync_bytes_per_s=1e9,
)
SHAPE = dict(responses_per_cycle=120, prompt_tokens=100, response_tokens=100, param_bytes=10**9)


def test_sync_cycle_is_the_sum_of_the_stages():
    p = plan(rates=RATES, shape=ClusterShape(), max_staleness=0, **SHAPE)
    st = p["stage_seconds"]
    assert st == pytest.approx({"generate": 12.0, "score": 12.0, "train": 12.0, "sync": 1.0})
    assert p["mode"] == "sync"
    assert p["cycle_seconds"] == pytest.approx(37.0)


def test_async_cycle_is_the_slowest_lane_and_names_it():
    slow_train = StageRates(
        generate_tokens_per_s=1000.0,
        score_responses_per_s=10.0,
        train_tokens_per_s=500.0,
        sync_bytes_per_s=1e9,
    )
    p = plan(rates=slow_train, shape=ClusterShape(), **SHAPE)  # default staleness 2·S−1 = 1
    assert p["mode"] == "async" and p["max_staleness"] == 1
    assert p["bottleneck"] == "train"
    assert p["cycle_seconds"] == pytest.approx(48.0 + 1.0)
    assert p["speedup_over_sync"] == pytest.approx((12 + 12 + 48 + 1) / 49)


def test_more_generators_move_the_bottleneck():
    slow_gen = StageRates(
        generate_tokens_per_s=250.0,
        score_responses_per_s=10.0,
        train_tokens_per_s=2000.0,
        sync_bytes_per_s=1e9,
    )
    one = plan(rates=slow_gen, shape=ClusterShape(generators=1), **SHAPE)
    four = plan(rates=slow_gen, shape=ClusterShape(generators=4), **SHAPE)
    assert one["bottleneck"] == "generate" and one["cycle_seconds"] == pytest.approx(49.0)
    assert four["stage_seconds"]["generate"] == pytest.approx(12.0)
    assert four["cycle_seconds"] < one["cycle_seconds"]


def test_learner_scaling_efficiency_applies_per_doubling():
    p = plan(
        rates=RATES,
        shape=ClusterShape(learner_ranks=4, learner_scaling_efficiency=0.5),
        max_staleness=0,
        **SHAPE,
    )
    assert p["stage_seconds"]["train"] == pytest.approx(12.0 / (4 * 0.25))


def test_bad_inputs_are_refused_with_the_setting_named():
    with pytest.raises(ValueError, match="generate_tokens_per_s"):
        StageRates(
            generate_tokens_per_s=0.0,
            score_responses_per_s=1.0,
            train_tokens_per_s=1.0,
            sync_bytes_per_s=1.0,
        )
    with pytest.raises(ValueError, match="ClusterShape"):
        ClusterShape(generators=0)
    with pytest.raises(ValueError, match="responses_per_cycle"):
        plan(
            rates=RATES,
            shape=ClusterShape(),
            responses_per_cycle=0,
            prompt_tokens=1,
            response_tokens=1,
            param_bytes=1,
        )


def test_rates_from_a_pipeline_result_reproduce_its_sync_cycle():
    result = {
        "workload": {"responses_per_step": 120, "response_tokens": 32, "params": 1_000_000},
        "sync": {
            "busy_seconds_per_cycle": {"generator": 6.0, "scorer": 1.0, "learner": 10.0},
            "learner_train_step_seconds": 9.5,
        },
    }
    r = rates_from_pipeline(result, prompt_tokens=68)
    p = plan(
        rates=r,
        shape=ClusterShape(),
        responses_per_cycle=120,
        prompt_tokens=68,
        response_tokens=32,
        param_bytes=4_000_000,
        max_staleness=0,
    )
    assert p["stage_seconds"] == pytest.approx(
        {"generate": 6.0, "score": 1.0, "train": 9.5, "sync": 0.5}
    )
    with pytest.raises(ValueError, match="scorer"):
        rates_from_pipeline(
            {
                "workload": result["workload"],
                "sync": {
                    "busy_seconds_per_cycle": {"generator": 1.0, "learner": 1.0},
                    "learner_train_step_seconds": 1.0,
                },
            },
            prompt_tokens=1,
        )


def test_rates_prefer_the_learners_phase_seconds_when_recorded():
    result = {
        "workload": {"responses_per_step": 120, "response_tokens": 32, "params": 1_000_000},
        "sync": {
            "busy_seconds_per_cycle": {"generator": 6.0, "scorer": 1.0, "learner": 10.0},
            "learner_train_step_seconds": 2.0,
            "timed_cycles": 4,
            "phase_seconds_timed": {"learner:learner-0": {"working": 36.0, "syncing_weights": 4.0}},
        },
    }
    r = rates_from_pipeline(result, prompt_tokens=68)
    assert r.train_tokens_per_s == pytest.approx(120 * 100 / 9.0)
    assert r.sync_bytes_per_s == pytest.approx(4_000_000 / 1.0)


def test_tether_plan_prints_the_prediction_and_the_balancing_split(capsys):
    assert main(["plan"]) == 0  # the seed 001 layout on Qwen2.5-3B H100 rates
    out = capsys.readouterr().out
    assert "bound by generate" in out
    assert "best split of these 3 devices (async): 2 generator(s) + 1 learner rank(s)" in out

    overrides = ["--generate-tps", "1000", "--train-tps", "1000", "--score-rps", "100"]
    assert main(["plan", "--json", "--generators", "1", "--learner-ranks", "3", *overrides]) == 0
    got = json.loads(capsys.readouterr().out)
    rates, _ = gpu_rates()
    expected = plan(
        rates=StageRates(**{**rates, "generate_tokens_per_s": 1000.0,
                            "train_tokens_per_s": 1000.0, "score_responses_per_s": 100.0}),
        shape=ClusterShape(generators=1, learner_ranks=3),
        responses_per_cycle=120, prompt_tokens=512, response_tokens=3072,
        param_bytes=int(3.09e9 * 2),
    )  # fmt: skip
    assert got["async"]["cycle_seconds"] == pytest.approx(expected["cycle_seconds"])
    assert got["rates"]["sync_bytes_per_s"] == GPU_ASSUMED["sync_bytes_per_s"]
    assert [(s["generators"], s["learner_ranks"]) for s in got["splits"]][0] == (2, 2)


def test_tether_plan_bad_input_exits_2_naming_it(capsys):
    assert main(["plan", "--generators", "0"]) == 2
    assert "every count must be >= 1" in capsys.readouterr().err
    assert main(["plan", "--train-tps", "-5"]) == 2
    assert "train_tokens_per_s = -5.0" in capsys.readouterr().err


def test_sync_down_a_chain_stays_flat_in_generators_and_pairwise_grows():
    """Issue 16: the learner sends the bytes once down a chain (plus one piece per extra hop of
    delay), once per generator pairwise."""
    work = dict(SHAPE, param_bytes=6 * 10**9)
    chain = [
        plan(rates=RATES, shape=ClusterShape(generators=n), **work)["stage_seconds"]["sync"]
        for n in (1, 4, 8)
    ]
    pairwise = [
        plan(rates=RATES, shape=ClusterShape(generators=n, weights_fanout="pairwise"), **work)[
            "stage_seconds"
        ]["sync"]
        for n in (1, 4, 8)
    ]
    assert chain[0] == pairwise[0] == pytest.approx(6.0)
    piece = ClusterShape().chunk_bytes  # weights.chunk_mb's default: one piece of delay per hop
    assert chain[2] == pytest.approx(6.0 + 7 * piece / 1e9)
    assert pairwise == pytest.approx([6.0, 24.0, 48.0])
    with pytest.raises(ValueError, match="weights_fanout"):
        ClusterShape(weights_fanout="tree")


def test_redis_memory_held_for_the_learner_grows_with_the_checkpoint_cadence():
    work = dict(cycle_seconds=60.0, responses_per_cycle=120, prompts_per_cycle=30,
                prompt_tokens=512, response_tokens=3072)  # fmt: skip
    per = 120 * 3072 * 12.5 + 30 * 512 * 8.0
    timed = held_memory(**work)  # the default: every 30 minutes
    assert timed["bytes_per_cycle"] == per
    assert timed["cycles_between_checkpoints"] == 30 and timed["peak_bytes"] == 31 * per
    stepped = held_memory(**work, checkpoint_every_minutes=0, checkpoint_every_steps=10,
                          train_steps_per_cycle=2)  # fmt: skip
    assert stepped["cycles_between_checkpoints"] == 5  # whichever comes first
    never = held_memory(**work, checkpoint_every_minutes=0)
    assert never["peak_bytes"] is None  # grows with the run
    assert held_memory(**work, checkpoint_every_minutes=60)["peak_bytes"] == 61 * per
