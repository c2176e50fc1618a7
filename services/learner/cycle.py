"""One cycle's training data: collected from scored groups (rank 0), shared with every rank,
given its advantages, and split into optimizer steps.

Rank 0 reads the bus; the other ranks receive the cycle as msgpack bytes over the learner's
process group (``dist.broadcast_bytes`` — no pickle), so every rank sees the same samples in the
same order and computes the same step assignments. ``assign_advantages`` turns the rewards into
per-token advantages with the formulas of ``advantages.py``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from services.learner import advantages as adv_mod
from services.learner import losses
from services.learner.dist import broadcast_bytes, rank_world

if TYPE_CHECKING:
    import torch

    from common.config.learner import LearnerConfig
    from common.protocol import wire


# How an episode ended when it was cut short (the over-long filter masks these), and when the
# generator's strict re-render check refused it (never trained).
CUT_SHORT = frozenset({"length", "max_turns"})
REFUSED = "template_mismatch"


@dataclass
class Sample:
    """One episode (a single-turn response is an episode of one turn). ``response_ids`` are all
    its ids after the prompt; ``loss_mask`` marks those the policy sampled (1) — tool and
    environment ids (0) are context only: no advantage, loss, KL, entropy or mismatch statistic
    counts them. ``policy_version`` is the oldest version among the sampled ids."""

    sample_id: str
    group: int  # index of its group within the cycle
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logp: list[float]
    reward: float
    policy_version: int
    truncated: bool = False  # cut short: at run.max_response_tokens or generator.max_turns
    loss_mask: list[int] = field(default_factory=list)  # one per response id; empty = all 1
    refused: bool = False  # the generator's strict re-render check refused it: never trained
    # an agent's episode (``[agent]``): the episode's index in its group, this sample's segment
    # of it (0 = first), and whether the agent's code failed (recorded, never trained)
    episode_index: int = 0
    segment: int = 0
    failed: bool = False
    # what the episode did (rank 0's step records; not sent to the other ranks): see
    # ``episode_stats``
    episode: dict[str, float] = field(default_factory=dict)
    # routing replay (``learner.router_replay``): the experts of every prompt and response id,
    # [len(prompt_ids) + len(response_ids), L, K] int32, -1 where not recorded; None = none sent
    routing: np.ndarray | None = None
    # filled in per cycle / per step
    advantages: list[float] = field(default_factory=list)  # one per response token
    old_logp: list[float] = field(default_factory=list)
    ref_logp: list[float] = field(default_factory=list)
    weight: float = 1.0  # 0 when dropped (staleness, equal-reward filter, over-long filter)


def samples_from_groups(groups: list[wire.ScoredGroup]) -> list[Sample]:
    """Flatten a cycle's groups, ordered by sampler position so the batch is deterministic.

    A segment of an agent's episode carries its own prompt when it has one; every segment of an
    episode gets the episode's reward: the one scored on its last segment (the episode's end)."""
    out: list[Sample] = []
    for gi, sg in enumerate(sorted(groups, key=lambda s: s.group.index)):
        prompt = sg.group.prompt_token_ids.astype(np.int64).tolist()
        episode_reward = {
            t.sample_index: float(r)
            for t, r in sorted(
                zip(sg.group.samples, sg.rewards, strict=True), key=lambda tr: tr[0].segment
            )  # fmt: skip
        }
        for traj in sg.group.samples:
            own = traj.prompt_token_ids
            n_prompt = len(prompt) if own is None else len(own)
            out.append(
                Sample(
                    sample_id=traj.sample_id,
                    group=gi,
                    prompt_ids=prompt if own is None else own.astype(np.int64).tolist(),
                    response_ids=traj.response_token_ids.astype(np.int64).tolist(),
                    behaviour_logp=traj.behaviour_logprobs.astype(np.float64).tolist(),
                    reward=episode_reward[traj.sample_index],
                    policy_version=int(traj.policy_version),
                    truncated=traj.finish_reason in CUT_SHORT,
                    loss_mask=traj.loss_mask.astype(np.int64).tolist(),
                    refused=traj.finish_reason == REFUSED,
                    episode=episode_stats(traj),
                    episode_index=traj.sample_index,
                    segment=traj.segment,
                    failed=traj.failed,
                    routing=_routing_of(sg.group, traj, n_prompt),
                )
            )
    return out


def _routing_of(group: wire.TrajectoryGroup, traj: wire.Trajectory, n_prompt: int):
    """A sample's routing as the learner replays it (``Sample.routing``), or None."""
    shape = group.routing_shape
    if shape is None:
        return None
    parts = []
    prompt = (
        group.prompt_routed_experts if traj.prompt_token_ids is None else traj.prompt_routed_experts
    )
    for arr, n in ((prompt, n_prompt), (traj.routed_experts, len(traj.response_token_ids))):
        if arr is None:
            parts.append(np.full((n, shape.layers, shape.top_k), -1, dtype=np.int32))
        else:
            parts.append(shape.replay(arr).astype(np.int32))
    return np.concatenate(parts)


