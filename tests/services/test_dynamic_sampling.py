"""Dynamic sampling against a real Redis server: the learner's rank 0 dispatches extra prompts,
tops a cycle up until ``prompts_per_cycle`` informative groups are in, selects them in sampler
order, accounts for every other group, and after a restart from its checkpoint state makes the
same decisions on the same groups (the prompts it re-dispatches carry the same ids)."""

from __future__ import annotations

import json

from common.protocol import wire
from common.protocol.streams import PAYLOAD_FIELD, PROMPTS, SCORED
from common.telemetry.metrics import PhaseTimer
from services.learner.bus_side import BusSide
from tests.learner_support import learner_settings_without_model
from tests.services.test_learner_service import _prompts, _scored, cfg

# Rewards of the two responses at each sampler position of cycle 0: positions 0-3 are the base
# round (2 informative), 8-11 the top-up round (3 informative); 4-7 belong to cycle 1.
REWARDS = {0: [1.0, 0.0], 1: [1.0, 1.0], 2: [0.0, 0.0], 3: [0.0, 1.0],
           8: [1.0, 0.0], 9: [0.0, 0.0], 10: [0.5, 0.0], 11: [1.0, 0.0]}  # fmt: skip


def _publish(io: BusSide, cycle: int, index: int, rewards: list[float]) -> None:
    sg = _scored(cycle, index)
    io.bus.publish(SCORED, wire.ScoredGroup(sg.group, rewards, sg.components, sg.reasons, "s", 0.1))


def _prompt_ids(io: BusSide) -> list[str]:
    entries = io.bus.redis.xrange(io.bus.key(PROMPTS))
    return [wire.decode(f[PAYLOAD_FIELD]).prompt_id for _, f in entries]


def test_dynamic_sampling_tops_up_selects_in_order_and_resumes_the_same(redis_server, tmp_path):
    c = cfg(
        f"run.redis_url={json.dumps(redis_server.url)}",
        'run.name="dynsamp"',
        "learner.trackers=[]",
        "learner.dynamic_sampling=true",
        "learner.filter_equal_reward_groups=true",
        prompts_per_cycle=4,
        responses_per_prompt=2,
        train_steps_per_cycle=1,
        num_cycles=3,
    )
    data, settings = (_prompts(tmp_path), None), learner_settings_without_model(c)
    io = BusSide(settings, run_dir=tmp_path, timer=PhaseTimer("learner"), datasets=data)
    try:
        io.dispatch(0, first_cycle=0)  # cycles 0 and 1: no filter rate yet, no extra prompts
        assert io.dispatcher.rounds == {0: [(0, 4)], 1: [(4, 4)]}
        saved = io.checkpoint_state()  # as a checkpoint before cycle 0 would hold it
        for index, rewards in REWARDS.items():  # the top-up's groups may arrive early
            _publish(io, 0, index, rewards)
        groups = io.collect(0, stop=lambda: False)
        # 2 of 4 filtered → rate 0.5 → top-up ⌈2 / 0.5⌉ = 4 prompts at positions 8-11
        first_ids = _prompt_ids(io)
        assert [i.split("/")[:2] for i in first_ids[8:]] == [["c0", str(g)] for g in range(8, 12)]
        assert [g.group.index for g in groups] == [0, 3, 8, 10]
        assert io.selection_counts == {"filtered_samples": 6, "surplus_samples": 2}  # 1, 2, 9; 11
        assert io.dispatcher.filter_rate == 3 / 8
        assert len(io.trained_deliveries) == 8  # every group of the cycle is acked after training
        # cycle 2 is dispatched with ⌈4 · 0.375 / 0.625⌉ = 3 extra prompts from the cursor
        io.dispatch(1, first_cycle=1)
        assert io.dispatcher.rounds[2] == [(12, 7)]
    finally:
        io.close()

    # A restart from the saved state sees the same (redelivered) groups and decides the same.
    again = BusSide(settings, run_dir=tmp_path, timer=PhaseTimer("learner"), datasets=data)
    try:
        again.restore(saved)
        assert again.dispatcher.cursor == 8
        groups = again.collect(0, stop=lambda: False)
        assert [g.group.index for g in groups] == [0, 3, 8, 10]
        assert again.selection_counts == {"filtered_samples": 6, "surplus_samples": 2}
        assert _prompt_ids(again)[19:] == first_ids[8:]  # the same top-up prompts again
    finally:
        again.close()
