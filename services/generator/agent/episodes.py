"""An agent's episode as its requests reach the generator's endpoint: every reply recorded token
in, token out into the episode's ``EpisodeRecorder``, and turn continuity checked.

**Recording.** Each request is one assistant turn. Its prompt ids are found (below), vLLM samples
the turn from exactly those ids, and the recorder gets the ids between the previous turn and
this prompt (``add_context``: loss mask 0, version -1) and the sampled ids with their
behaviour log-probs and per-token versions (``add_sampled``): the same recorder, trajectory,
masks and versions as the built-in tool loop (``tool_loop``). Nothing is recorded for a request that
fails, is cancelled (its client went away) or arrives after its episode ended.

The tool calls a reply made are recorded (name and arguments) when a later request answers
them with tool messages; their outcome is the agent's business (Tether sees only the text sent
back), so they are recorded as ``ok``.

**Turn continuity.** The prompt of a chat request is found, in this order:

1. *extends the transcript*: the request's messages start with the conversation the client was
   handed so far (its first prompt, each reply as returned, the messages it added), with the same
   tools. The new messages are appended as ids by template difference (``TurnEncoder.env_turn``),
   after the ids as sampled: the model's turns are never re-rendered. This is the built-in loop's
   rule, so an agent that keeps its conversation gets token-identical trajectories;
2. *renders to an extension*: the whole conversation rendered through the chat template starts
   with the ids recorded so far (a template that re-renders the past faithfully); the rest is
   appended as environment ids;
3. otherwise the request starts a **new segment** of the same episode: a new recorder whose
   prompt is the rendered conversation. Each segment becomes a trajectory of its own in the
   group, trained as its own sample with the episode's reward (``Trajectory.segment``); segments
   are counted (``tether_generator_agent_segments_total``, ``segment_samples`` in the books).

A completion request (``/v1/completions``) gives its prompt as text or ids: the ids (text is
encoded as ``data.apply_chat_template = false`` prompts are) extend the recorded ids, or start
a new segment.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.chat.turns import TemplateDeltaError, TurnEncoder, render_ids
from common.protocol import wire
from services.generator.agent.openai_api import ApiError, Sampling
from services.generator.agent.recorder import EpisodeRecorder

FINISHED_REMEMBERED = 10_000  # ids of ended episodes that answer 409 rather than 404


@dataclass
class Segment:
    """One recorder and the conversation its client holds (template form), with its tools."""

    rec: EpisodeRecorder
    transcript: list[dict[str, Any]]
    tools_key: str
    closed: bool = True  # the last turn ended with an end-of-turn id
    last_finish: str = "stop"  # the last reply's: stop | length | tool_calls


@dataclass
class AgentEpisode:
    """One sample's episode: its segments, the run's sampling for it, and its state."""

    episode_id: str
    sampling: Sampling
    prompt_ids: list[int]  # the group's prompt (the dataset's encoding)
    prompt_messages: list[dict[str, Any]]
    request_prefix: str
    version_at_start: int
    segments: list[Segment] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tasks: set[asyncio.Task] = field(default_factory=set)  # requests being answered
    finished: bool = False
    cut: str = ""  # "length" or "max_turns" once a limit was reached
    turns: int = 0
    attempts: int = 0

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def last_text(self) -> str:
        seg = self.current
        return seg.rec.final_text if seg is not None else ""

    def trajectories(
        self, *, sample_id: str, sample_index: int, timings: dict[str, float],
        finish: str, final_text: str, agent_reward: dict[str, float] | None, error: str,
    ) -> list[wire.Trajectory]:  # fmt: skip
        """The episode's trajectories, one per segment (one empty one for an episode that made
        no request). ``finish``: how the episode ended (``stop``, ``agent_error``, …)."""
        segments = self.segments or [Segment(
            EpisodeRecorder(self.prompt_ids, self.prompt_messages), [], "")]  # fmt: skip
        out = []
        for k, seg in enumerate(segments):
            last = k == len(segments) - 1
            seg.rec.final_text = final_text
            seg.rec.finish_reason = finish if (last or finish.startswith("agent_")) else (
                "length" if seg.last_finish == "length" else "stop")  # fmt: skip
            t = seg.rec.to_trajectory(sample_id=sample_id if k == 0 else f"{sample_id}.{k}",
                                      sample_index=sample_index, timings=timings)  # fmt: skip
            t.segment, t.agent_reward, t.error = k, agent_reward, error
            if seg.rec.prompt_ids != self.prompt_ids:
                t.prompt_token_ids = np.asarray(seg.rec.prompt_ids, dtype=np.uint32)
            if not len(t.response_token_ids):
                t.policy_version = self.version_at_start
            out.append(t)
        return out


class EpisodeTable:
    """The open episodes by id (unguessable: 128 random bits), and the ids of ended ones."""

    def __init__(self) -> None:
        self.open: dict[str, AgentEpisode] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()

    def start(self, **kwargs: Any) -> AgentEpisode:
        ep = AgentEpisode(episode_id=secrets.token_hex(16), **kwargs)
        self.open[ep.episode_id] = ep
        return ep

    def get(self, episode_id: str) -> AgentEpisode:
        ep = self.open.get(episode_id)
        if ep is not None:
            return ep
        if episode_id in self.ended:
            raise ApiError(409, f"episode {episode_id} has ended; its trajectory is published",
                           code="episode_finished")  # fmt: skip
        raise ApiError(404, "no such episode: use the client Tether handed to your agent",
                       code="unknown_episode")  # fmt: skip

    def end(self, ep: AgentEpisode) -> None:
        """No request of ``ep`` is recorded from now on; those in flight are cancelled."""
        ep.finished = True
        self.open.pop(ep.episode_id, None)
        self.ended[ep.episode_id] = None
        while len(self.ended) > FINISHED_REMEMBERED:
            self.ended.popitem(last=False)
        for task in list(ep.tasks):
            task.cancel()


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two template-form messages say the same (tool-call ids aside)."""

    def key(m: dict[str, Any]) -> tuple:
        calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"],
                       sort_keys=True)) for c in m.get("tool_calls", []))  # fmt: skip
        return (m["role"], m.get("content") or "", calls,
                m.get("name") if m["role"] == "tool" else None)  # fmt: skip

    return key(a) == key(b)


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


