"""Tether's built-in tool loop (``generator.max_turns > 1``): one multi-turn, tool-using episode
per sample.

An episode alternates assistant turns (sampled by vLLM) and tool turns (the sandbox's answers,
appended as ids by template difference, ``common.chat.turns``). It ends when the model answers
without a tool call (``stop``), when its ids after the prompt reach ``run.max_response_tokens``
(``length``: the turn is cut there, or the tool turn that would pass it is not appended), or when
its last allowed assistant turn (``generator.max_turns``) still calls a tool (``max_turns``: the
call is not run).

Consumes a prompt's ids and messages; produces an ``EpisodeRecorder`` (ids, loss mask, log-probs,
per-token versions, turns, tool calls). Waits for vLLM (each turn is one request, batched with
every other episode's turns by the engine) and for the sandbox (an async call: a slow tool holds
only its own episode). Unblocked by the engine finishing a turn and a tool answering.

A malformed call, an unknown tool, bad arguments, or a call beyond the family's limit per turn
(``max_calls``: one for Llama 3.x) get an error message as the tool's answer, counted; nothing a
model writes raises here. An episode that cannot go on — its chat template refuses a turn
(``TemplateDeltaError``), a turn cannot be decoded or parsed — ends alone with finish
``episode_error`` and the reason in ``error`` (recorded and counted, never trained:
``tether_generator_episode_errors_total{reason}``); the prompt's other episodes and the
generator go on. Each turn's tokens carry the version of the weights
that sampled them (an in-flight update may land between or inside turns).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.chat.tool_calls import ParsedTurn, ToolCall, ToolFormat
from common.chat.tool_prompt import for_model
from common.chat.turns import (
    TemplateDeltaError,
    TurnEncoder,
    end_of_turn_ids,
    first_mismatch,
    mismatch_kind,
)
from common.data.prompts import prompt_of
from common.protocol.run_dir import RunDir
from common.telemetry.metrics import metric
from common.tools.registry import resolve_tools
from common.tools.sandbox import SandboxLimits, ToolSandbox
from services.generator.agent.recorder import EpisodeRecorder
from services.generator.seeds import episode_seed
from services.generator.trajectories import split_routing

if TYPE_CHECKING:
    from services.generator.settings import ToolLoopSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EpisodeSettings:
    max_turns: int  # assistant turns
    max_tokens: int  # ids after the prompt, sampled and appended
    tool_output_max_chars: int
    template_check: str  # warn | strict | off


class EpisodeMetrics:
    def __init__(self) -> None:
        self.episodes = metric(
            "Counter", "tether_generator_episodes_total", "episodes finished, by how they ended",
            ["finish"],
            initial=("stop", "length", "max_turns", "template_mismatch", "episode_error"),
        )  # fmt: skip
        self.errors = metric(
            "Counter", "tether_generator_episode_errors_total",
            "episodes ended because they could not go on, by reason", ["reason"],
            initial=("template", "parse", "encoding"),
        )  # fmt: skip
        self.turns = metric(
            "Histogram", "tether_generator_episode_turns", "assistant turns per episode",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
        )  # fmt: skip
        self.tool_calls = metric(
            "Counter", "tether_generator_tool_calls_total", "tool calls, by tool", ["tool"]
        )
        self.tool_errors = metric(
            "Counter", "tether_generator_tool_errors_total", "tool calls that failed, by reason",
            ["reason"], initial=("malformed_call", "unknown_tool", "bad_arguments", "timed_out",
                                 "output_exceeded", "killed", "out_of_memory", "worker",
                                 "tool_error", "extra_call"),
        )  # fmt: skip
        self.tool_seconds = metric(
            "Histogram", "tether_generator_tool_seconds", "seconds per tool call",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )  # fmt: skip
        self.mismatches = metric(
            "Counter", "tether_generator_template_mismatches_total",
            "episodes whose re-rendered conversation differs from their ids, by difference", ["difference"],
            initial=("tokens", "serialisation", "content"),
        )  # fmt: skip


def versions_of(sample: Any, n: int, fallback: int) -> list[int]:
    """Per-id policy versions of one engine ``Sample`` from its weight-version spans; ids the
    engine reported no span for get ``fallback`` (the version when the turn started: never
    newer than the truth)."""
    out = [fallback] * n
    for v, start, end in sample.weight_versions:
        if str(v).lstrip("-").isdigit():
            out[int(start) : min(int(end), n)] = [int(v)] * (min(int(end), n) - int(start))
    return out


def _shown(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n… ({len(text) - limit} more characters cut)"


class EpisodeRunner:
    def __init__(
        self,
        *,
        engine: Any,
        tokenizer: Any,
        encoder: TurnEncoder,
        tool_format: ToolFormat,
        sandbox: Any,
        settings: EpisodeSettings,
        metrics: EpisodeMetrics | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.encoder = engine, tokenizer, encoder
        self.format, self.sandbox, self.s = tool_format, sandbox, settings
        self.metrics = metrics or EpisodeMetrics()
        # routing replay (the model's RoutingShape, set by the generator): each episode carries
        # its ids' experts, and each prompt's (the first episode's) waits in ``prompt_routing``
        # for its group
        self.routing: Any = None
        self.prompt_routing: dict[str, Any] = {}

    def _text(self, ids: list[int]) -> str:
        body = ids[:-1] if ids and ids[-1] in self.encoder.end_ids else ids
        return str(self.tokenizer.decode(body, skip_special_tokens=False))

    async def _answer(self, call: ToolCall, extra: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """Run one call (or answer its parse error, or refuse a call past the family's limit
        per turn): the tool message and the call's record."""
        if call.error:
            ok, reason, text, seconds = False, "malformed_call", f"Error: {call.error}", 0.0
        elif extra:
            ok, reason, seconds = False, "extra_call", 0.0
            text = (f"Error: this model makes one tool call per turn; {call.name} was not run. "
                    "Call it in the next turn.")  # fmt: skip
        else:
            result = await self.sandbox.call(call.name, call.arguments)
            ok, reason, seconds = result.ok, result.reason, result.seconds
            text = _shown(result.text, self.s.tool_output_max_chars)
        record = {"name": call.name or "?", "arguments": call.raw if call.error else
                  call.arguments, "ok": ok, "reason": reason, "seconds": seconds}  # fmt: skip
        self.metrics.tool_calls.labels(call.name if call.name in self.sandbox.specs else "?").inc()
        self.metrics.tool_seconds.observe(seconds)
        if not ok:
            self.metrics.tool_errors.labels(reason).inc()
        return {"role": "tool", "name": call.name, "content": text, "tool_call_id": call.id}, record

    async def _turn(self, rec: EpisodeRecorder, sampling: Any, request_id: str, version: int):
        remaining = self.s.max_tokens - len(rec.ids)
        params = dataclasses.replace(sampling, n=1, max_tokens=remaining)
        (sample,) = await self.engine.generate_group(rec.context, params, request_id=request_id)
        ids = list(sample.token_ids)
        versions = versions_of(sample, len(ids), version)
        rec.add_routing(sample.routed_experts)
        rec.add_sampled(ids, list(sample.logprobs), versions, sample.seconds)
        return sample, ids

    async def run(
        self,
        *,
        prompt_ids: list[int],
        prompt_messages: list[dict[str, Any]],
        sampling: Any,
        request_id: str,
        version: int,
        response: int = 0,
    ) -> EpisodeRecorder:
        """One episode from ``prompt_ids``; ``version``: the engine's version at the start;
        ``response``: its index in the group (each turn samples with its own seed,
        ``seeds.episode_seed``)."""
        rec = EpisodeRecorder(prompt_ids, prompt_messages)
        parsed = ParsedTurn(content="")
        for turn in range(self.s.max_turns):
            seed = episode_seed(sampling.seed, response=response, turn=turn)
            turn_sampling = dataclasses.replace(sampling, n=1, seed=seed)
            sample, ids = await self._turn(rec, turn_sampling, f"{request_id}/t{turn}", version)
            version = max(versions_of(sample, len(ids), version) or [version])
            try:
                parsed, message = self._parse(ids, turn)
            except Exception as exc:  # a tokenizer or parser that fails on these ids
                self._fail(rec, "parse", f"turn {turn} could not be decoded or parsed: {exc!r}")
                break
            rec.messages.append(message)
            if sample.finish_reason == "length" or len(rec.ids) >= self.s.max_tokens:
                rec.finish_reason = "length"
                break
            if not parsed.calls:
                rec.finish_reason = "stop"
                break
            if turn == self.s.max_turns - 1:
                rec.finish_reason = "max_turns"
                break
            limit = self.format.max_calls
            done = await asyncio.gather(*(
                self._answer(c, extra=limit is not None and k >= limit)
                for k, c in enumerate(parsed.calls)
            ))  # fmt: skip
            answers = [message for message, _ in done]
            for _, record in done:  # in the order the model wrote the calls
                rec.add_tool_call(**record)
            closed = bool(ids) and ids[-1] in self.encoder.end_ids
            try:
                delta = self.encoder.env_turn(list(answers), turn_closed=closed)
            except TemplateDeltaError as exc:
                self._fail(rec, "template", f"turn {turn}'s tool results: {exc}")
                break
            except Exception as exc:  # the tokenizer failed on the rendered text
                self._fail(rec, "encoding", f"turn {turn}'s tool results: {exc!r}")
                break
            if len(rec.ids) + len(delta) >= self.s.max_tokens:
                rec.finish_reason = "length"  # no room for the answer and a next turn
                break
            rec.add_context(delta, role="tool")
            rec.messages.extend(answers)
        rec.final_text = parsed.content
        if rec.finish_reason != "episode_error":
            self._check_template(rec)
        self.metrics.episodes.labels(rec.finish_reason).inc()
        self.metrics.turns.observe(rec.assistant_turns)
        return rec

    def _parse(self, ids: list[int], turn: int) -> tuple[ParsedTurn, dict[str, Any]]:
        """The turn parsed, its calls given ids (the model's own, else ``TTTTKKKKK``: nine
        characters, as Mistral's template wants), and the message a client would hold: a turn
        with a malformed call, or more calls than the family allows, is held as the text the
        model wrote (a re-render then shows the model its own mistake)."""
        text = self._text(ids)
        parsed = self.format.parse(text)
        for k, call in enumerate(parsed.calls):
            call.id = call.id or f"{turn:04d}{k:05d}"
        limit = self.format.max_calls
        if any(c.error for c in parsed.calls) or (limit is not None and len(parsed.calls) > limit):
            return parsed, {"role": "assistant", "content": text}  # the model's mistake, as is
        return parsed, parsed.message(max_calls=self.format.max_calls)

    def _fail(self, rec: EpisodeRecorder, reason: str, why: str) -> None:
        log.warning("episode ended (%s): %s", reason, why)
        rec.finish_reason, rec.error = "episode_error", why[:1000]
        self.metrics.errors.labels(reason).inc()

    async def run_prompt(
        self, msg: Any, ids: list[int], sampling: Any, *, request_id: str, version: int,
        started: float,
    ) -> list[Any]:  # fmt: skip
        """A prompt's ``sampling.n`` episodes (``responses_per_prompt``; one for eval), run
        concurrently (their turns batch together in vLLM with every other prompt's), as the
        trajectories of its group."""
        prompt = prompt_of(msg)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        records = await asyncio.gather(*(
            self.run(prompt_ids=ids, prompt_messages=messages, sampling=sampling, response=i,
                     request_id=f"{request_id}/s{i}", version=version)
            for i in range(sampling.n)
        ))  # fmt: skip
        queued = {"queued_s": started - msg.created_at}
        out = [
            rec.to_trajectory(sample_id=f"{msg.prompt_id}/{i}", sample_index=i, timings=queued)
            for i, rec in enumerate(records)
        ]
        if self.routing is not None:
            for rec, t in zip(records, out, strict=True):
                prompt, t.routed_experts = split_routing(
                    self.routing, rec.routed, len(rec.prompt_ids), len(rec.ids))  # fmt: skip
                self.prompt_routing.setdefault(request_id, prompt)
        return out

    async def close(self) -> None:
        await self.sandbox.close()

    def _check_template(self, rec: EpisodeRecorder) -> None:
        """The re-render check (``generator.template_check``, ``common.chat.turns``) over
        everything before the last assistant turn: counted by kind; ``strict`` refuses an
        episode whose re-render differs in ``content`` (the learner trains it with no loss)."""
        if self.s.template_check == "off" or rec.assistant_turns < 2:
            return
        start = rec.last_assistant_start()
        messages = [*rec.prompt_messages, *rec.messages[:-1]]
        ids = rec.prompt_ids + rec.ids[:start]
        try:
            rendered = self.encoder._render(messages, add_generation_prompt=True)
        except Exception as exc:  # the template refuses the conversation as a client holds it
            log.info("re-render check: the template refused the conversation (%r)", exc)
            rendered = []
        at = first_mismatch(ids, rendered) if rendered else 0
        rec.template_mismatch = at
        if at >= 0:
            kind = mismatch_kind(self.tokenizer, ids, rendered) if rendered else "content"
            self.metrics.mismatches.labels(kind).inc()
            if self.s.template_check == "strict" and kind == "content":
                rec.finish_reason = "template_mismatch"


