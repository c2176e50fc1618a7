"""An agent's requests answered and recorded (``services.generator.agent.turns``), with a
scripted engine: turn continuity (a conversation that extends its recorded ids, one that
re-renders to an extension, one that breaks it and starts a new segment), the trajectories of
the segments, tool calls in OpenAI's shape, the limits, and the request checks.

``InOrderEngine`` (``tests/fake_engine.py``) is a fake of vLLM's engine, named as one: each
request answers the next scripted text, encoded and closed by the end-of-turn id, so the ids can
be checked exactly. The same code runs on the real engine over HTTP in ``tests/services/test_agent_endpoint.py``.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from common.chat.tool_calls import FORMATS
from common.chat.turns import render_ids
from common.protocol import wire
from services.generator.agent.episodes import EpisodeTable
from services.generator.agent.openai_api import ApiError, Sampling
from services.generator.agent.turns import AgentMetrics, AgentTurns, TurnLimits
from tests.fake_engine import InOrderEngine
from tether.demo.tiny_model import build_tokenizer

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}  # fmt: skip
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
QUESTION = [{"role": "user", "content": "What is 6*7?"}]
RUN = Sampling(temperature=1.0, top_p=1.0, top_k=0)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"), tools=True)


def _setup(tok, script, **limits):
    engine = InOrderEngine(tok, script)
    lim = {"max_requests": 8, "max_tokens_per_request": 200, "max_response_tokens": 400,
           "max_model_len": 800, "max_messages": 16, **limits}  # fmt: skip
    turns = AgentTurns(engine=engine, tokenizer=tok, tool_format=FORMATS["hermes"],
                       end_ids={engine.eos}, limits=TurnLimits(**lim), version=lambda: 3,
                       metrics=AgentMetrics())  # fmt: skip
    table = EpisodeTable()
    prompt = render_ids(tok, QUESTION, tools=[CALC], add_generation_prompt=True)
    ep = table.start(sampling=RUN, prompt_ids=prompt, prompt_messages=QUESTION,
                     request_prefix="p/s0", version_at_start=3)  # fmt: skip
    return engine, turns, table, ep, prompt


def _chat(turns, ep, messages, **extra):
    body = {"model": "m", "messages": messages, "tools": [CALC], **extra}
    return asyncio.run(turns.chat(ep, json.loads(json.dumps(body))))


def _trajectories(ep, **kw):
    return ep.trajectories(sample_id="p/0", sample_index=0, timings={}, finish="stop",
                           final_text="42", agent_reward={"agent": 1.0}, error="", **kw)  # fmt: skip


def test_a_tool_episode_through_the_endpoint_is_token_in_token_out(tok):
    engine, turns, _, ep, prompt = _setup(tok, [CALL, "\\boxed{42}"])
    r1 = _chat(turns, ep, QUESTION)
    choice = r1["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "6*7"}'}
    # the client sends back the reply as it got it, then the tool's answer
    history = [*QUESTION, choice["message"],
               {"role": "tool", "tool_call_id": call["id"], "content": "42"}]  # fmt: skip
    r2 = _chat(turns, ep, history)
    assert r2["choices"][0]["message"]["content"] == "\\boxed{42}"
    assert r2["tether"]["new_segment"] is False
    rec = ep.current.rec
    # the first request's prompt is the rendered conversation: here the group's prompt
    assert engine.prompts[0] == prompt and rec.prompt_ids == prompt
    # the second prompt is the ids so far: the first turn as sampled, then the tool turn
    first = [*tok(CALL, add_special_tokens=False).input_ids, engine.eos]
    assert engine.prompts[1][: len(prompt) + len(first)] == prompt + first
    assert engine.prompts[1] == rec.prompt_ids + rec.ids[: rec.turns[2][1]]
    assert [r for r, _, _ in rec.turns] == ["assistant", "tool", "assistant"]
    # the tool turn is what the built-in loop appends: template difference, name filled in
    delta = turns.rules.encoder([CALC]).env_turn(
        [{"role": "tool", "name": "calculator", "content": "42"}])  # fmt: skip
    assert rec.ids[rec.turns[1][1] : rec.turns[1][2]] == delta
    (t,) = _trajectories(ep)
    back = wire.decode(wire.encode(_group(prompt, [t])))
    s = back.samples[0]
    assert s.segment == 0 and s.prompt_token_ids is None and s.agent_reward == {"agent": 1.0}
    assert s.loss_mask.tolist() == [1] * len(first) + [0] * len(delta) + [1] * (
        len(s.loss_mask) - len(first) - len(delta))  # fmt: skip
    assert set(s.token_versions[s.loss_mask == 1].tolist()) == {3}
    assert set(s.token_versions[s.loss_mask == 0].tolist()) == {-1}


def test_a_conversation_that_rewrites_its_history_starts_a_new_segment(tok):
    engine, turns, _, ep, prompt = _setup(tok, ["I think 40.", "Let me redo: 42.", "\\boxed{42}"])
    segments_before = turns.metrics.segments._value.get()  # the registry is the process's
    r1 = _chat(turns, ep, QUESTION)
    follow = [*QUESTION, r1["choices"][0]["message"], {"role": "user", "content": "Sure?"}]
    r2 = _chat(turns, ep, follow)
    assert r2["tether"]["new_segment"] is False and r2["tether"]["segment"] == 0
    # the agent drops the model's earlier turns (a summary in their place): ids do not extend
    rewritten = [*QUESTION, {"role": "user", "content": "Summary: you said 40, then 42."}]
    r3 = _chat(turns, ep, rewritten)
    assert r3["tether"]["new_segment"] is True and r3["tether"]["segment"] == 1
    assert engine.prompts[2] == render_ids(tok, rewritten, tools=[CALC], add_generation_prompt=True)
    assert turns.metrics.segments._value.get() - segments_before == 1
    first, second = _trajectories(ep)
    assert (first.segment, second.segment) == (0, 1)
    assert first.sample_index == second.sample_index == 0
    assert second.sample_id == "p/0.1" and first.prompt_token_ids is None
    assert second.prompt_token_ids.tolist() == engine.prompts[2]
    assert first.agent_reward == second.agent_reward  # the episode's reward, on each
    assert [r for r, _, _ in first.turns] == ["assistant", "env", "assistant"]
    assert [r for r, _, _ in second.turns] == ["assistant"]
    back = wire.decode(wire.encode(_group(prompt, [first, second])))
    assert back.samples[1].prompt_token_ids.tolist() == engine.prompts[2]


def test_a_reply_sent_back_differently_is_accepted_when_it_renders_to_an_extension(tok):
    engine, turns, _, ep, _ = _setup(tok, ["Forty-two.", "Yes."])
    _chat(turns, ep, QUESTION)
    # the client trims the reply's content; the template renders it back to the same ids only
    # when nothing changed, so the full render does not extend: a new segment
    changed = [*QUESTION, {"role": "assistant", "content": "42."}, {"role": "user", "content": "?"}]
    assert _chat(turns, ep, changed)["tether"]["new_segment"] is True
    # an unchanged conversation sent with a different tool list renders (system turn) anew
    engine2, turns2, _, ep2, _ = _setup(tok, ["Forty-two.", "Yes."])
    r = _chat(turns2, ep2, QUESTION)
    again = [*QUESTION, r["choices"][0]["message"], {"role": "user", "content": "?"}]
    body = {"model": "m", "messages": again}  # no tools this time
    out = asyncio.run(turns2.chat(ep2, body))
    assert out["tether"]["new_segment"] is True


def test_completions_extend_the_ids_or_start_a_segment(tok):
    engine, turns, _, ep, prompt = _setup(tok, ["abc", "def", "xyz"])
    r1 = asyncio.run(turns.complete(ep, {"prompt": prompt, "return_token_ids": True}))
    ids1 = r1["choices"][0]["token_ids"]
    nxt = prompt + ids1 + tok("more", add_special_tokens=False).input_ids
    r2 = asyncio.run(turns.complete(ep, {"prompt": nxt}))
    assert r2["tether"]["new_segment"] is False and engine.prompts[1] == nxt
    r3 = asyncio.run(turns.complete(ep, {"prompt": "unrelated text"}))
    assert r3["tether"]["new_segment"] is True
    rec = ep.segments[0].rec
    assert [r for r, _, _ in rec.turns] == ["assistant", "env", "assistant"]


def test_limits_and_refusals_leave_the_episode_as_it_was(tok):
    engine, turns, table, ep, _ = _setup(
        tok, ["a", "b", "c"], max_requests=2, max_response_tokens=60
    )
    cases = [
        ({"temperature": 0.5}, "sampling_mismatch"),
        ({"stream": True}, "unsupported_field"),
        ({"n": 2}, "unsupported_field"),
        ({"max_tokens": 201}, "max_tokens_exceeded"),
        ({"frequency_penalty": 0.5}, "unsupported_field"),
        ({"bogus": 1}, "unknown_field"),
        ({"tool_choice": "required"}, "unsupported_field"),
    ]
    for extra, code in cases:
        with pytest.raises(ApiError) as err:
            _chat(turns, ep, QUESTION, **extra)
        assert err.value.status == 400 and err.value.code == code, (extra, err.value.message)
    with pytest.raises(ApiError) as err:
        _chat(turns, ep, QUESTION * 17)
    assert err.value.code == "too_many_messages"
    assert engine.prompts == [] and ep.segments == []
    _chat(turns, ep, QUESTION, temperature=1.0)  # restating the run's own value is fine
    r = _chat(turns, ep, [*QUESTION, {"role": "assistant", "content": "a"},
                          {"role": "user", "content": "go on"}])  # fmt: skip
    assert r["choices"][0]["finish_reason"] in ("stop", "length")
    with pytest.raises(ApiError) as err:  # agent.max_requests = 2
        _chat(turns, ep, QUESTION)
    assert err.value.code == "max_turns" and ep.cut == "max_turns"
    table.end(ep)
    with pytest.raises(ApiError) as err:
        table.get(ep.episode_id)
    assert err.value.status == 409
    with pytest.raises(ApiError) as err:
        table.get("0" * 32)
    assert err.value.status == 404


def test_a_spent_token_budget_is_a_400_and_cuts_the_episode(tok):
    engine, turns, _, ep, _ = _setup(tok, ["0123456789"], max_response_tokens=6)
    r = _chat(turns, ep, QUESTION)
    assert r["choices"][0]["finish_reason"] == "length"
    assert len(ep.current.rec.ids) == 6
    follow = [*QUESTION, r["choices"][0]["message"], {"role": "user", "content": "more"}]
    with pytest.raises(ApiError) as err:
        _chat(turns, ep, follow)
    assert err.value.code == "context_length_exceeded" and ep.cut == "length"


def _group(prompt, samples):
    return wire.TrajectoryGroup(
        group_id="p", prompt_id="p", cycle=0, index=0, split="train",
        prompt_token_ids=np.asarray(prompt, dtype=np.uint32), prompt_text="q",
        ground_truth="42", metadata={}, generator_id="g", samples=samples,
    )  # fmt: skip
