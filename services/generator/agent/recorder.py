"""The record of one episode as it happens, token in, token out: what becomes its
``wire.Trajectory``.

Whoever runs the episode feeds it in order: ``add_sampled`` for every assistant turn (the ids
exactly as the engine sampled them, their log-probs and versions), ``add_context`` for every
id the environment appends (tool results and the template's markup around them), and
``add_tool_call`` for each call. The built-in tool loop (``tool_loop``) does; so can anything
else that sees the engine's outputs, such as the OpenAI-compatible endpoint that records every
reply of an agent's conversation (``turns``): ``context`` is the ids the next request must
extend, and ``messages`` the conversation as such a client holds it.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from common.protocol import wire
from common.protocol.trajectory import MAX_ARGUMENT_CHARS


class EpisodeRecorder:
    def __init__(self, prompt_ids: list[int], prompt_messages: list[dict[str, Any]]) -> None:
        self.prompt_ids = list(prompt_ids)
        self.prompt_messages = list(prompt_messages)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.versions: list[int] = []
        self.turns: list[tuple[str, int, int]] = []
        self.tool_calls: list[wire.ToolCallRecord] = []
        self.messages: list[dict[str, Any]] = []  # after the prompt's
        self.final_text = ""
        self.finish_reason = ""
        self.template_mismatch = -1
        self.error = ""  # why an episode that could not go on ended (finish "episode_error")
        self.seconds = {"generate_s": 0.0, "tool_s": 0.0}
        # routing replay: the experts of every position of ``context`` recorded so far
        # ([positions, L, K], the prompt's first), see ``add_routing``
        self.routed: np.ndarray | None = None

    @property
    def context(self) -> list[int]:
        """The ids so far: the next assistant turn's prompt."""
        return self.prompt_ids + self.ids

    @property
    def assistant_turns(self) -> int:
        return sum(1 for role, _, _ in self.turns if role == "assistant")

    def last_assistant_start(self) -> int:
        """Index (into the response ids) where the last assistant turn starts."""
        return next(s for role, s, _ in reversed(self.turns) if role == "assistant")

    def add_sampled(
        self, token_ids: list[int], logprobs: list[float], versions: list[int], seconds: float
    ) -> None:
        """One assistant turn as sampled. ``versions``: the policy version of each id."""
        if not (len(token_ids) == len(logprobs) == len(versions)):
            raise ValueError("an assistant turn needs one log-prob and one version per id")
        if not token_ids:
            return
        start = len(self.ids)
        self.ids += [int(t) for t in token_ids]
        self.logprobs += [float(x) for x in logprobs]
        self.mask += [1] * len(token_ids)
        self.versions += [int(v) for v in versions]
        self.turns.append(("assistant", start, len(self.ids)))
        self.seconds["generate_s"] += seconds

    def add_routing(self, routed: Any) -> None:
        """The experts of an engine request over this episode's context (``Sample.routed_experts``:
        the request's positions from 0, as far as it ran). Each position keeps its first record:
        a sampled id's, from the pass of its own turn; the environment's ids (and a turn's last
        id, which its turn never ran), from the next turn's prefill, the pass whose sampling
        read them. Positions no request ran stay unrecorded (the learner routes them itself)."""
        if routed is None:
            return
        rows = np.asarray(routed)
        have = 0 if self.routed is None else len(self.routed)
        if len(rows) > have:
            self.routed = (
                rows if self.routed is None else np.concatenate([self.routed, rows[have:]])
            )

    def add_context(self, token_ids: list[int], *, role: str) -> None:
        """Ids the environment appends (role ``tool`` or ``env``): loss mask 0, version -1."""
        if not token_ids:
            return
        start = len(self.ids)
        self.ids += [int(t) for t in token_ids]
        self.logprobs += [0.0] * len(token_ids)
        self.mask += [0] * len(token_ids)
        self.versions += [-1] * len(token_ids)
        self.turns.append((role, start, len(self.ids)))

    def add_tool_call(
        self, *, name: str, arguments: Any, ok: bool, reason: str, seconds: float
    ) -> None:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        self.tool_calls.append(
            wire.ToolCallRecord(
                name=name[:200],
                arguments=text[:MAX_ARGUMENT_CHARS],
                ok=ok,
                error="" if ok else reason,
                seconds=float(seconds),
                turn=max(self.assistant_turns - 1, 0),
            )
        )
        self.seconds["tool_s"] += seconds

    def to_trajectory(
        self, *, sample_id: str, sample_index: int, timings: dict[str, float]
    ) -> wire.Trajectory:
        mask = np.asarray(self.mask, dtype=np.uint8)
        versions = np.asarray(self.versions, dtype=np.int32)
        sampled = versions[mask == 1]
        return wire.Trajectory(
            sample_id=sample_id,
            sample_index=sample_index,
            response_token_ids=np.asarray(self.ids, dtype=np.uint32),
            behaviour_logprobs=np.asarray(self.logprobs, dtype=np.float32),
            loss_mask=mask,
            token_versions=versions,
            policy_version=int(sampled.min()) if len(sampled) else 0,
            finish_reason=self.finish_reason or "stop",
            response_text=self.final_text,
            turns=list(self.turns),
            tool_calls=list(self.tool_calls),
            template_mismatch=self.template_mismatch,
            timings={**timings, **self.seconds},
            error=self.error,
        )
