"""What a generator publishes for one prompt: a ``wire.TrajectoryGroup`` of all its responses."""

from __future__ import annotations

from typing import Any

from common.protocol import wire


def rolled_back(samples: list[Any]) -> list[int] | None:
    """The versions of the first response whose tokens' policy version went *down* (a learner
    restarted from a checkpoint older than what it had published, and the engine took its
    weights mid-response), else None. Such a response mixes two timelines of training and its
    spans would not be ordered; it is generated again (``loop.py``)."""
    for s in samples:
        versions = [int(v) for v, _start, _end in sorted(s.weight_versions, key=lambda w: w[1])
                    if str(v).lstrip("-").isdigit()]  # fmt: skip
        if any(b < a for a, b in zip(versions, versions[1:], strict=False)):
            return versions
    return None


def to_group(
    msg: wire.PromptMsg,
    ids: list[int],
    samples: list[Any],
    *,
    started: float,
    generator_id: str,
    version: int | None,
) -> wire.TrajectoryGroup:
    """The group of ``msg``'s responses: each with its behaviour log-probs and the version spans
    of its tokens; a trajectory's ``policy_version`` is its first token's, the oldest — the one
    staleness is judged by. ``version`` labels a response the engine reported no spans for."""
    import numpy as np

    trajectories = []
    for i, s in enumerate(samples):
        spans = [
            (int(start), int(v))
            for v, start, _end in s.weight_versions
            if str(v).lstrip("-").isdigit()
        ]
        if not spans:
            spans = [(0, int(version or 0))]
        trajectories.append(
            wire.Trajectory(
                sample_id=f"{msg.prompt_id}/{i}",
                sample_index=i,
                response_token_ids=np.asarray(s.token_ids, dtype=np.uint32),
                behaviour_logprobs=np.asarray(s.logprobs, dtype=np.float32),
                policy_version=min(v for _, v in spans),
                version_spans=spans,
                finish_reason=s.finish_reason,
                response_text=s.text,
                timings={"generate_s": s.seconds, "queued_s": started - msg.created_at},
            )
        )
    return wire.TrajectoryGroup(
        group_id=msg.prompt_id,
        prompt_id=msg.prompt_id,
        cycle=msg.cycle,
        index=msg.index,
        split=msg.split,
        prompt_token_ids=np.asarray(ids, dtype=np.uint32),
        prompt_text=msg.text or (msg.messages[-1]["content"] if msg.messages else ""),
        ground_truth=msg.ground_truth,
        metadata=msg.metadata,
        generator_id=generator_id,
        samples=trajectories,
    )
