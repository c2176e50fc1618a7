"""What the learner records of one optimizer step: the dict that goes to ``metrics.jsonl``, the
trackers, ``/metrics`` and ``tether status`` (``Rank0.record_step``), and that the pipeline,
reproducibility and learner benchmarks read."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from services.learner import losses
from services.learner.cycle import Sample


def step_record(
    *,
    version: int,
    cycle: int,
    samples: list[Sample],
    idx: list[int],
    step: Any,
    stats: list[dict[str, float]],
    dropped: int,
    trained: int,
    seconds: float,
) -> dict[str, Any]:
    """The record of the step that made policy ``version`` from the responses ``samples[idx]``
    (``step``: the ``train_step`` result; ``stats``: the loss function's per-micro-batch stats).
    Staleness is counted in optimizer steps: a response of version ``v`` trained in the step that
    turned ``version − 1`` into ``version`` lags ``version − 1 − v``."""
    rewards = [samples[i].reward for i in idx]
    lags = [version - 1 - samples[i].policy_version for i in idx]
    return {
        "step": version,
        "cycle": cycle,
        "loss": step.loss,
        "grad_norm": step.grad_norm,
        "lr": step.lr,
        "reward_mean": sum(rewards) / len(rewards),
        "dropped_stale": dropped,
        "trained_samples": trained,
        "seconds": seconds,
        "response_tokens": sum(len(samples[i].response_ids) for i in idx),
        "batch_digest": batch_digest(samples[i].sample_id for i in idx),
        "staleness_max": max(lags),
        # responses per staleness (index = optimizer steps behind): the measured distribution
        "staleness_counts": [lags.count(k) for k in range(max(lags) + 1)],
        **{k: v for k, v in losses.merge_stats(stats).items() if k != "tokens"},
    }


def batch_digest(ids: Iterable[str]) -> str:
    """A short fingerprint of a step's batch (its sample ids), to show resume picks the same one."""
    return hashlib.blake2b("\n".join(sorted(ids)).encode(), digest_size=8).hexdigest()
