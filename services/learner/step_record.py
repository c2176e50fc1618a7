"""What the learner records of one optimizer step: the dict that goes to ``metrics.jsonl``, the
trackers, ``/metrics`` and ``tether status`` (``Rank0.record_step``), and that the staleness and
learner benchmarks read."""

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
        # responses per staleness (index = optimizer steps behind): the measured distribution,
        # as `tether bench staleness` reports it
        "staleness_counts": [lags.count(k) for k in range(max(lags) + 1)],
        **episode_record([samples[i] for i in idx]),
        **{k: v for k, v in losses.merge_stats(stats).items() if k != "tokens"},
    }


def episode_record(samples: list[Sample]) -> dict[str, float]:
    """Per-step episode telemetry (single-turn responses are episodes of one turn without
    tools): means per episode of turns, tool calls and seconds in tools; the share of tool
    calls that failed; counts of episodes with a re-render mismatch and cut at max_turns; the
    largest version span (newest − oldest sampled version) of an episode."""
    eps = [s.episode for s in samples if s.episode]
    if not eps:
        return {}
    n = len(eps)
    calls = sum(e["tool_calls"] for e in eps)
    return {
        "episode_turns_mean": sum(e["turns"] for e in eps) / n,
        "tool_calls_per_episode": calls / n,
        "tool_call_rate": sum(1 for e in eps if e["tool_calls"] > 0) / n,
        "tool_error_rate": sum(e["tool_errors"] for e in eps) / calls if calls else 0.0,
        "tool_seconds_per_episode": sum(e["tool_seconds"] for e in eps) / n,
        "template_mismatches": sum(e["template_mismatch"] for e in eps),
        "episodes_cut_max_turns": sum(e["cut_max_turns"] for e in eps),
        "episode_version_span_max": max(e["version_span"] for e in eps),
    }


def batch_digest(ids: Iterable[str]) -> str:
    """A short fingerprint of a step's batch (its sample ids), to show resume picks the same one."""
    return hashlib.blake2b("\n".join(sorted(ids)).encode(), digest_size=8).hexdigest()
