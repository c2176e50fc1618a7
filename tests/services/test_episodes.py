"""The agent loop (``services.generator.agent.tool_loop``) against the real tool sandbox, with a
scripted engine.

``ScriptedEngine`` is a fake of vLLM's engine, named as one: it answers each turn with ids the
test wrote, so the loop's bookkeeping (masks, versions, turns, tool calls, finish reasons, the
re-render check) can be checked exactly. The same loop runs on the real engine in
``tests/e2e/test_e2e_episodes.py`` (whole runs) and ``tests/e2e/test_demo_tools.py``.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from common.chat.tool_calls import FORMATS
from common.chat.turns import TurnEncoder, render_ids
from common.engine import SamplingSettings
from common.protocol import wire
from common.tools.registry import resolve_tools
from common.tools.sandbox import SandboxLimits, ToolSandbox
from services.generator.agent.tool_loop import EpisodeMetrics, EpisodeRunner, EpisodeSettings
from tests.fake_engine import ScriptedEngine
from tether.demo.tiny_model import build_tokenizer

SPECS = resolve_tools(["calculator", "python"])
TOOLS = [s.schema() for s in SPECS]
QUESTION = [{"role": "user", "content": "What is 123*4567?"}]
FINISHED: dict[str, float] = {}  # seconds from the start of _run to each episode's end
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*4567"}}</tool_call>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"), tools=True)


def _run(tok, script, *, max_turns=3, max_tokens=400, check="warn", limits=None, episodes=None):
    async def go():
        async with ToolSandbox(SPECS, workers=2, limits=limits or SandboxLimits()) as sandbox:
            enc = TurnEncoder(tok, end_ids={tok.convert_tokens_to_ids("<|im_end|>")}, tools=TOOLS)
            engine = ScriptedEngine(tok, script)
            runner = EpisodeRunner(
                engine=engine, tokenizer=tok, encoder=enc, tool_format=FORMATS["hermes"],
                sandbox=sandbox, metrics=EpisodeMetrics(),
                settings=EpisodeSettings(max_turns=max_turns, max_tokens=max_tokens,
                                         tool_output_max_chars=60, template_check=check),
            )  # fmt: skip
            prompt = render_ids(tok, QUESTION, tools=TOOLS, add_generation_prompt=True)
            sampling = SamplingSettings(temperature=1.0, max_tokens=1)
            names = episodes or list(script)
            started = time.monotonic()

            async def one(name):
                rec = await runner.run(prompt_ids=prompt, prompt_messages=QUESTION,
                                       sampling=sampling, request_id=name, version=7)  # fmt: skip
                FINISHED[name] = time.monotonic() - started
                return rec

            recs = await asyncio.gather(*(one(name) for name in names))
            return prompt, engine, dict(zip(names, recs, strict=True))

    return asyncio.run(go())


def _roundtrip(rec) -> wire.Trajectory:
    traj = rec.to_trajectory(sample_id="p/0", sample_index=0, timings={})
    group = wire.TrajectoryGroup(
        group_id="p", prompt_id="p", cycle=0, index=0, split="train",
        prompt_token_ids=np.asarray(rec.prompt_ids, dtype=np.uint32), prompt_text="q",
        ground_truth="561741", metadata={}, generator_id="g", samples=[traj],
    )  # fmt: skip
    back = wire.decode(wire.encode(group))
    assert isinstance(back, wire.TrajectoryGroup)
    return back.samples[0]


def test_a_tool_episode_token_in_token_out(tok):
    script = {"e": [CALL, ("\\boxed{561741}", [("7", 0, 3), ("8", 3, 10_000)])]}
    prompt, engine, recs = _run(tok, script)
    rec = recs["e"]
    assert rec.finish_reason == "stop" and rec.final_text == "\\boxed{561741}"
    # the second turn's prompt is exactly the ids so far: prompt + sampled + tool turn
    first, second = engine.prompts["e"]
    assert first == prompt and second == rec.prompt_ids + rec.ids[: rec.turns[2][1]]
    t = _roundtrip(rec)
    roles = [r for r, _, _ in t.turns]
    assert roles == ["assistant", "tool", "assistant"]
    (a0, a1), (t0, t1), (b0, b1) = ((s, e) for _, s, e in t.turns)
    assert t.loss_mask[a0:a1].all() and not t.loss_mask[t0:t1].any() and t.loss_mask[b0:b1].all()
    assert "561741" in tok.decode(t.response_token_ids[t0:t1].tolist())
    # versions per id: 7 for the first turn, an update inside the second (7 for 3 ids, then 8)
    assert set(t.token_versions[a0:a1].tolist()) == {7} and (t.token_versions[t0:t1] == -1).all()
    assert t.token_versions[b0:b1].tolist()[:4] == [7, 7, 7, 8] and t.policy_version == 7
    assert (t.behaviour_logprobs[t0:t1] == 0).all()
    (call,) = t.tool_calls
    assert (call.name, call.ok, call.turn) == ("calculator", True, 0)
    assert call.arguments == '{"expression": "123*4567"}'
    assert t.template_mismatch == -1


def test_bad_calls_are_answered_with_errors_and_counted(tok):
    bad = (
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
        "<tool_call>{oops}</tool_call>"
    )
    _, engine, recs = _run(tok, {"e": [bad, "\\boxed{1}"]})
    t = _roundtrip(recs["e"])
    assert [(c.name, c.ok, c.error) for c in t.tool_calls] == [
        ("calculator", False, "bad_arguments"),
        ("rm", False, "unknown_tool"),
        ("?", False, "malformed_call"),
    ]
    tool_turn = tok.decode(t.response_token_ids[t.turns[1][1] : t.turns[1][2]].tolist())
    assert tool_turn.count("Error: ") == 3 and "unknown tool 'rm'" in tool_turn
    assert t.finish_reason == "stop"


def test_max_turns_cuts_an_episode_that_keeps_calling(tok):
    _, _, recs = _run(tok, {"e": [CALL, CALL, CALL]}, max_turns=3)
    t = _roundtrip(recs["e"])
    assert t.finish_reason == "max_turns" and len(t.tool_calls) == 2  # the third is not run
    assert [r for r, _, _ in t.turns] == ["assistant", "tool"] * 2 + ["assistant"]


def test_max_tokens_cuts_a_turn_or_a_tool_answer(tok):
    _, _, recs = _run(tok, {"e": [CALL, "\\boxed{561741}"]}, max_tokens=40)
    t = _roundtrip(recs["e"])  # the call itself is longer than 40 ids
    assert t.finish_reason == "length" and len(t.response_token_ids) == 40 and not t.tool_calls
    long_output = (
        '<tool_call>{"name": "python", "arguments": {"code": "print(7 * 20)"}}</tool_call>'
    )
    room = len(tok(long_output, add_special_tokens=False).input_ids) + 1 + 5
    _, _, recs = _run(tok, {"e": [long_output, "\\boxed{1}"]}, max_tokens=room)
    t = _roundtrip(recs["e"])  # the answer's tool turn would not fit: not appended
    assert t.finish_reason == "length" and [r for r, _, _ in t.turns] == ["assistant"]
    assert len(t.tool_calls) == 1 and t.tool_calls[0].ok


def test_tool_output_is_cut_for_the_model(tok):
    code = '<tool_call>{"name": "python", "arguments": {"code": "print(\'x\' * 500)"}}</tool_call>'
    _, _, recs = _run(tok, {"e": [code, "\\boxed{1}"]})
    t = _roundtrip(recs["e"])
    shown = tok.decode(t.response_token_ids[t.turns[1][1] : t.turns[1][2]].tolist())
    assert (
        "x" * 60 in shown and "x" * 61 not in shown and "441 more characters cut" in shown
    )  # 500 x and a newline


@pytest.mark.parametrize("mode", ["warn", "strict", "off"])
def test_the_rerender_check_modes(tok, mode):
    # the model wrote the call without spaces; the template re-serialises it with them: found
    # and counted, but a valid call in another serialisation is not refused, even by strict
    # (tests/services/test_published_templates.py has the content mismatch strict refuses)
    terse = '<tool_call>{"name":"calculator","arguments":{"expression":"123*4567"}}</tool_call>'
    prompt, _, recs = _run(tok, {"e": [terse, "\\boxed{561741}"]}, check=mode)
    t = _roundtrip(recs["e"])
    at = len(prompt) + len(tok('<tool_call>{"name":', add_special_tokens=False).input_ids)
    want = {"warn": (at, "stop"), "strict": (at, "stop"), "off": (-1, "stop")}[mode]
    assert (t.template_mismatch, t.finish_reason) == want
    assert tok.decode(t.response_token_ids[: t.turns[0][2] - 1].tolist()) == terse  # as sampled


def test_a_slow_tool_holds_only_its_own_episode(tok):
    slow = '<tool_call>{"name": "python", "arguments": {"code": "import time\\ntime.sleep(2)"}}</tool_call>'
    script = {"slow": [slow, "\\boxed{0}"], "quick": [CALL, "\\boxed{561741}"]}
    _, _, recs = _run(tok, script)
    assert recs["quick"].finish_reason == "stop" and recs["slow"].tool_calls[0].ok
    assert recs["slow"].seconds["tool_s"] >= 2.0
    assert FINISHED["quick"] < 1.0 < 2.0 <= FINISHED["slow"]