def episode_rows(samples: list[Sample]) -> list[int]:
    """For each sample, the index of its episode's statistics row (its first segment in the
    list), or -1 for a sample whose agent failed: ``advantages``' ``episode_of``."""
    first: dict[tuple[int, int], int] = {}
    out = []
    for i, s in enumerate(samples):
        if s.failed:
            out.append(-1)
            continue
        out.append(first.setdefault((s.group, s.episode_index), i))
    return out


def episode_stats(traj: wire.Trajectory) -> dict[str, float]:
    """What an episode did, for the step records: assistant turns, tool calls, failed ones,
    seconds in tools, a re-render mismatch (0/1), cut at max_turns (0/1), and the span of its
    sampled ids' versions (newest − oldest: how far the policy moved during the episode)."""
    sampled = traj.token_versions[traj.loss_mask == 1]
    return {
        "turns": float(sum(1 for role, _, _ in traj.turns if role == "assistant")),
        "tool_calls": float(len(traj.tool_calls)),
        "tool_errors": float(sum(1 for c in traj.tool_calls if not c.ok)),
        "tool_seconds": float(sum(c.seconds for c in traj.tool_calls)),
        "template_mismatch": float(traj.template_mismatch >= 0),
        "cut_max_turns": float(traj.finish_reason == "max_turns"),
        "version_span": float(sampled.max() - sampled.min()) if len(sampled) else 0.0,
    }


def response_mask(s: Sample) -> list[int]:
    """``s.loss_mask``, or all ones for a sample made without one."""
    return s.loss_mask or [1] * len(s.response_ids)


def sampled_tokens(s: Sample) -> int:
    """How many response ids the policy sampled (the ones that carry loss)."""
    return sum(s.loss_mask) if s.loss_mask else len(s.response_ids)


def encode_samples(samples: list[Sample]) -> bytes:
    rows = [
        [
            s.sample_id,
            s.group,
            np.asarray(s.prompt_ids, dtype="<u4").tobytes(),
            np.asarray(s.response_ids, dtype="<u4").tobytes(),
            np.asarray(s.behaviour_logp, dtype="<f4").tobytes(),
            s.reward,
            s.policy_version,
            s.truncated,
            np.asarray(response_mask(s), dtype="|u1").tobytes(),
            s.refused,
            s.episode_index,
            s.segment,
            s.failed,
            None
            if s.routing is None
            else [list(s.routing.shape), s.routing.astype("<i4").tobytes()],
        ]
        for s in samples
    ]
    return msgpack.packb(rows, use_bin_type=True)


def decode_samples(data: bytes) -> list[Sample]:
    rows = msgpack.unpackb(data, raw=False, strict_map_key=True)
    return [
        Sample(
            sample_id=r[0],
            group=int(r[1]),
            prompt_ids=np.frombuffer(r[2], dtype="<u4").astype(np.int64).tolist(),
            response_ids=np.frombuffer(r[3], dtype="<u4").astype(np.int64).tolist(),
            behaviour_logp=np.frombuffer(r[4], dtype="<f4").astype(np.float64).tolist(),
            reward=float(r[5]),
            policy_version=int(r[6]),
            truncated=bool(r[7]),
            loss_mask=np.frombuffer(r[8], dtype="|u1").astype(np.int64).tolist(),
            refused=bool(r[9]),
            episode_index=int(r[10]),
            segment=int(r[11]),
            failed=bool(r[12]),
            routing=None
            if r[13] is None
            else np.frombuffer(r[13][1], dtype="<i4").reshape(r[13][0]).copy(),
        )
        for r in rows
    ]