async def start_runner(
    settings: ToolLoopSettings, *, engine: Any, tokenizer: Any, generator_id: str
) -> EpisodeRunner:
    """The runner of the tool episodes ``settings`` describe, its sandbox started
    (``runner.sandbox.close()`` at the end). Preflight has checked the tools, the format and the
    template, so errors here are the environment's (a sandbox that cannot start)."""
    s = settings
    specs = resolve_tools(list(s.tools))
    model_dir = s.model_dir
    tokenizer, fmt = for_model(tokenizer, model_dir=model_dir, format_setting=s.tool_format,
                               mode=s.tool_prompt)  # fmt: skip
    sandbox = ToolSandbox(
        specs,
        workers=s.workers,
        limits=SandboxLimits(timeout_s=s.timeout_s, cpu_s=s.timeout_s, memory_mb=s.memory_mb),
        isolation=s.isolation,
        scratch_dir=str(RunDir(Path(s.run_dir)).tool_scratch(generator_id)),
    )
    await sandbox.start()
    log.info("tool sandbox: %d workers, isolation %s, tools %s", s.workers,
             sandbox.isolation, [t.name for t in specs])  # fmt: skip
    encoder = TurnEncoder(tokenizer, end_ids=end_of_turn_ids(tokenizer, model_dir),
                          tools=[t.schema() for t in specs])  # fmt: skip
    return EpisodeRunner(
        engine=engine,
        tokenizer=tokenizer,
        encoder=encoder,
        tool_format=fmt,
        sandbox=sandbox,
        settings=s.episode,
    )
