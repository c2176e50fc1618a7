"""Episode telemetry per optimizer step: what each episode did (from its trajectory), the step
record's aggregate, and the line `tether status` prints."""

from __future__ import annotations

import numpy as np
import pytest

from common.protocol import wire
from services.learner.cycle import Sample, episode_stats
from services.learner.step_log import episode_record
from tether.runs.status import format_status


def _episode(*, calls: list[bool], finish: str = "stop", mismatch: int = -1) -> wire.Trajectory:
    # assistant 2 ids (v3) | tool 2 ids | assistant 2 ids (v5)
    mask = np.array([1, 1, 0, 0, 1, 1], dtype=np.uint8)
    return wire.Trajectory(
        sample_id="p/0", sample_index=0, response_token_ids=np.arange(6, dtype=np.uint32),
        behaviour_logprobs=-0.5 * mask.astype(np.float32), loss_mask=mask,
        token_versions=np.array([3, 3, -1, -1, 5, 5], dtype=np.int32), policy_version=3,
        finish_reason=finish, turns=[("assistant", 0, 2), ("tool", 2, 4), ("assistant", 4, 6)],
        tool_calls=[wire.ToolCallRecord(name="calculator", arguments="{}", ok=ok,
                                        error="" if ok else "timed_out", seconds=0.5)
                    for ok in calls],
        template_mismatch=mismatch,
    )  # fmt: skip


def test_what_an_episode_did():
    stats = episode_stats(_episode(calls=[True, False], finish="max_turns", mismatch=7))
    assert stats == {"turns": 2.0, "tool_calls": 2.0, "tool_errors": 1.0, "tool_seconds": 1.0,
                     "template_mismatch": 1.0, "cut_max_turns": 1.0, "version_span": 2.0}  # fmt: skip


def _sample(traj: wire.Trajectory) -> Sample:
    return Sample(sample_id="x", group=0, prompt_ids=[1], response_ids=[2], behaviour_logp=[0.0],
                  reward=0.0, policy_version=3, episode=episode_stats(traj))  # fmt: skip


def test_the_step_record_aggregates_its_episodes():
    samples = [
        _sample(_episode(calls=[True])),
        _sample(_episode(calls=[True, False, False], finish="max_turns")),
        _sample(_episode(calls=[], mismatch=4)),
        _sample(_episode(calls=[True])),
    ]
    rec = episode_record(samples)
    assert rec == pytest.approx({
        "episode_turns_mean": 2.0, "tool_calls_per_episode": 5 / 4, "tool_call_rate": 3 / 4,
        "tool_error_rate": 2 / 5, "tool_seconds_per_episode": 2.5 / 4, "template_mismatches": 1,
        "episodes_cut_max_turns": 1, "episode_version_span_max": 2,
    })  # fmt: skip
    assert episode_record([Sample("x", 0, [1], [2], [0.0], 0.0, 0)]) == {}


def test_status_prints_the_episodes_line_only_for_episodes():
    base = {"run": "r", "learner_version": 4, "cycle": 2, "services": [], "streams": {},
            "dead_letters": 0}  # fmt: skip
    step = {"step": 4, "loss": 0.1, "reward_mean": 0.5, "staleness_max": 1}
    single = {**step, **episode_record([_sample(_episode(calls=[]))]), "episode_turns_mean": 1.0}
    assert "episodes:" not in format_status({**base, "last_step": single})
    rec = episode_record([_sample(_episode(calls=[True, False]))])
    text = format_status({**base, "last_step": {**step, **rec}})
    line = next(x for x in text.splitlines() if "episodes:" in x)
    assert "2.00 turns, 2.00 tool calls (100% called one, 50% failed" in line
    assert "span ≤ 2 (staleness counts from the oldest)" in line