def broadcast_samples(
    samples: list[Sample] | None, *, rank: int, device: torch.device
) -> list[Sample]:
    """Rank 0's samples on every rank (a no-op without a process group or with one rank)."""
    if rank_world()[1] == 1:
        assert samples is not None
        return samples
    data = encode_samples(samples) if rank == 0 and samples is not None else None
    data = broadcast_bytes(data, rank=rank, device=device)
    if rank == 0:
        assert samples is not None, "rank 0 broadcasts the cycle it collected"
        return samples
    return decode_samples(data)


def step_order(n: int, *, seed: int, cycle: int, pass_index: int) -> list[int]:
    """The order samples are consumed in one pass: shuffled per (seed, cycle, pass)."""
    order = list(range(n))
    random.Random(f"tether-steps-{seed}-{cycle}-{pass_index}").shuffle(order)
    return order


def steps_of_cycle(n: int, *, steps: int, passes: int, seed: int, cycle: int) -> list[list[int]]:
    """Sample indices of each optimizer step of the cycle: ``steps`` per pass, each pass over
    all ``n`` samples once. Steps are ``n / steps`` samples (``train_batch_size``) when the cycle
    is full; a cycle that lost groups to the dead-letter stream still makes ``steps`` steps (the
    policy version stays ``cycle · steps`` at its start), of sizes differing by at most one."""
    if n < steps:
        raise ValueError(f"{n} samples cannot make {steps} optimizer steps")
    out = []
    for p in range(passes):
        order = step_order(n, seed=seed, cycle=cycle, pass_index=p)
        size, extra = divmod(n, steps)
        start = 0
        for k in range(steps):
            end = start + size + (1 if k < extra else 0)
            out.append(order[start:end])
            start = end
    return out


def as_batch_fields(s: Sample) -> dict[str, Any]:
    return {
        "prompt_ids": s.prompt_ids,
        "response_ids": s.response_ids,
        "behaviour_logp": s.behaviour_logp,
        "old_logp": s.old_logp or s.behaviour_logp,
        "ref_logp": s.ref_logp or [0.0] * len(s.response_ids),
        "advantage": s.advantages or [0.0] * len(s.response_ids),
        "response_mask": response_mask(s),
        "weight": s.weight,
        "routing": s.routing,
    }


def assign_advantages(samples: list[Sample], ln: LearnerConfig) -> int:
    """Every response token's advantage; zero-weight the groups filtered out. Returns how many
    samples the equal-reward filter took out.

    Sequence-level estimators give all tokens of a response its one advantage. With
    ``learner.kl_in_reward`` the KL penalty is folded into per-token rewards first
    (``advantages.kl_reward_advantages``, see ``reward_kl``): the reference log-probs must have
    been recomputed for this cycle before this is called. Group statistics count an episode of
    several segments once (``episode_rows``); a sample whose agent failed gets advantage 0 and
    weight 0 (``mask_failed`` counts those).
    """
    import torch

    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    rows = episode_rows(samples)
    segmented = any(s.segment or s.failed for s in samples)
    episode_of = torch.tensor(rows, dtype=torch.long) if segmented else None
    unbiased = ln.std_estimator == "unbiased"
    if ln.kl_in_reward:
        kl, mask = reward_kl(samples, ln)
        adv = adv_mod.kl_reward_advantages(
            rewards,
            groups,
            kl,
            mask,
            estimator=ln.advantage_estimator,
            kl_coef=ln.kl_coef,
            norm_by_std=ln.norm_adv_by_std,
            unbiased_std=unbiased,
            episode_of=episode_of,
        )
        for i, s in enumerate(samples):
            s.advantages = adv[i, : len(s.response_ids)].tolist()
    else:
        seq = adv_mod.compute_advantages(
            rewards,
            groups,
            estimator=ln.advantage_estimator,
            norm_by_std=ln.norm_adv_by_std,
            unbiased_std=unbiased,
            episode_of=episode_of,
        )
        for s, a in zip(samples, seq.tolist(), strict=True):
            s.advantages = [float(a)] * len(s.response_ids)
    for s in samples:
        if s.failed:
            s.weight = 0.0
    n_filtered = 0
    if ln.filter_equal_reward_groups:
        counted = [i for i, r in enumerate(rows) if r >= 0]
        keep, _ = adv_mod.equal_reward_group_mask(rewards[counted], groups[counted])
        for i, k in zip(counted, keep.tolist(), strict=True):
            if not k and samples[i].weight > 0:
                samples[i].weight = 0.0
                n_filtered += 1
    return n_filtered


