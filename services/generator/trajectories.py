"""What a generator publishes for one prompt: a ``wire.TrajectoryGroup`` of all its responses."""

from __future__ import annotations

from typing import Any

import numpy as np

from common.protocol import wire


class RolledBack(Exception):
    """The policy version went *down* while a prompt was generated: a learner restarted from a
    checkpoint older than what it had published, and the engine took its weights mid-episode.
    The episode mixes two timelines of training (its versions would decrease, which the wire
    refuses); it is generated again (``loop.py``). ``versions``: in the order sampled."""

    def __init__(self, versions: list[int]) -> None:
        super().__init__(" -> ".join(f"v{v}" for v in versions))
        self.versions = versions


def _check_order(versions: Any) -> None:
    v = np.asarray(versions)
    if len(v) > 1 and bool((np.diff(v) < 0).any()):
        raise RolledBack([int(x) for i, x in enumerate(v) if i == 0 or x != v[i - 1]])


def check_samples_order(samples: list[Any]) -> None:
    """``RolledBack`` if an engine ``Sample``'s weight-version spans go down."""
    for s in samples:
        spans = sorted(s.weight_versions, key=lambda w: w[1])
        _check_order([int(v) for v, _start, _end in spans if str(v).lstrip("-").isdigit()])


def check_episodes_order(trajectories: list[wire.Trajectory]) -> None:
    """``RolledBack`` if an episode's sampled tokens' versions go down (across turns)."""
    for t in trajectories:
        _check_order(np.asarray(t.token_versions)[np.asarray(t.loss_mask) == 1])


def split_routing(shape: Any, routed: Any, n_prompt: int, n_response: int) -> tuple[Any, Any]:
    """The engine's routing of one request (``[tokens it ran, L, K]``, the prompt's first) as the
    wire's prompt and response parts (``common.protocol.routing``), each as long as its ids: a
    token the engine did not run (a response's last: nothing is sampled after it) is not
    recorded. ``(None, None)`` without a shape or routing."""
    if shape is None or routed is None:
        return None, None
    arr = np.asarray(routed)

    def part(a: Any, n: int) -> Any:
        out = np.full((n, shape.layers, shape.top_k), -1, dtype=np.int64)
        out[: len(a)] = a[:n]
        return shape.encode(out)

    return part(arr[:n_prompt], n_prompt), part(arr[n_prompt : n_prompt + n_response], n_response)


def single_turn_trajectories(
    msg: wire.PromptMsg, samples: list[Any], *, started: float, version: int | None,
    prompt_len: int = 0, routing: Any = None,
) -> list[wire.Trajectory]:  # fmt: skip
    """The one-turn episodes of ``samples`` (the engine's ``Sample``s): every id sampled, with
    its behaviour log-prob and the version of its span. ``version`` labels a response the engine
    reported no spans for. ``routing`` (a ``RoutingShape``, routing replay on): each response's
    experts from the engine's (``prompt_len``: the prompt's ids, which come first in it)."""
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
        _, out[-1].routed_experts = split_routing(routing, s.routed_experts, prompt_len,
                                                  len(s.token_ids))  # fmt: skip
    return out


def to_group(
    msg: wire.PromptMsg,
    ids: list[int],
    trajectories: list[wire.Trajectory],
    *,
    generator_id: str,
    routing: Any = None,
    prompt_routing: Any = None,
) -> wire.TrajectoryGroup:
    """The group of ``msg``'s episodes (single-turn responses are episodes of one turn); a
    trajectory's ``policy_version`` is its oldest sampled token's — the one staleness is judged
    by. ``routing``: the model's ``RoutingShape`` (routing replay on; v3), ``prompt_routing``
    the prompt's experts as the engine ran it."""
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
        routing_shape=routing,
        prompt_routed_experts=prompt_routing if routing is not None else None,
    )
