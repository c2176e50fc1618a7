"""What the learner records of each optimizer step: ``step_record``, the dict that goes to
``metrics.jsonl``, the trackers (TensorBoard, W&B), ``/metrics`` and ``tether status``, and that
the staleness and learner benchmarks read; and the ``StepLog`` that writes it there, with the
step's counts (responses trained, dropped for staleness, filtered, masked over-long).

Rank 0 holds a ``StepLog``; every other rank a ``NoStepLog``, which records nothing."""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.protocol.run_dir import RunDir
from services.learner import losses
from services.learner.cycle import Sample
from services.learner.evaluation import append_jsonl
from services.learner.metrics import LearnerMetrics

if TYPE_CHECKING:
    from common.telemetry.trackers import Trackers

log = logging.getLogger(__name__)


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
    trained_digest, per_sample = samples_digests([samples[i] for i in idx])
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
        "samples_digest": trained_digest,
        "sample_digests": per_sample,
        "staleness_max": max(lags),
        # responses per staleness (index = optimizer steps behind): the measured distribution
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


def _sample_bytes(s: Sample) -> bytes:
    """What a sample contributes to the update and can differ between runs of one seed: its
    response token ids (as int64, little-endian) and its reward (as float64)."""
    ids = np.asarray(s.response_ids, dtype="<i8").tobytes()
    return struct.pack("<Q", len(s.response_ids)) + ids + struct.pack("<d", s.reward)


def samples_digests(batch: list[Sample]) -> tuple[str, list[str]]:
    """Fingerprints of what a step trained on, to compare two runs sample by sample: one over
    every sample's id, response token ids and reward (16 hex digits), and one per sample over
    its response token ids and reward (8 hex digits), in the order of the sorted sample ids
    (the ids themselves are ``batch_digest``'s). Hashing 64 responses of 32 ids takes ~0.1 ms;
    the per-sample list adds ~11 bytes per sample to the step's record."""
    ordered = sorted(batch, key=lambda s: s.sample_id)
    whole = hashlib.blake2b(digest_size=8)
    per_sample = []
    for s in ordered:
        data = _sample_bytes(s)
        whole.update(s.sample_id.encode() + b"\0" + data)
        per_sample.append(hashlib.blake2b(data, digest_size=4).hexdigest())
    return whole.hexdigest(), per_sample


class StepLog:
    """Rank 0: each step to Prometheus, ``metrics.jsonl``, the trackers and the log."""

    def __init__(self, run_dir: Path, *, trackers: Trackers) -> None:
        self.metrics = LearnerMetrics()
        self.metrics_path = RunDir(run_dir).metrics
        self.trackers = trackers

    def record(self, rec: dict[str, Any], st: Any) -> None:
        m = self.metrics
        m.steps.inc()
        m.version.set(rec["step"])
        m.tokens.inc(rec["response_tokens"])
        # responses that carried weight: not dropped for staleness, filtered or masked over-long
        m.trained.inc(rec["trained_samples"])
        m.dropped.inc(rec["dropped_stale"])
        m.step_seconds.labels("forward_backward").inc(st.forward_backward_seconds)
        m.step_seconds.labels("optimizer").inc(st.optimizer_seconds)
        m.last_step_time.set(time.time())
        scalars = {
            k: v
            for k, v in rec.items()
            if isinstance(v, (int, float)) and k not in ("step", "cycle")
        }
        for k, v in scalars.items():
            m.step.labels(k).set(v)
        self.trackers.log({f"train/{k}": v for k, v in scalars.items()}, rec["step"])
        append_jsonl(self.metrics_path, {"kind": "step", "time": time.time(), **rec})
        log.info(
            "step %d (cycle %d): loss %.4f reward %.3f grad %.3f lr %.2e staleness ≤ %d, %.1f s",
            rec["step"],
            rec["cycle"],
            rec["loss"],
            rec["reward_mean"],
            rec["grad_norm"],
            rec["lr"],
            rec["staleness_max"],
            rec["seconds"],
        )

    def count_masked(self, *, filtered: int, overlong: int) -> None:
        self.metrics.filtered.inc(filtered)
        self.metrics.overlong.inc(overlong)

    def observe_staleness(self, lag: int) -> None:
        """One response's staleness in optimizer steps, as the step that trains it sees it."""
        self.metrics.staleness.observe(lag)


class NoStepLog:
    """A rank other than 0: its steps are rank 0's steps, recorded there."""

    def record(self, rec: dict[str, Any], st: Any) -> None:
        pass

    def count_masked(self, *, filtered: int, overlong: int) -> None:
        pass

    def observe_staleness(self, lag: int) -> None:
        pass
