"""One cycle's training data: collected from scored groups (rank 0), shared with every rank,
turned into advantages and per-step, per-rank micro-batches.

Rank 0 reads the bus; the other ranks receive the cycle as msgpack bytes over the learner's
process group (two broadcasts: length, then bytes — no pickle), so every rank sees the same
samples in the same order and computes the same step assignments.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

if TYPE_CHECKING:
    import torch

    from common.protocol import wire


@dataclass
class Sample:
    sample_id: str
    group: int  # index of its group within the cycle
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logp: list[float]
    reward: float
    policy_version: int
    # filled in per cycle / per step
    advantages: list[float] = field(default_factory=list)  # one per response token
    old_logp: list[float] = field(default_factory=list)
    ref_logp: list[float] = field(default_factory=list)
    weight: float = 1.0  # 0 when dropped (staleness, equal-reward filter)


def samples_from_groups(groups: list[wire.ScoredGroup]) -> list[Sample]:
    """Flatten a cycle's groups, ordered by sampler position so the batch is deterministic."""
    out: list[Sample] = []
    for gi, sg in enumerate(sorted(groups, key=lambda s: s.group.index)):
        prompt = sg.group.prompt_token_ids.astype(np.int64).tolist()
        for traj, reward in zip(sg.group.samples, sg.rewards, strict=True):
            out.append(
                Sample(
                    sample_id=traj.sample_id,
                    group=gi,
                    prompt_ids=prompt,
                    response_ids=traj.response_token_ids.astype(np.int64).tolist(),
                    behaviour_logp=traj.behaviour_logprobs.astype(np.float64).tolist(),
                    reward=float(reward),
                    policy_version=int(traj.policy_version),
                )
            )
    return out


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
        )
        for r in rows
    ]


def broadcast_samples(
    samples: list[Sample] | None, *, rank: int, device: torch.device
) -> list[Sample]:
    """Rank 0's samples on every rank (a no-op without a process group or with one rank)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert samples is not None
        return samples
    data = encode_samples(samples) if rank == 0 and samples is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if rank == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, 0)
    if rank == 0:
        assert samples is not None, "rank 0 broadcasts the cycle it collected"
        return samples
    return decode_samples(buf.cpu().numpy().tobytes())


def step_order(n: int, *, seed: int, cycle: int, pass_index: int) -> list[int]:
    """The order samples are consumed in one pass: shuffled per (seed, cycle, pass)."""
    order = list(range(n))
    random.Random(f"tether-steps-{seed}-{cycle}-{pass_index}").shuffle(order)
    return order


def steps_of_cycle(n: int, *, batch: int, passes: int, seed: int, cycle: int) -> list[list[int]]:
    """Sample indices of each optimizer step of the cycle (``passes × n / batch`` steps)."""
    steps = []
    for p in range(passes):
        order = step_order(n, seed=seed, cycle=cycle, pass_index=p)
        steps += [order[i : i + batch] for i in range(0, n, batch)]
    return steps


def as_batch_fields(s: Sample) -> dict[str, Any]:
    return {
        "prompt_ids": s.prompt_ids,
        "response_ids": s.response_ids,
        "behaviour_logp": s.behaviour_logp,
        "old_logp": s.old_logp or s.behaviour_logp,
        "ref_logp": s.ref_logp or [0.0] * len(s.response_ids),
        "advantage": s.advantages or [0.0] * len(s.response_ids),
        "weight": s.weight,
    }
