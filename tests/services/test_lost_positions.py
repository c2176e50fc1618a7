"""A cycle whose prompt or group is dead-lettered goes on without it, against a real Redis
server: the dead-letter entry names the position (split, cycle, index), rank 0 stops waiting for
it, says so, trains the rest, tops up instead with dynamic sampling, makes the same decision
after a restart, and stops with the reasons when too little is left to train. The books count
the dead-lettered group's responses and not the prompt's (it was never generated)."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client import REGISTRY

from common.bus.consumer import Consumer
from common.bus.dead_letters import holds_responses
from common.protocol import wire
from common.protocol.streams import DEAD, GENERATORS, GROUPS, PROMPTS, SCORED, SCORERS
from common.service import run_end
from common.telemetry.metrics import PhaseTimer
from services.learner.bus_side import BusSide, LostCycle
from services.learner.loop import LearnerService
from tests.learner_support import learner_settings_without_model
from tests.services.test_learner_service import _prompts, _scored, cfg

WAIT_S = 20.0  # a collect that would hang gives up here, and the test fails


def _bus_side(tmp_path, name: str, url: str, *sets: str, **run) -> BusSide:
    c = cfg(
        f"run.redis_url={json.dumps(url)}",
        f'run.name="{name}"',
        "learner.trackers=[]",
        *sets,
        **{"prompts_per_cycle": 4, "responses_per_prompt": 2, "train_steps_per_cycle": 2} | run,
    )
    data = (_prompts(tmp_path), _prompts(tmp_path, 3))
    settings = learner_settings_without_model(c)
    return BusSide(settings, run_dir=tmp_path, timer=PhaseTimer("learner"), datasets=data)


def _collect(io: BusSide, cycle: int):
    deadline = time.monotonic() + WAIT_S
    groups = io.collect(cycle, stop=lambda: time.monotonic() > deadline)
    assert groups is not None, f"cycle {cycle} still waits for a dead-lettered position"
    return groups


def _dead_letter_prompt(io: BusSide, *indices: int) -> None:
    """As a generator does with a prompt it cannot encode (the other prompts it reads are
    acknowledged, as if generated: their groups are published by the test)."""
    gen = Consumer(io.bus, PROMPTS, GENERATORS, "generator-0")
    for d in gen.read(64, 100):
        if d.msg.index in indices:
            gen.dead_letter(d, "unencodable_prompt", "3000 tokens > max_model_len 2048")
        else:
            gen.ack([d])


def _dead_letter_group(io: BusSide, cycle: int, index: int) -> None:
    """As a scorer does with a group it cannot score."""
    io.bus.publish(GROUPS, _scored(cycle, index).group)
    scorer = Consumer(io.bus, GROUPS, SCORERS, "scorer-0")
    (d,) = scorer.read(64, 100)
    scorer.dead_letter(d, "unscorable", "ground truth does not parse")


def _metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def test_a_cycle_goes_on_without_its_dead_lettered_prompt_and_group(redis_server, tmp_path):
    io = _bus_side(tmp_path, "lost", redis_server.url, num_cycles=2)
    lost_before = _metric("tether_learner_lost_groups_total")
    try:
        io.dispatch(0, first_cycle=0)
        _dead_letter_prompt(io, 1)  # position 1 of cycle 0: never generated
        _dead_letter_group(io, 0, 2)  # position 2: generated, not scorable
        for index in (0, 3):
            io.bus.publish(SCORED, _scored(0, index))
        groups = _collect(io, 0)
        assert [g.group.index for g in groups] == [0, 3]
        assert _metric("tether_learner_lost_groups_total") - lost_before == 2
        entries = io.bus.redis.xrange(io.bus.key(DEAD))
        assert [holds_responses(f) for _, f in entries] == [False, True]  # prompt, group
        saved = io.checkpoint_state()
    finally:
        io.close()

    # A restarted learner reads the dead-letter stream from its start: the same decision.
    again = _bus_side(tmp_path, "lost", redis_server.url, num_cycles=2)
    try:
        again.restore(saved)
        assert [g.group.index for g in _collect(again, 0)] == [0, 3]
    finally:
        again.close()


def test_the_learners_own_pending_groups_survive_more_restarts_than_max_deliveries(
    redis_server, tmp_path
):
    # The learner holds scored entries pending until a checkpoint covers them; a restart reads
    # them back (Redis counts a delivery each time), which is not poison: with
    # bus.max_deliveries=1, three restarts later the group is still trained, not dead-lettered.
    sets = ("bus.max_deliveries=1",)
    for _ in range(3):
        io = _bus_side(tmp_path, "lost_redeliver", redis_server.url, *sets, num_cycles=2)
        try:
            if io.dispatcher.dispatched_through < 0:
                io.dispatch(0, first_cycle=0)
            if not io.bus.redis.xlen(io.bus.key(SCORED)):
                for index in range(4):
                    io.bus.publish(SCORED, _scored(0, index))
            assert len(io.consumer.read(4, 100)) >= 1  # then the learner "dies" holding them
        finally:
            io.close()
    again = _bus_side(tmp_path, "lost_redeliver", redis_server.url, *sets, num_cycles=2)
    try:
        assert [g.group.index for g in _collect(again, 0)] == [0, 1, 2, 3]
        assert again.bus.redis.xlen(again.bus.key(DEAD)) == 0
    finally:
        again.close()


def test_a_group_that_kept_failing_its_scorer_is_not_waited_for(redis_server, tmp_path):
    # A group whose scorer failed while holding it bus.max_deliveries times (strikes) is
    # dead-lettered with its position, which the learner then does not wait for.
    sets = ("bus.max_deliveries=2",)
    io = _bus_side(tmp_path, "lost_strikes", redis_server.url, *sets, num_cycles=2)
    try:
        io.dispatch(0, first_cycle=0)
        io.bus.publish(GROUPS, _scored(0, 0).group)
        for _ in range(2):  # a scorer takes it and dies holding it, twice
            assert len(Consumer(io.bus, GROUPS, SCORERS, "scorer-0").read(4, 100)) == 1
        assert Consumer(io.bus, GROUPS, SCORERS, "scorer-0").read(4, 100) == []  # struck out
        for index in (1, 2, 3):
            io.bus.publish(SCORED, _scored(0, index))
        assert [g.group.index for g in _collect(io, 0)] == [1, 2, 3]
        (_, fields), *_ = io.bus.redis.xrange(io.bus.key(DEAD))
        assert fields[b"reason"] == b"max_deliveries" and fields[b"index"] == b"0"
        assert b"failed 2 times" in fields[b"detail"]
    finally:
        io.close()


def test_dynamic_sampling_tops_up_for_a_lost_position(redis_server, tmp_path):
    sets = ("learner.dynamic_sampling=true", "learner.filter_equal_reward_groups=true")
    io = _bus_side(tmp_path, "lost_dyn", redis_server.url, *sets, num_cycles=1)
    try:
        io.dispatch(0, first_cycle=0)
        _dead_letter_prompt(io, 1)
        for index in (0, 2, 3, 4):  # 4 is the top-up's first position
            io.bus.publish(SCORED, _scored(0, index))
        groups = _collect(io, 0)
        assert [g.group.index for g in groups] == [0, 2, 3, 4]  # still a full batch
        assert io.dispatcher.cursor == 5
    finally:
        io.close()


def test_a_cycle_left_with_too_little_to_train_stops_with_the_reasons(redis_server, tmp_path):
    io = _bus_side(
        tmp_path, "lost_all", redis_server.url, prompts_per_cycle=2, responses_per_prompt=1
    )
    try:
        io.dispatch(0, first_cycle=0)
        _dead_letter_prompt(io, 0)
        _dead_letter_group(io, 0, 1)
        with pytest.raises(LostCycle, match="unencodable_prompt, unscorable.*0 group"):
            _collect(io, 0)
    finally:
        io.close()


def test_an_evaluation_round_finishes_without_its_dead_lettered_prompt(redis_server, tmp_path):
    io = _bus_side(tmp_path, "lost_eval", redis_server.url, num_cycles=1)
    try:
        io.start_eval(0)
        gen = Consumer(io.bus, PROMPTS, GENERATORS, "generator-0")
        prompts = [d for d in gen.read(64, 100) if d.msg.split == "eval"]
        gen.dead_letter(prompts[0], "unencodable_prompt", "too long")
        for d in prompts[1:]:
            sg = _scored(0, d.msg.index)
            pid = d.msg.prompt_id  # as a generator does: the group carries its prompt's id
            group = wire.TrajectoryGroup(
                **{**sg.group.__dict__, "split": "eval", "group_id": pid, "prompt_id": pid}
            )
            comps = [{"correct": 1.0}, {"correct": 0.0}]
            io.bus.publish(SCORED, wire.ScoredGroup(group, [1.0, 0.0], comps, ["", ""], "s", 0.1))
        io.finish_evals(timeout_s=WAIT_S)
        (rec,) = io.eval_history
        assert rec["lost"] == 1 and rec["n"] == 4 and rec["accuracy"] == 0.5
    finally:
        io.close()


def test_the_learner_loop_stops_every_rank_and_then_says_why(redis_server, tmp_path):
    # rank 0 turns LostCycle into a STOP word (the other ranks leave the loop with it) and keeps
    # the error to raise after the final checkpoint: main() prints it and exits 2
    import torch

    io = _bus_side(
        tmp_path, "lost_loop", redis_server.url, prompts_per_cycle=2, responses_per_prompt=1
    )
    svc = LearnerService(io.settings, run_dir=tmp_path, datasets=None)
    svc.bus_side, svc.device = io, torch.device("cpu")  # no model: this is the control path
    try:
        io.dispatch(0, first_cycle=0)
        _dead_letter_prompt(io, 0, 1)
        assert svc._next_cycle_groups(0) == (False, None)
        assert isinstance(svc.fatal, LostCycle) and svc._stop
    finally:
        io.close()


def test_a_group_that_comes_after_all_is_trained_and_not_counted_lost(redis_server, tmp_path):
    # a generator frozen past the claim time commits after its prompt was dead-lettered for
    # max_deliveries: the group is here, so the position is not lost
    io = _bus_side(tmp_path, "lost_late", redis_server.url, num_cycles=1)
    lost_before = _metric("tether_learner_lost_groups_total")
    try:
        io.dispatch(0, first_cycle=0)
        _dead_letter_prompt(io, 1)
        for index in range(4):
            io.bus.publish(SCORED, _scored(0, index))
        assert [g.group.index for g in _collect(io, 0)] == [0, 1, 2, 3]
        assert _metric("tether_learner_lost_groups_total") == lost_before
    finally:
        io.close()


def test_a_learner_restarted_after_the_run_ended_does_not_wait_for_an_evaluation(
    redis_server, tmp_path
):
    """A learner killed while it exits, after it wrote the run-finished record, is started
    again at the last cycle: the generators and scorers are gone, so it must neither dispatch
    the last held-out round again nor wait for it (it waited 300 s, found by the e2e kill test);
    without the record (killed before it), the round runs."""
    name = f"ended{time.monotonic_ns()}"
    io = _bus_side(tmp_path, name, redis_server.url, num_cycles=2)
    version = 2 * 2
    io.begin(version, next_cycle=2)  # killed after its last checkpoint, before the record
    assert io.bus.redis.xlen(io.bus.key(PROMPTS)) == 3  # the last held-out round, again
    run_end.mark_finished(io.bus, num_cycles=2, version=version)  # then it finished, was killed
    again = _bus_side(tmp_path, name, redis_server.url, num_cycles=2)
    again.begin(version, next_cycle=2)
    t0 = time.monotonic()
    again.finish_run(version, stop=lambda: time.monotonic() - t0 > WAIT_S)
    assert time.monotonic() - t0 < 5.0 and io.bus.redis.xlen(io.bus.key(PROMPTS)) == 3
    assert run_end.finished(again.bus, num_cycles=2)["version"] == version