def mask_failed(samples: list[Sample]) -> int:
    """How many samples of the cycle are episodes whose agent failed (weight 0 already: see
    ``assign_advantages``); counted as ``agent_failed_samples``."""
    return sum(1 for s in samples if s.failed)


def extra_segments(samples: list[Sample]) -> int:
    """Samples beyond the first segment of their episode: what an agent's broken turn
    continuity added to the cycle (``segment_samples`` in the books)."""
    return sum(1 for s in samples if s.segment > 0)


def mask_overlong(samples: list[Sample], ln: LearnerConfig) -> int:
    """DAPO's over-long filtering (``learner.overlong_filter``): a response cut off at
    ``run.max_response_tokens`` (or an episode cut at ``generator.max_turns``) gets weight 0, so
    it carries no loss, while its reward still counts in its group's advantages (the others are
    judged against it, as in DAPO). Returns how many responses it masked (those already at
    weight 0 are not counted again)."""
    if not ln.overlong_filter:
        return 0
    masked = 0
    for s in samples:
        if s.truncated and s.weight > 0:
            s.weight = 0.0
            masked += 1
    return masked


def mask_refused(samples: list[Sample]) -> int:
    """Episodes the generator's strict re-render check refused (``generator.template_check =
    "strict"``) get weight 0: no loss, while their rewards still count in their groups. Returns
    how many it masked (those already at weight 0 are not counted again)."""
    masked = 0
    for s in samples:
        if s.refused and s.weight > 0:
            s.weight = 0.0
            masked += 1
    return masked


def reward_kl(samples: list[Sample], ln: LearnerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The KL penalty's per-token estimate [N, T] and the loss mask [N, T] (float64): 1 on the
    ids the policy sampled, so tool and environment ids carry no penalty.

    The estimate is ``learner.kl_type`` (clamped by ``learner.kl_clamp``) of the behaviour
    log-probs against the reference log-probs: KL(π_behaviour ‖ π_ref) at the tokens the
    generator sampled. The behaviour policy is the one that drew them, so the sample average is an
    estimate of that KL; it is also the only log-prob of that policy a stale trajectory still has
    (the learner has moved on). verl's ``old_log_probs`` are the same quantity in its synchronous
    loop, recomputed by its trainer; Tether's come from vLLM, so the engine mismatch (the
    ``mismatch_*`` metrics) adds a little noise to the penalty.
    """
    import torch

    width = max((len(s.response_ids) for s in samples), default=0)
    behaviour = torch.zeros(len(samples), width, dtype=torch.float64)
    ref = torch.zeros_like(behaviour)
    mask = torch.zeros_like(behaviour)
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        assert len(s.ref_logp) == n, "reference log-probs are recomputed before the advantages"
        behaviour[i, :n] = torch.tensor(s.behaviour_logp, dtype=torch.float64)
        ref[i, :n] = torch.tensor(s.ref_logp, dtype=torch.float64)
        mask[i, :n] = torch.tensor(response_mask(s), dtype=torch.float64)
    kl = losses.kl_penalty(behaviour, ref, kind=ln.kl_type, clamp=ln.kl_clamp) * mask
    return kl, mask
