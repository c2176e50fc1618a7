"""The learner on agents' episodes: an episode of several segments (its agent broke turn
continuity) is trained as several samples sharing the episode's reward, with group statistics
that count the episode once; an episode whose agent failed is recorded, counted and never
trained; and the books balance with both."""

from __future__ import annotations

import numpy as np
import pytest
import torch  # noqa: TID253 - tests of torch code

from common.config.load import load_config
from common.protocol import wire
from common.protocol.books import LearnerBooks, RunBooks
from services.learner.advantages import compute_advantages, kl_reward_advantages
from services.learner.cycle import (
    assign_advantages,
    decode_samples,
    encode_samples,
    episode_rows,
    extra_segments,
    mask_failed,
    samples_from_groups,
)
from tether.runs.report.data import accounting_rows


def test_group_statistics_count_an_episode_of_two_segments_once():
    # episodes: A (reward 1, segments 0 and 3), B (0), C (0); D failed (left out)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    groups = torch.zeros(5, dtype=torch.long)
    episode_of = torch.tensor([0, 1, 2, 0, -1])
    adv = compute_advantages(rewards, groups, estimator="grpo", episode_of=episode_of)
    # over the episodes {1, 0, 0}: mean 1/3, population std sqrt(2)/3
    std = (2**0.5) / 3
    a, b = (1 - 1 / 3) / (std + 1e-6), (0 - 1 / 3) / (std + 1e-6)
    assert adv.tolist() == pytest.approx([a, b, b, a, 0.0])
    # without episode_of the second segment would count as a second right answer
    plain = compute_advantages(rewards[:4], groups[:4], estimator="grpo")
    assert plain[0].item() != pytest.approx(a)
    rloo = compute_advantages(rewards, groups, estimator="rloo", episode_of=episode_of)
    assert rloo.tolist() == pytest.approx([1.0, -0.5, -0.5, 1.0, 0.0])
    with pytest.raises(ValueError, match="own episode's row"):
        compute_advantages(
            rewards, groups, estimator="grpo", episode_of=torch.tensor([1, 1, 2, 0, -1])
        )


def test_the_kl_reward_keeps_each_segments_own_kl_to_go():
    rewards = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    groups = torch.zeros(3, dtype=torch.long)
    kl = torch.tensor([[0.1, 0.2], [0.0, 0.0], [0.3, 0.0]], dtype=torch.float64)
    mask = torch.ones(3, 2, dtype=torch.float64)
    out = kl_reward_advantages(rewards, groups, kl, mask, estimator="drgrpo", kl_coef=1.0,
                               episode_of=torch.tensor([0, 1, 0]))  # fmt: skip
    # outcome over episodes {1, 0}: +0.5 and -0.5; minus each row's own KL to go
    expected = [0.5 - 0.3, 0.5 - 0.2, -0.5, -0.5, 0.5 - 0.3, 0.5]
    assert out.flatten().tolist() == pytest.approx(expected)
    base = kl_reward_advantages(rewards, groups, kl, mask, estimator="reinforce_pp_baseline",
                                kl_coef=0.0, episode_of=torch.tensor([0, 1, -1]))  # fmt: skip
    assert base[2].tolist() == [0.0, 0.0]  # left out


def _traj(index: int, segment: int, *, finish: str = "stop", prompt=None, reward=None):
    ids = np.asarray([7, 8, 9], dtype=np.uint32)
    return wire.Trajectory(
        sample_id=f"p/{index}" + (f".{segment}" if segment else ""), sample_index=index,
        response_token_ids=ids, behaviour_logprobs=np.full(3, -0.5, np.float32),
        loss_mask=np.ones(3, np.uint8), token_versions=np.zeros(3, np.int32), policy_version=0,
        finish_reason=finish, turns=[("assistant", 0, 3)], segment=segment,
        prompt_token_ids=None if prompt is None else np.asarray(prompt, dtype=np.uint32),
        agent_reward=reward, error="boom" if finish == "agent_error" else "",
    )  # fmt: skip


def _scored() -> wire.ScoredGroup:
    samples = [_traj(0, 0), _traj(0, 1, prompt=[1, 2, 3, 4]), _traj(1, 0),
               _traj(2, 0, finish="agent_error")]  # fmt: skip
    group = wire.TrajectoryGroup(
        group_id="p", prompt_id="p", cycle=0, index=0, split="train",
        prompt_token_ids=np.asarray([1, 2], dtype=np.uint32), prompt_text="q", ground_truth="1",
        metadata={}, generator_id="g", samples=samples,
    )  # fmt: skip
    # the scorer graded segment 0 of episode 0 as wrong and its last segment as right
    sg = wire.ScoredGroup(group, [0.0, 1.0, 0.0, 0.0], [{}] * 4, [""] * 4, "s", 0.0)
    back = wire.decode(wire.encode(sg))
    assert isinstance(back, wire.ScoredGroup)
    return back


def test_segments_share_their_episodes_reward_and_failed_episodes_are_not_trained():
    samples = samples_from_groups([_scored()])
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 0.0]  # the last segment's reward
    assert samples[0].prompt_ids == [1, 2] and samples[1].prompt_ids == [1, 2, 3, 4]
    assert [(s.episode_index, s.segment, s.failed) for s in samples] == [
        (0, 0, False), (0, 1, False), (1, 0, False), (2, 0, True)]  # fmt: skip
    assert episode_rows(samples) == [0, 0, 2, -1]
    back = decode_samples(encode_samples(samples))  # as the other ranks receive them
    assert [(s.episode_index, s.segment, s.failed) for s in back] == [
        (s.episode_index, s.segment, s.failed) for s in samples]  # fmt: skip
    cfg = load_config(flags={"run.prompts_per_cycle": 1, "run.responses_per_prompt": 3,
                             "run.train_steps_per_cycle": 1}, env={}).config  # fmt: skip
    assert assign_advantages(samples, cfg.learner) == 0
    a = [s.advantages[0] for s in samples]
    assert a[0] == a[1] > 0 > a[2] and a[3] == 0.0
    assert [s.weight for s in samples] == [1.0, 1.0, 1.0, 0.0]
    assert mask_failed(samples) == 1 and extra_segments(samples) == 1


def test_the_books_balance_with_segments_and_failed_agents():
    # 2 groups of 3 episodes; one episode had 2 segments, one agent failed; all trained else

    books = RunBooks(groups_generated=2, learner=LearnerBooks(
        trained_samples=6, segment_samples=1, agent_failed_samples=1))  # fmt: skip
    status = {"accounting": books.to_dict(), "streams": {}}
    rows = {k: v for k, _, v, _ in accounting_rows(status, responses_per_prompt=3,
                                                   passes_per_cycle=1, eval_groups=0)}  # fmt: skip
    assert rows["generated"] == 7 and rows["agent_failed"] == 1 and rows["unaccounted"] == 0


def test_a_trajectory_without_agent_fields_is_byte_identical_to_before():
    t = _traj(0, 0)
    d = t.to_wire()
    assert not {"segment", "prompt_token_ids", "agent_reward", "error"} & set(d)
    t2 = _traj(0, 1, prompt=[5], reward={"agent": 0.5})
    d2 = t2.to_wire()
    assert d2["segment"] == 1 and d2["agent_reward"] == {"agent": 0.5}
