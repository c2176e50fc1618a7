"""The scorer on agents' episodes (real math-verify grading workers): an episode whose agent
returned its reward is not graded (its reward is the sum of its components), one whose agent
failed scores 0 with its reason, one that handed an answer over is graded like a response, in
the same batch."""

from __future__ import annotations

import asyncio

import numpy as np

from common.config.load import load_config
from common.protocol import wire
from services.scorer.loop import ScorerService
from services.scorer.main import scorer_settings


def _traj(i: int, text: str, **agent) -> wire.Trajectory:
    return wire.Trajectory(
        sample_id=f"p/{i}", sample_index=i, response_token_ids=np.asarray([5], np.uint32),
        behaviour_logprobs=np.asarray([-0.1], np.float32), loss_mask=np.ones(1, np.uint8),
        token_versions=np.zeros(1, np.int32), policy_version=0,
        finish_reason=agent.pop("finish", "stop"), response_text=text,
        turns=[("assistant", 0, 1)], **agent,
    )  # fmt: skip


def test_agent_rewards_failures_and_answers_in_one_batch():
    cfg = load_config(overrides=["scorer.grader_workers=1"], env={}).config
    # its Redis is never contacted here: score() grades, and publishing is not tested here
    svc = ScorerService(scorer_settings(cfg, redis_url="redis://127.0.0.1:1/0"), sid="scorer-test")
    svc._build()
    try:
        svc.pool.wait_ready()
        group = wire.TrajectoryGroup(
            group_id="p", prompt_id="p", cycle=0, index=0, split="train",
            prompt_token_ids=np.asarray([1], np.uint32), prompt_text="3+4?", ground_truth="7",
            metadata={}, generator_id="g",
            samples=[
                _traj(0, "whatever", agent_reward={"correct": 1.0, "brevity": -0.25}),
                _traj(1, "", finish="agent_error", error="ValueError: bug"),
                _traj(2, "so \\boxed{7}"),
                _traj(3, "so \\boxed{8}"),
            ],
        )  # fmt: skip
        (items,) = asyncio.run(svc.score([group]))
        assert [it.reward for it in items] == [0.75, 0.0, 1.0, 0.0]
        assert [it.reason for it in items] == ["agent", "agent_failed", "correct", "wrong"]
        scored = svc._scored_group(group, items, 0.0)
        assert scored.reasons == ["", "agent_failed", "", ""]
        assert scored.components[0] == {"correct": 1.0, "brevity": -0.25}
    finally:
        svc.pool.close()