@dataclass
class Prompt:
    """Where a request's turn starts: the segment (new or current), the ids to append before
    sampling (``delta``, with its role), and the full prompt vLLM receives."""

    segment: Segment
    new_segment: bool
    delta: list[int]
    role: str
    ids: list[int]
    answered: list[tuple[str, Any]] = field(default_factory=list)  # calls the new tool
    # messages answer: (name, arguments), in order


class ContinuityRules:
    """The prompt of each request (module docstring), for one tokenizer and template."""

    def __init__(self, *, tokenizer: Any, end_ids: set[int], max_encoders: int = 16) -> None:
        self.tokenizer, self.end_ids = tokenizer, end_ids
        self._encoders: OrderedDict[str, TurnEncoder] = OrderedDict()
        self.max_encoders = max_encoders

    def encoder(self, tools: list[dict[str, Any]] | None) -> TurnEncoder:
        key = tools_key(tools)
        enc = self._encoders.get(key)
        if enc is None:
            try:
                enc = TurnEncoder(self.tokenizer, end_ids=self.end_ids, tools=tools)
            except TemplateDeltaError as exc:
                raise ApiError(400, str(exc), code="template", param="tools") from None
            self._encoders[key] = enc
            if len(self._encoders) > self.max_encoders:
                self._encoders.popitem(last=False)
        return enc

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        try:
            return render_ids(self.tokenizer, messages, tools=tools, add_generation_prompt=True)
        except Exception as exc:  # a template error on what the client sent: its fault
            raise ApiError(400, f"the chat template cannot render these messages: {exc}"[:500],
                           code="template", param="messages") from None  # fmt: skip

    def chat(self, ep: AgentEpisode, messages: list[dict[str, Any]],
             tools: list[dict[str, Any]] | None) -> Prompt:  # fmt: skip
        seg, key = ep.current, tools_key(tools)
        if seg is not None and seg.rec.ids:
            n = len(seg.transcript)
            if (key == seg.tools_key and len(messages) > n and seg.transcript[-1]["role"] ==
                    "assistant" and all(map(same_message, messages[:n], seg.transcript))):  # fmt: skip
                new = messages[n:]
                try:
                    delta = self.encoder(tools).env_turn(new, turn_closed=seg.closed)
                except TemplateDeltaError as exc:  # the template refuses what the agent sent
                    raise ApiError(400, f"the chat template cannot render the new messages: "
                                   f"{exc}"[:600], code="template", param="messages") from None  # fmt: skip
                calls = seg.transcript[-1].get("tool_calls", [])
                answered = [(c["function"]["name"], c["function"]["arguments"])
                            for c, m in zip(calls, new, strict=False) if m["role"] == "tool"]  # fmt: skip
                return Prompt(seg, False, delta, _role(new), seg.rec.context + delta, answered)
            full = self.render(messages, tools)
            ctx = seg.rec.context
            if len(full) > len(ctx) and full[: len(ctx)] == ctx:
                return Prompt(seg, False, full[len(ctx) :], _role(messages[n:]), full)
        else:
            full = self.render(messages, tools)
        fresh = Segment(EpisodeRecorder(full, messages), [], key)
        return Prompt(fresh, bool(seg is not None and seg.rec.ids), [], "env", full)

    def completion(self, ep: AgentEpisode, ids: list[int]) -> Prompt:
        seg = ep.current
        if seg is not None and seg.rec.ids:
            ctx = seg.rec.context
            if len(ids) > len(ctx) and ids[: len(ctx)] == ctx:
                return Prompt(seg, False, ids[len(ctx) :], "env", ids)
        fresh = Segment(EpisodeRecorder(ids, []), [], "")
        return Prompt(fresh, bool(seg is not None and seg.rec.ids), [], "env", ids)


def _role(new: list[dict[str, Any]]) -> str:
    return "tool" if new and all(m["role"] == "tool" for m in new) else "env"
