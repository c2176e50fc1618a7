"""The tools demo's agent loop written as user code (``tether.demo.tool_agent``, an ordinary
``openai`` client over real HTTP to the generator's endpoint) records trajectories token-identical
to the built-in loop's (``services.generator.agent.tool_loop``, with the real tool sandbox) for the same
sampled tokens.

``PolicyFake`` is a fake of vLLM's engine, named as one: its reply is a fixed function of the
prompt ids it is given (guess, call the calculator then box the product, or call it on every
turn until cut at max_turns; calls written with and without JSON spaces), with log-probs and a
mid-turn weight update that depend on the prompt too. Both loops therefore sample the same
tokens exactly when they send the same prompts, and any difference in what they record shows.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

from common.chat.tool_calls import FORMATS
from common.chat.turns import TurnEncoder
from common.config.load import load_config
from common.data.prompts import encode_prompt
from common.engine import SamplingSettings
from common.protocol import wire
from common.tools.registry import resolve_tools
from common.tools.sandbox import ToolSandbox
from services.generator.agent.runner import AgentRunner
from services.generator.agent.tool_loop import EpisodeMetrics, EpisodeRunner, EpisodeSettings
from services.generator.main import agent_settings
from tests.fake_engine import FakeEngine
from tether.demo import tool_agent
from tether.demo.tiny_model import build_tokenizer

QUESTIONS = [(417, 2093), (418, 2093), (419, 7001), (420, 1234), (421, 5555), (422, 9)]


class PolicyFake(FakeEngine):
    """A fake engine whose reply depends only on the prompt ids (see the module docstring)."""

    def __init__(self, tok) -> None:
        super().__init__(tok, logprob=0.0, version="7")

    def answer(self, ids, request_id):
        return self._text(self.tok.decode(ids, skip_special_tokens=False))

    def logprobs(self, ids, n):
        return [-((len(ids) + k) % 37 + 1) / 50 for k in range(n)]

    def spans(self, ids, n):
        prompt = self.tok.decode(ids, skip_special_tokens=False)
        v = 7 + prompt.count("<tool_response>")  # versions grow turn by turn
        half = n // 2 if len(ids) % 2 else n  # an update inside some turns
        return [(str(v), 0, half), (str(v + 1), half, n)]

    def _text(self, text: str) -> str:
        a, b = map(int, re.findall(r"What is (\d+)\*(\d+)\?", text)[-1])
        answered = text.count("<tool_response>")
        call = {"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}
        compact = json.dumps(call, separators=(",", ":")) if a % 2 else json.dumps(call)
        if a % 3 == 0:
            return f"\\boxed{{{round(a * b, -3)}}}"  # a guess
        if a % 3 == 1 and answered:
            return f"The product is \\boxed{{{a * b}}}"
        return f"<tool_call>{compact}</tool_call>"  # a % 3 == 2: calls on every turn


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"), tools=True)


def _msg(a: int, b: int) -> wire.PromptMsg:
    return wire.PromptMsg(prompt_id=f"q{a}", cycle=0, index=0, text=f"What is {a}*{b}?",
                          ground_truth=str(a * b), created_at=time.time())  # fmt: skip


def _builtin(tok, engine, max_response):
    async def go():
        specs = resolve_tools(["calculator"])
        async with ToolSandbox(specs, workers=2) as sandbox:
            runner = EpisodeRunner(
                engine=engine, tokenizer=tok, tool_format=FORMATS["hermes"], sandbox=sandbox,
                encoder=TurnEncoder(tok, end_ids={engine.eos}, tools=tool_agent.TOOLS),
                settings=EpisodeSettings(max_turns=3, max_tokens=max_response,
                                         tool_output_max_chars=2000, template_check="warn"),
                metrics=EpisodeMetrics(),
            )  # fmt: skip
            out = []
            for a, b in QUESTIONS:
                msg = _msg(a, b)
                ids = encode_prompt(tok, msg.text, tools=tool_agent.TOOLS)
                out.append((ids, await runner.run_prompt(
                    msg, ids, SamplingSettings(n=2), request_id=msg.prompt_id, version=7,
                    started=time.time())))  # fmt: skip
            return out

    return asyncio.run(go())


def _through_the_endpoint(tok, engine, max_response):
    cfg = load_config(
        flags={"run.prompts_per_cycle": 1, "run.responses_per_prompt": 2,
               "run.train_steps_per_cycle": 1},
        overrides=["run.max_prompt_tokens=400", f"run.max_response_tokens={max_response}",
                   'agent.run="tether.demo.tool_agent:run"', "agent.max_requests=3"],
        env={},
    ).config  # fmt: skip

    async def go():
        runner = AgentRunner(settings=agent_settings(cfg, "(unused)"), engine=engine,
                             tokenizer=tok, version=lambda: 7,
                             tool_format=FORMATS["hermes"], end_ids={engine.eos})  # fmt: skip
        await runner.start()
        try:
            out = []
            for a, b in QUESTIONS:
                msg = _msg(a, b)
                # the group's prompt is the dataset's encoding without tools: the agent's first
                # request brings the calculator's schema, so its segment carries its own prompt
                ids = encode_prompt(tok, msg.text)
                out.append(await runner.run_prompt(
                    msg, ids, SamplingSettings(n=2), request_id=msg.prompt_id, version=7,
                    started=time.time()))  # fmt: skip
            return out
        finally:
            await runner.close()

    return asyncio.run(go())


def _wire(t: wire.Trajectory) -> wire.Trajectory:
    g = wire.TrajectoryGroup(group_id="g", prompt_id="g", cycle=0, index=0, split="train",
                             prompt_token_ids=[1], prompt_text="", ground_truth="1",
                             metadata={}, generator_id="x", samples=[t])  # fmt: skip
    back = wire.decode(wire.encode(g))
    assert isinstance(back, wire.TrajectoryGroup)
    return back.samples[0]


@pytest.mark.parametrize("max_response, cut", [(260, "max_turns"), (160, "length")])
def test_the_demo_agent_through_the_endpoint_records_what_the_builtin_loop_records(
    tok, max_response, cut
):
    engine = PolicyFake(tok)
    builtin = _builtin(tok, engine, max_response)
    agent = _through_the_endpoint(tok, engine, max_response)
    finishes = set()
    for (prompt, ours), theirs in zip(builtin, agent, strict=True):
        assert len(theirs) == len(ours) == 2  # no extra segments: continuity held
        for b, a in zip(map(_wire, ours), map(_wire, theirs), strict=True):
            assert a.segment == 0 and not a.failed, a.error
            assert a.prompt_token_ids.tolist() == prompt  # the same prompt, ids and all
            assert a.response_token_ids.tolist() == b.response_token_ids.tolist()
            assert a.loss_mask.tolist() == b.loss_mask.tolist()
            assert a.behaviour_logprobs.tolist() == b.behaviour_logprobs.tolist()
            assert a.token_versions.tolist() == b.token_versions.tolist()
            assert a.policy_version == b.policy_version and a.turns == b.turns
            assert (a.finish_reason, a.response_text) == (b.finish_reason, b.response_text)
            assert [(c.name, json.loads(c.arguments), c.turn) for c in a.tool_calls] == [
                (c.name, json.loads(c.arguments), c.turn) for c in b.tool_calls]  # fmt: skip
            finishes.add((b.finish_reason, len(b.turns)))
    # the script covered a guess (1 turn), a call and its answer (3), and an episode that calls
    # on every turn: cut at max_turns (5 turns), or by its token budget before its third turn
    assert finishes == {("stop", 1), ("stop", 3), (cut, 5 if cut == "max_turns" else 3)}
