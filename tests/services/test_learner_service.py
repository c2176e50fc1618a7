"""The learner's own rules, without a model: staleness in optimizer steps at the boundary, the
dispatch gate, the step schedule of a cycle, and the cycle broadcast encoding."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from common.bus.client import Bus
from common.config.load import load_config
from common.data.datasets import load_prompts
from common.protocol import wire
from common.protocol.staleness import min_policy_version
from common.protocol.streams import LEARNER_CONSUMER, PROMPTS, SCORED
from common.service import run_end
from common.service.settings import bus_settings_for
from common.telemetry.metrics import PhaseTimer
from services.learner.bus_side import BusSide
from services.learner.cycle import Sample, decode_samples, encode_samples, steps_of_cycle
from services.learner.dispatch import Dispatcher
from services.learner.loop import LearnerService
from tests.learner_support import learner_settings_without_model
from tests.services.test_status import tether


def cfg(*sets: str, **run):
    flags = {f"run.{k}": v for k, v in run.items()}
    return load_config(flags=flags, overrides=list(sets), env={}).config


def sample(version: int, i: int = 0) -> Sample:
    return Sample(
        sample_id=f"s{i}",
        group=0,
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        behaviour_logp=[-0.1, -0.2],
        reward=1.0,
        policy_version=version,
    )


@pytest.mark.parametrize("steps,max_staleness", [(1, 0), (1, 1), (2, 1), (2, 3), (4, 3), (4, 7)])
def test_staleness_boundary_in_optimizer_steps(steps, max_staleness, tmp_path):
    c = cfg(
        prompts_per_cycle=4,
        responses_per_prompt=4,
        train_steps_per_cycle=steps,
        max_staleness=max_staleness,
    )
    # no set-up: the rank-0 duties do nothing
    svc = LearnerService(learner_settings_without_model(c), run_dir=tmp_path, datasets=None)
    svc.version = 10  # the step that turns version 10 into 11
    fresh = sample(10 - max_staleness, 0)  # t − v = max_staleness: allowed
    stale = sample(10 - max_staleness - 1, 1)  # one step more: dropped
    samples = [fresh, stale]
    dropped = svc._apply_staleness(samples, [0, 1])
    assert dropped == 1 and fresh.weight == 1.0 and stale.weight == 0.0
    assert svc.books.dropped_stale_samples == 1


def test_dispatch_gate_never_produces_data_the_learner_drops():
    # For every cycle, the oldest version allowed by the gate is still within the bound at the
    # cycle's last step (c·S + S − 1), and one version older would not be.
    for steps in (1, 2, 3, 4):
        for extra in (0, 1, 2, 5):
            st = steps - 1 + extra
            for cycle in range(6):
                v = min_policy_version(cycle, steps_per_cycle=steps, max_staleness=st)
                last_step = cycle * steps + steps - 1
                assert last_step - v <= st
                if v > 0:
                    assert last_step - (v - 1) > st


def test_steps_of_cycle_cover_each_sample_once_per_pass():
    steps = steps_of_cycle(24, steps=3, passes=2, seed=3, cycle=5)
    assert len(steps) == 6 and all(len(s) == 8 for s in steps)
    first, second = sorted(sum(steps[:3], [])), sorted(sum(steps[3:], []))
    assert first == second == list(range(24))
    assert steps == steps_of_cycle(24, steps=3, passes=2, seed=3, cycle=5)  # deterministic
    assert steps != steps_of_cycle(24, steps=3, passes=2, seed=3, cycle=6)


def test_a_cycle_short_of_groups_still_makes_its_steps():
    # groups lost to the dead-letter stream shrink the cycle, not its number of steps: the
    # policy version must stay cycle * steps at every cycle's start
    steps = steps_of_cycle(20, steps=3, passes=1, seed=3, cycle=5)
    assert [len(s) for s in steps] == [7, 7, 6]
    assert sorted(sum(steps, [])) == list(range(20))
    with pytest.raises(ValueError, match="2 samples cannot make 3 optimizer steps"):
        steps_of_cycle(2, steps=3, passes=1, seed=3, cycle=5)


def test_cycle_samples_roundtrip_through_bytes():
    s = [sample(3, i) for i in range(5)]
    back = decode_samples(encode_samples(s))
    assert [
        (x.sample_id, x.prompt_ids, x.response_ids, x.policy_version, x.reward) for x in back
    ] == [(x.sample_id, x.prompt_ids, x.response_ids, x.policy_version, x.reward) for x in s]
    assert back[0].behaviour_logp == pytest.approx([-0.1, -0.2], abs=1e-6)


def _prompts(tmp_path: Path, n: int = 10):
    f = tmp_path / "train.jsonl"
    f.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)}) + "\n" for i in range(n)
        )
    )
    return load_prompts(f)


def test_dispatch_positions_are_a_function_of_the_cycle(redis_server, tmp_path):
    c = cfg(
        f"run.redis_url={json.dumps(redis_server.url)}",
        'run.name="dispatch"',
        prompts_per_cycle=4,
        responses_per_prompt=2,
        train_steps_per_cycle=2,
        num_cycles=6,
    )
    bus = Bus(bus_settings_for(c), service="test")
    train = _prompts(tmp_path)
    d = Dispatcher(learner_settings_without_model(c), bus, train, None)
    # cycle 1 across the epoch boundary of a 10-prompt set: positions 4..7; cycle 2: 8..11
    assert [g for g, _ in d.records_of(2)] == [8, 9, 10, 11]
    again = Dispatcher(learner_settings_without_model(c), bus, train, None)
    assert [r.prompt_id for _, r in d.records_of(2)] == [
        r.prompt_id for _, r in again.records_of(2)
    ]
    # with max_staleness = 3 (default 2·S − 1), cycle c needs weights ≥ 2c + 1 − 3
    assert d.dispatch_ready(0, first_cycle=0) == [0, 1]
    assert d.dispatch_ready(1, first_cycle=0) == []
    assert d.dispatch_ready(2, first_cycle=0) == [2]
    msgs = bus.redis.xrange(bus.key(PROMPTS))
    assert len(msgs) == 12


def _scored(cycle: int, index: int):
    trajectories = [
        wire.Trajectory.single_turn(
            sample_id=f"c{cycle}/{index}/{i}", sample_index=i,
            token_ids=np.arange(3, dtype=np.uint32),
            logprobs=np.full(3, -0.5, dtype=np.float32),
            version_spans=[(0, 0)], finish_reason="stop",
        )
        for i in range(2)
    ]  # fmt: skip
    group = wire.TrajectoryGroup(
        group_id=f"c{cycle}/{index}", prompt_id=f"c{cycle}/{index}", cycle=cycle, index=index,
        split="train", prompt_token_ids=np.arange(4, dtype=np.uint32), prompt_text="1+1?",
        ground_truth="2", metadata={}, generator_id="gen-0", samples=trajectories,
    )  # fmt: skip
    return wire.ScoredGroup(group, [1.0, 0.0], [{}, {}], ["", ""], "scorer-0", 0.1)


def test_ack_trained_acknowledges_only_cycles_below_next_cycle(redis_server, tmp_path):
    """A checkpoint holds the training of the cycles below ``next_cycle``: only their scored
    entries are acknowledged; a cycle collected but not trained stays pending (redelivered
    after a crash)."""
    c = cfg(
        f"run.redis_url={json.dumps(redis_server.url)}",
        'run.name="acks"',
        "learner.trackers=[]",
        prompts_per_cycle=2,
        responses_per_prompt=2,
        train_steps_per_cycle=1,
        num_cycles=4,
    )
    io = BusSide(learner_settings_without_model(c), run_dir=tmp_path, timer=PhaseTimer("learner"),
                 datasets=(_prompts(tmp_path), None))  # fmt: skip
    try:
        for cycle in (0, 1):
            for index in range(2):
                io.bus.publish(SCORED, _scored(cycle, 2 * cycle + index))
        assert len(io.collect(0, stop=lambda: False) or []) == 2
        assert len(io.collect(1, stop=lambda: False) or []) == 2  # collected, not yet trained

        def pending() -> int:
            return int(io.bus.redis.xpending(io.bus.key(SCORED), "learner")["pending"])

        io.ack_trained(1)  # the checkpoint after cycle 0
        assert pending() == 2
        io.ack_trained(2)
        assert pending() == 0
    finally:
        io.close()


def test_no_scored_entry_is_acked_before_a_checkpoint_whatever_claim_idle_s(redis_server, tmp_path):
    """With bus.claim_idle_s shorter than the time the learner holds a cycle's entries, the
    learner's own consumer used to claim them back (XAUTOCLAIM) and ack them as duplicates
    before any checkpoint held their training. It does not claim: they stay pending."""
    c = cfg(
        f"run.redis_url={json.dumps(redis_server.url)}",
        'run.name="acks_claim"',
        "learner.trackers=[]",
        "bus.claim_idle_s=0.2",
        prompts_per_cycle=2,
        responses_per_prompt=2,
        train_steps_per_cycle=1,
        num_cycles=4,
    )
    io = BusSide(learner_settings_without_model(c), run_dir=tmp_path, timer=PhaseTimer("learner"),
                 datasets=(_prompts(tmp_path), None))  # fmt: skip

    def pending() -> int:
        return int(io.bus.redis.xpending(io.bus.key(SCORED), "learner")["pending"])

    try:
        for index in range(2):
            io.bus.publish(SCORED, _scored(0, index))
        assert len(io.collect(0, stop=lambda: False) or []) == 2  # trained, no checkpoint yet
        time.sleep(1.0)  # idle well past claim_idle_s
        for index in range(2, 4):
            io.bus.publish(SCORED, _scored(1, index))
        deadline = time.monotonic() + 3.0  # reads (and, before, claims) while collecting
        assert len(io.collect(1, stop=lambda: time.monotonic() > deadline) or []) == 2
        io.collect(2, stop=lambda: time.monotonic() > deadline + 2.0)  # waits: more reads
        assert pending() == 4  # nothing acknowledged: no checkpoint yet
        io.ack_trained(2)  # the checkpoint after cycle 1
        assert pending() == 0
    finally:
        io.close()


def test_a_run_asked_to_finish_early_trains_what_it_dispatched_and_stays_finished(
    redis_server, tmp_path, capsys
):
    """`tether finish` (``run_end.request_finish``): rank 0 dispatches no new cycle, ends after
    the cycles it dispatched, and writes a record every service of the configuration stops on,
    naming the early end; a learner restarted there stays finished (no held-out round, nothing
    dispatched); a configuration with more cycles goes on and forgets the record. The verb on a
    Redis that does not answer: exit 2 in seconds, naming it; on a run whose learner is not
    running, it says the request waits for the run to resume."""
    code, _, err = tether(["finish", "--name", "finish", "--redis-url", "redis://127.0.0.1:1/0"],
                          capsys)  # fmt: skip
    assert code == 2 and "redis://127.0.0.1:1/0 does not answer" in err, err
    url = f"run.redis_url={json.dumps(redis_server.url)}"
    c = cfg(url, 'run.name="finish"', "learner.trackers=[]", prompts_per_cycle=2,
            responses_per_prompt=2, train_steps_per_cycle=1, num_cycles=50)  # fmt: skip
    io = BusSide(learner_settings_without_model(c), run_dir=tmp_path, timer=PhaseTimer("learner"),
                 datasets=(_prompts(tmp_path), None))  # fmt: skip
    try:
        io.begin(0, 0)
        dispatched = io.dispatcher.dispatched_through
        assert 0 <= dispatched < 49 and io.end_cycle == 50 and not io.ended_early
        io.check_finish_request(1)  # nothing asked: nothing changes
        assert io.end_cycle == 50
        asked = ["finish", "--name", "finish", "--redis-url", redis_server.url]
        code, out, _ = tether(asked, capsys)  # no learner has reported: the request waits
        assert code == 0 and "asked run 'finish' to end early, but no learner" in out, out
        assert "(it never reported)" in out and "--resume" in out, out
        beat = {"service": "learner", "heartbeat": time.time()}  # a running learner's status
        io.bus.write_status("learner", LEARNER_CONSUMER, json.dumps(beat))
        code, out, _ = tether(asked, capsys)
        assert code == 0 and "asked run 'finish' to end early: the learner dispatches" in out, out
        io.check_finish_request(1)
        assert io.ended_early and io.end_cycle == dispatched + 1
        io.dispatch(1000, first_cycle=1)  # any version: no cycle past the end is dispatched
        assert io.dispatcher.dispatched_through == dispatched
        io.finish_run(0, stop=lambda: False)
        record = run_end.finished(io.bus, num_cycles=50)
        assert record is not None and record["ended_early_at_cycle"] == dispatched + 1
        assert not run_end.finish_requested(io.bus)  # answered
        code, out, _ = tether(["finish", "--name", "finish", "--num-cycles", "50",
                               "--redis-url", redis_server.url], capsys)  # fmt: skip
        assert code == 0 and "is finished already" in out and not run_end.finish_requested(io.bus)
    finally:
        io.close()
    prompts = len(Bus(bus_settings_for(c), service="t").redis.xrange(f"finish:{PROMPTS}"))
    again = BusSide(learner_settings_without_model(c), run_dir=tmp_path,
                    timer=PhaseTimer("learner"), datasets=(_prompts(tmp_path), None))  # fmt: skip
    try:
        again.begin(0, dispatched + 1)  # restarted at its end: finished, nothing dispatched
        assert again.ended_early and again.end_cycle == dispatched + 1
        assert len(again.bus.redis.xrange(again.bus.key(PROMPTS))) == prompts
    finally:
        again.close()
    longer = cfg(url, 'run.name="finish"', "learner.trackers=[]", prompts_per_cycle=2,
                 responses_per_prompt=2, train_steps_per_cycle=1, num_cycles=80)  # fmt: skip
    on = BusSide(learner_settings_without_model(longer), run_dir=tmp_path,
                 timer=PhaseTimer("learner"), datasets=(_prompts(tmp_path), None))  # fmt: skip
    try:
        on.begin(0, dispatched + 1)  # num_cycles raised: the run goes on
        assert not on.ended_early and on.end_cycle == 80
        assert run_end.finished(on.bus, num_cycles=50) is None
    finally:
        on.close()


def test_a_run_finished_early_after_a_restart_trains_what_the_process_before_dispatched(
    redis_server, tmp_path
):
    """A learner restarted from a checkpoint dispatches again from the checkpoint's cycle, below
    what the process before it had dispatched; asked to end early then, it ends after the cycles
    any process of the run dispatched (kept in Redis), so none of their prompts is left out."""
    c = cfg(f"run.redis_url={json.dumps(redis_server.url)}", 'run.name="finish_restart"',
            "learner.trackers=[]", prompts_per_cycle=2, responses_per_prompt=2,
            train_steps_per_cycle=1, num_cycles=50)  # fmt: skip

    def side() -> BusSide:
        return BusSide(learner_settings_without_model(c), run_dir=tmp_path,
                       timer=PhaseTimer("learner"), datasets=(_prompts(tmp_path), None))  # fmt: skip

    first = side()
    try:
        first.begin(0, 0)
        first.dispatch(6, first_cycle=0)  # the process got to v6 after its last checkpoint
        far = first.dispatcher.dispatched_through
    finally:
        first.close()
    again = side()
    try:
        again.restore({"dispatched_through": 1})  # its checkpoint: cycle 0 trained, 0..1 sent
        again.begin(0, 1)
        assert again.dispatcher.dispatched_through < far
        run_end.request_finish(again.bus)
        again.check_finish_request(1)
        assert again.end_cycle == far + 1 > 2, (again.end_cycle, far)
    finally:
        again.close()
