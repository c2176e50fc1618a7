"""What a generator publishes for one prompt: a ``wire.TrajectoryGroup`` of all its responses."""

from __future__ import annotations

from typing import Any

from common.protocol import wire


def single_turn_trajectories(
    msg: wire.PromptMsg, samples: list[Any], *, started: float, version: int | None
) -> list[wire.Trajectory]:
    """The one-turn episodes of ``samples`` (the engine's ``Sample``s): every id sampled, with
    its behaviour log-prob and the version of its span. ``version`` labels a response the engine
    reported no spans for."""
    out = []
    for i, s in enumerate(samples):
        spans = [
            (int(start), int(v))
            for v, start, _end in s.weight_versions
            if str(v).lstrip("-").isdigit()
        ]
        out.append(
            wire.Trajectory.single_turn(
                sample_id=f"{msg.prompt_id}/{i}",
                sample_index=i,
                token_ids=s.token_ids,
                logprobs=s.logprobs,
                version_spans=spans or [(0, int(version or 0))],
                finish_reason=s.finish_reason,
                response_text=s.text,
                timings={"generate_s": s.seconds, "queued_s": started - msg.created_at},
            )
        )
    return out


def to_group(
    msg: wire.PromptMsg,
    ids: list[int],
    trajectories: list[wire.Trajectory],
    *,
    generator_id: str,
) -> wire.TrajectoryGroup:
    """The group of ``msg``'s episodes (single-turn responses are episodes of one turn); a
    trajectory's ``policy_version`` is its oldest sampled token's — the one staleness is judged
    by."""
    import numpy as np

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
