"""The generator's agent loop: one multi-turn, tool-using episode per sample.

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

A malformed call, an unknown tool or bad arguments get an error message as the tool's answer,
counted; nothing a model writes raises here. Each turn's tokens carry the version of the weights
that sampled them (an in-flight update may land between or inside turns).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from common.chat.tool_calls import ParsedTurn, ToolCall, ToolFormat
from common.chat.turns import TurnEncoder, rerender_mismatch
from common.telemetry.metrics import metric
from services.generator.recorder import EpisodeRecorder
from services.generator.seeds import episode_seed

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
            ["finish"], initial=("stop", "length", "max_turns", "template_mismatch"),
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
                                 "tool_error"),
        )  # fmt: skip
        self.tool_seconds = metric(
            "Histogram", "tether_generator_tool_seconds", "seconds per tool call",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )  # fmt: skip
        self.mismatches = metric(
            "Counter", "tether_generator_template_mismatches_total",
            "episodes whose re-rendered conversation differs from their ids",
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

    def _text(self, ids: list[int]) -> str:
        body = ids[:-1] if ids and ids[-1] in self.encoder.end_ids else ids
        return str(self.tokenizer.decode(body, skip_special_tokens=False))

    async def _answer(self, rec: EpisodeRecorder, call: ToolCall) -> dict[str, Any]:
        """Run one call (or answer its parse error); record it; the tool message."""
        if call.error:
            ok, reason, text, seconds = False, "malformed_call", f"Error: {call.error}", 0.0
        else:
            result = await self.sandbox.call(call.name, call.arguments)
            ok, reason, seconds = result.ok, result.reason, result.seconds
            text = _shown(result.text, self.s.tool_output_max_chars)
        rec.add_tool_call(name=call.name or "?", arguments=call.raw if call.error else
                          call.arguments, ok=ok, reason=reason, seconds=seconds)  # fmt: skip
        self.metrics.tool_calls.labels(call.name if call.name in self.sandbox.specs else "?").inc()
        self.metrics.tool_seconds.observe(seconds)
        if not ok:
            self.metrics.tool_errors.labels(reason).inc()
        return {"role": "tool", "name": call.name, "content": text}

    async def _turn(self, rec: EpisodeRecorder, sampling: Any, request_id: str, version: int):
        remaining = self.s.max_tokens - len(rec.ids)
        params = dataclasses.replace(sampling, n=1, max_tokens=remaining)
        (sample,) = await self.engine.generate_group(rec.context, params, request_id=request_id)
        ids = list(sample.token_ids)
        versions = versions_of(sample, len(ids), version)
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
            parsed = self.format.parse(self._text(ids))
            rec.messages.append(parsed.message())
            if sample.finish_reason == "length" or len(rec.ids) >= self.s.max_tokens:
                rec.finish_reason = "length"
                break
            if not parsed.calls:
                rec.finish_reason = "stop"
                break
            if turn == self.s.max_turns - 1:
                rec.finish_reason = "max_turns"
                break
            answers = await asyncio.gather(*(self._answer(rec, c) for c in parsed.calls))
            closed = bool(ids) and ids[-1] in self.encoder.end_ids
            delta = self.encoder.env_turn(list(answers), turn_closed=closed)
            if len(rec.ids) + len(delta) >= self.s.max_tokens:
                rec.finish_reason = "length"  # no room for the answer and a next turn
                break
            rec.add_context(delta, role="tool")
            rec.messages.extend(answers)
        rec.final_text = parsed.content
        self._check_template(rec)
        self.metrics.episodes.labels(rec.finish_reason).inc()
        self.metrics.turns.observe(rec.assistant_turns)
        return rec

    async def run_prompt(
        self, msg: Any, ids: list[int], sampling: Any, *, request_id: str, version: int,
        started: float,
    ) -> list[Any]:  # fmt: skip
        """A prompt's ``sampling.n`` episodes (``responses_per_prompt``; one for eval), run
        concurrently (their turns batch together in vLLM with every other prompt's), as the
        trajectories of its group."""
        from common.data.prompts import prompt_of

        prompt = prompt_of(msg)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        records = await asyncio.gather(*(
            self.run(prompt_ids=ids, prompt_messages=messages, sampling=sampling, response=i,
                     request_id=f"{request_id}/s{i}", version=version)
            for i in range(sampling.n)
        ))  # fmt: skip
        queued = {"queued_s": started - msg.created_at}
        return [
            rec.to_trajectory(sample_id=f"{msg.prompt_id}/{i}", sample_index=i, timings=queued)
            for i, rec in enumerate(records)
        ]

    async def close(self) -> None:
        await self.sandbox.close()

    def _check_template(self, rec: EpisodeRecorder) -> None:
        """The re-render check (``generator.template_check``) over everything before the last
        assistant turn; ``strict`` refuses a mismatching episode (the learner trains it with no
        loss, counted)."""
        if self.s.template_check == "off" or rec.assistant_turns < 2:
            return
        start = rec.last_assistant_start()
        messages = [*rec.prompt_messages, *rec.messages[:-1]]
        at = rerender_mismatch(self.encoder, messages, rec.prompt_ids + rec.ids[:start])
        rec.template_mismatch = at
        if at >= 0:
            self.metrics.mismatches.inc()
            if self.s.template_check == "strict":
                rec.finish_reason = "template_mismatch"


async def start_runner(
    cfg: Any, *, engine: Any, tokenizer: Any, generator_id: str
) -> EpisodeRunner:
    """The runner for ``cfg``'s episodes, its sandbox started (``runner.sandbox.close()`` at the
    end). Preflight has checked the tools, the format and the template, so errors here are
    the environment's (a sandbox that cannot start)."""
    import json
    from pathlib import Path

    from common.chat.tool_calls import tool_format
    from common.chat.turns import end_of_turn_ids
    from common.data.model_paths import policy_paths
    from common.protocol.run_dir import RunDir
    from common.tools.registry import resolve_tools
    from common.tools.sandbox import SandboxLimits, ToolSandbox

    g, run = cfg.generator, cfg.run
    specs = resolve_tools(g.tools)
    model_dir = policy_paths(cfg)[0]
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type", "")
    sandbox = ToolSandbox(
        specs,
        workers=g.tool_workers,
        limits=SandboxLimits(
            timeout_s=g.tool_timeout_s, cpu_s=g.tool_timeout_s, memory_mb=g.tool_memory_mb
        ),  # fmt: skip
        isolation=g.tool_sandbox,
        scratch_dir=str(RunDir.of(cfg).tool_scratch(generator_id)),
    )
    await sandbox.start()
    log.info("tool sandbox: %d workers, isolation %s, tools %s", g.tool_workers,
             sandbox.isolation, [s.name for s in specs])  # fmt: skip
    encoder = TurnEncoder(tokenizer, end_ids=end_of_turn_ids(tokenizer, model_dir),
                          tools=[s.schema() for s in specs])  # fmt: skip
    return EpisodeRunner(
        engine=engine,
        tokenizer=tokenizer,
        encoder=encoder,
        tool_format=tool_format(g.tool_format, model_type=model_type, vocab=tokenizer.get_vocab()),
        sandbox=sandbox,
        settings=EpisodeSettings(
            max_turns=g.max_turns,
            max_tokens=run.max_response_tokens,
            tool_output_max_chars=g.tool_output_max_chars,
            template_check=g.template_check,
        ),  # fmt: skip
    )
