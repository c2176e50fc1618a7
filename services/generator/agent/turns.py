"""One request of an agent's episode, answered: checked (``openai_api``), its prompt found
(``episodes.ContinuityRules``), sampled by the generator's vLLM engine, recorded, and
answered in OpenAI's shape with the model's tool calls parsed in its family's format
(``common.chat.tool_calls``).

Requests of one episode are answered one at a time (a per-episode lock): a second request sent
before the first was answered is sampled after it, from its own messages, so one that does not
extend the first's reply starts a new segment. Limits, each a 400 naming the setting:
``agent.max_requests`` requests per episode, ``agent.max_tokens_per_request``, and the episode's
``run.max_response_tokens`` (a segment's ids after its prompt) within the engine's context
(``run.max_prompt_tokens + run.max_response_tokens``). A reply cut at its token budget says
``finish_reason: "length"``; a request with no budget left gets ``context_length_exceeded``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.engine import SamplingSettings
from common.telemetry.metrics import metric
from services.generator.agent import openai_api as api
from services.generator.agent.episodes import AgentEpisode, ContinuityRules, Prompt
from services.generator.agent.tool_loop import versions_of


@dataclass(frozen=True, kw_only=True)
class TurnLimits:
    max_requests: int  # requests per episode (agent.max_requests)
    max_tokens_per_request: int  # agent.max_tokens_per_request
    max_response_tokens: int  # run.max_response_tokens: ids after a segment's prompt
    max_model_len: int  # the engine's context: prompt + response ids
    max_messages: int  # agent.max_messages


class AgentMetrics:
    def __init__(self) -> None:
        self.requests = metric(
            "Counter", "tether_generator_agent_requests_total",
            "requests to the agent endpoint, by how they were answered", ["outcome"],
            initial=("ok", "bad_request", "unauthorized", "unknown_episode", "finished_episode",
                     "too_large", "cancelled", "error"),
        )  # fmt: skip
        self.segments = metric(
            "Counter", "tether_generator_agent_segments_total",
            "requests that did not extend their episode's ids and started a new segment",
        )  # fmt: skip
        self.episodes = metric(
            "Counter", "tether_generator_agent_episodes_total",
            "agent episodes ended, by how", ["finish"],
            initial=("stop", "length", "max_turns", "agent_error", "agent_timeout"),
        )  # fmt: skip
        self.blocked = metric(
            "Counter", "tether_generator_agent_blocked_total",
            "times an agent's code blocked the agents' event loop past BLOCKED_AFTER_S",
        )  # fmt: skip
        self.extra_calls = metric(
            "Counter", "tether_generator_agent_extra_calls_total",
            "tool calls a reply did not return: past parallel_tool_calls = false",
        )  # fmt: skip


class AgentTurns:
    def __init__(
        self, *, engine: Any, tokenizer: Any, tool_format: Any, end_ids: set[int],
        limits: TurnLimits, version: Callable[[], int], metrics: AgentMetrics,
    ) -> None:  # fmt: skip
        self.engine, self.tokenizer, self.format = engine, tokenizer, tool_format
        self.end_ids, self.limits, self.version, self.metrics = end_ids, limits, version, metrics
        self.rules = ContinuityRules(tokenizer=tokenizer, end_ids=end_ids)

    # ------------------------------------------------------------------ requests
    async def chat(self, ep: AgentEpisode, body: Any) -> dict[str, Any]:
        req = api.parse_chat(body, sampling=ep.sampling, max_tokens=self.limits.max_tokens_per_request,
                             max_messages=self.limits.max_messages)  # fmt: skip
        if req.tools and self.format is None:
            raise api.bad("this model has no tool-call format Tether can parse, so tools "
                          "cannot be offered to it", "tools", "no_tool_format")  # fmt: skip
        limit = self.format.max_calls if self.format is not None else None
        if req.parallel_tool_calls and limit == 1:
            raise api.bad(f"parallel_tool_calls = true is not offered for this model: its chat "
                          f"template ({self.format.name}) allows one tool call per turn. Leave "
                          "parallel_tool_calls out or set it to false.", "parallel_tool_calls",
                          "unsupported_field")  # fmt: skip
        if req.parallel_tool_calls is False:
            limit = 1
        async with ep.lock:
            self._check_open(ep)
            prompt = self.rules.chat(ep, req.messages, req.tools)
            sample, ids, version = await self._sample(ep, prompt, req)
            text = self._text(ids, req.stop)
            parsed = self.format.parse(text) if req.tools else None
            reasoning = parsed.reasoning if parsed is not None else ""
            if parsed is None or any(c.error for c in parsed.calls):
                calls, content = [], text  # a malformed call is shown as the model wrote it
            else:
                calls, content = parsed.calls[:limit], parsed.content
                if len(parsed.calls) > len(calls):
                    self.metrics.extra_calls.inc(len(parsed.calls) - len(calls))
                for k, call in enumerate(calls):
                    call.id = call.id or f"{ep.turns:04d}{k:05d}"  # 9 characters (Mistral's)
            self._record(ep, prompt, sample, ids, version, final_text=content)
            seg = prompt.segment
            reply_msg: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning:
                reply_msg["reasoning_content"] = reasoning
            if calls:
                reply_msg["tool_calls"] = [c.message() for c in calls]
            if calls and seg.last_finish == "stop":
                seg.last_finish = "tool_calls"  # asked for tools: max_turns if never answered
            seg.transcript = [*req.messages, reply_msg]
            seg.rec.messages = [*req.messages[len(seg.rec.prompt_messages) :], reply_msg]
            finish = seg.last_finish  # stop | length | tool_calls
            tokens = [self.tokenizer.decode([t]) for t in ids] if req.logprobs else []
            reply = api.chat_reply(
                model=req.model, content=content,
                tool_calls=api.tool_call_entries(calls, f"{ep.episode_id[:8]}_{ep.turns}"),
                finish=finish, prompt_tokens=len(prompt.ids), tokens=tokens or [""] * len(ids),
                logprobs=list(sample.logprobs) if req.logprobs else None,
                extra=self._extra(ep, prompt), reasoning=reasoning,
            )  # fmt: skip
            return api.with_ids(reply, prompt.ids, ids) if req.return_token_ids else reply

    async def complete(self, ep: AgentEpisode, body: Any) -> dict[str, Any]:
        req = api.parse_completion(body, sampling=ep.sampling,
                                   max_tokens=self.limits.max_tokens_per_request)  # fmt: skip
        ids_in = req.prompt if isinstance(req.prompt, list) else list(
            self.tokenizer(req.prompt, add_special_tokens=True).input_ids)  # fmt: skip
        vocab = len(self.tokenizer)
        if any(t >= vocab for t in ids_in):
            raise api.bad(f"prompt has token ids beyond the vocabulary ({vocab})", "prompt")
        async with ep.lock:
            self._check_open(ep)
            prompt = self.rules.completion(ep, ids_in)
            sample, ids, version = await self._sample(ep, prompt, req)
            text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
            text = _cut_at_stop(text, req.stop)
            self._record(ep, prompt, sample, ids, version, final_text=text)
            prompt.segment.transcript = []  # a chat request after this renders in full
            tokens = [self.tokenizer.decode([t]) for t in ids]
            reply = api.completion_reply(
                model=req.model, text=text,
                finish="length" if prompt.segment.last_finish == "length" else "stop",
                prompt_tokens=len(prompt.ids), tokens=tokens,
                logprobs=list(sample.logprobs) if req.logprobs else None,
                extra=self._extra(ep, prompt),
            )  # fmt: skip
            return api.with_ids(reply, prompt.ids, ids) if req.return_token_ids else reply

    # ------------------------------------------------------------------ one turn
    def _check_open(self, ep: AgentEpisode) -> None:
        if ep.finished:
            raise api.ApiError(409, f"episode {ep.episode_id} has ended", code="episode_finished")
        if ep.turns >= self.limits.max_requests:
            ep.cut = ep.cut or "max_turns"
            raise api.bad(f"the episode has had its {self.limits.max_requests} requests "
                          "(agent.max_requests)", code="max_turns")  # fmt: skip

    async def _sample(self, ep: AgentEpisode, prompt: Prompt, req: api.TurnRequest):
        lim = self.limits
        used = 0 if prompt.segment is not ep.current else len(prompt.segment.rec.ids)
        room = min(lim.max_response_tokens - used - len(prompt.delta),
                   lim.max_model_len - len(prompt.ids))  # fmt: skip
        if room < 1:
            ep.cut = ep.cut or "length"
            for name, arguments in prompt.answered:  # the agent ran them: they are recorded
                prompt.segment.rec.add_tool_call(name=name, arguments=arguments, ok=True,
                                                 reason="", seconds=0.0)  # fmt: skip
            raise api.bad(
                f"the episode's token budget is spent: its prompt of {len(prompt.ids)} ids leaves "
                f"no room (run.max_response_tokens = {lim.max_response_tokens} ids after a "
                f"segment's prompt, {lim.max_model_len} in all)",
                "messages", "context_length_exceeded",
            )  # fmt: skip
        s = ep.sampling

        params = SamplingSettings(
            n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            max_tokens=min(req.max_tokens or room, room), stop=req.stop, seed=req.seed,
        )  # fmt: skip
        ep.attempts += 1
        version = self.version()
        (sample,) = await self.engine.generate_group(
            prompt.ids, params, request_id=f"{ep.request_prefix}/r{ep.attempts}"
        )
        if ep.finished:  # ended while this turn was sampled: nothing is recorded
            raise api.ApiError(409, f"episode {ep.episode_id} has ended", code="episode_finished")
        return sample, list(sample.token_ids), version

    def _record(self, ep: AgentEpisode, prompt: Prompt, sample: Any, ids: list[int],
                version: int, *, final_text: str) -> None:  # fmt: skip
        seg = prompt.segment
        if prompt.new_segment:
            self.metrics.segments.inc()
        if seg is not ep.current:
            ep.segments.append(seg)
        seg.rec.add_context(prompt.delta, role=prompt.role)
        for name, arguments in prompt.answered:  # before the turn: they belong to the last one
            seg.rec.add_tool_call(name=name, arguments=arguments, ok=True, reason="", seconds=0.0)
        versions = versions_of(sample, len(ids), version)
        seg.rec.add_sampled(ids, list(sample.logprobs), versions, sample.seconds)
        seg.closed = bool(ids) and ids[-1] in self.end_ids
        seg.last_finish = "length" if sample.finish_reason == "length" else "stop"
        seg.rec.final_text = final_text
        ep.turns += 1

    def _text(self, ids: list[int], stop: tuple[str, ...]) -> str:
        body = ids[:-1] if ids and ids[-1] in self.end_ids else ids
        return _cut_at_stop(str(self.tokenizer.decode(body, skip_special_tokens=False)), stop)

    @staticmethod
    def _extra(ep: AgentEpisode, prompt: Prompt) -> dict[str, Any]:
        return {"episode": ep.episode_id, "segment": len(ep.segments) - 1,
                "new_segment": prompt.new_segment, "turn": ep.turns}  # fmt: skip


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """OpenAI leaves a stop sequence out of the text."""
    cut = min((text.find(s) for s in stop if s in text), default=-1)
    return text if cut < 0 else text[:cut]


async def answered(ep: AgentEpisode, work: Any) -> Any:
    """Run ``work`` (a coroutine answering one of ``ep``'s requests) as a task the episode can
    cancel when it ends."""
    task = asyncio.ensure_future(work)
    ep.tasks.add(task)
    try:
        return await task
    finally:
        ep.tasks.discard(task)
