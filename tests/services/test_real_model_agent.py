"""The one real pretrained model, SmolLM2-135M-Instruct (``tests.real_model``), through the
generator's OpenAI-compatible endpoint with its own published chat template (ChatML, from its
GGUF), over real HTTP with the ``openai`` client: the prompt the endpoint renders is the template's,
the ids and log-probs it records are what vLLM sampled, and a second turn continues the first
token for token (what the look-alike templates hid: issue 41's published Qwen3 template rewrote
earlier turns). SmolLM2's template renders no tools (tool episodes are refused for it at
start-up); tool-call formats per family, with every published template, are in
``test_published_templates.py`` (scripted engine). This module runs a real model's real text."""

from __future__ import annotations

import json
import time

import pytest

from common.config.load import load_config
from common.data.prompts import encode_prompt
from common.engine import SamplingSettings
from common.protocol import wire
from tests.engine_support import module_agent_runner, module_engine
from tests.real_model import staged_smollm2

pytestmark = pytest.mark.slow
QUESTION = "What is 12 + 30? Answer with the number."


@pytest.fixture(scope="module")
def model_dir():
    return staged_smollm2()


@pytest.fixture(scope="module")
def engine(model_dir):
    yield from module_engine(model_dir, max_model_len=1024, max_num_seqs=8)


@pytest.fixture(scope="module")
def runner(engine, model_dir):
    """The endpoint and the agents' loop on the engine's event loop, as a generator builds them
    for this model (Hermes-style calls, the tokenizer's end of turn)."""
    cfg = load_config(
        flags={"run.prompts_per_cycle": 1, "run.responses_per_prompt": 1,
               "run.train_steps_per_cycle": 1},
        overrides=[f"run.model={json.dumps(str(model_dir))}", "run.max_prompt_tokens=512",
                   "run.max_response_tokens=256", 'agent.run="tests.agents_for_tests:one_turn"',
                   "agent.timeout_s=60"],
        env={},
    ).config  # fmt: skip
    yield from module_agent_runner(engine, model_dir, cfg, version=3)


def test_two_turns_of_real_text_through_the_models_own_template(engine, runner):
    seen: list[dict] = []

    async def agent(client, task):
        messages = [{"role": "user", "content": QUESTION}]
        for follow in ("Now add 5 to it.", None):
            r = await client.chat.completions.create(
                model="p", messages=messages, max_tokens=40, logprobs=True,
                temperature=1.0, seed=7, extra_body={"return_token_ids": True})  # fmt: skip
            seen.append(r.model_dump())
            if follow:
                messages += [r.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": follow}]  # fmt: skip
        return 1.0

    runner.agent = agent
    msg = wire.PromptMsg(prompt_id=f"p{time.monotonic_ns()}", cycle=0, index=0, text=QUESTION,
                         ground_truth="42")  # fmt: skip
    ids = encode_prompt(runner.tok, QUESTION)
    (t,) = engine.run(runner.run_prompt(msg, ids, SamplingSettings(n=1, temperature=1.0,
                                        max_tokens=256), request_id=msg.prompt_id, version=3,
                                        started=time.time()))  # fmt: skip
    assert len(seen) == 2, f"the episode ended {t.finish_reason}: {t.error}"
    # the first prompt is the published template's rendering, its default system turn included
    assert seen[0]["prompt_token_ids"] == ids and "named SmolLM" in runner.tok.decode(ids)
    texts = [runner.tok.decode(s["choices"][0]["token_ids"]) for s in seen]
    print(f"\nreplies: {texts}")
    assert all(any(c.isalpha() for c in x) for x in texts)  # English from a real model
    # one episode, one segment: the second prompt continues the first exactly
    assert [s["tether"]["new_segment"] for s in seen] == [False, False]
    assert [r for r, _, _ in t.turns] == ["assistant", "env", "assistant"]
    end_of_env = t.turns[1][2]
    assert seen[1]["prompt_token_ids"] == ids + t.response_token_ids[:end_of_env].tolist()
    # what is trained is what was sampled: the ids and their log-probs, the env turn masked out
    sampled = [s["choices"][0]["token_ids"] for s in seen]
    first_end, second_start = t.turns[0][2], t.turns[2][1]
    assert t.response_token_ids[:first_end].tolist() == sampled[0]
    assert t.response_token_ids[second_start:].tolist() == sampled[1]
    mask = t.loss_mask.tolist()
    assert mask[:first_end] == [1] * first_end and set(mask[first_end:second_start]) == {0}
    lps = [e["logprob"] for s in seen for e in s["choices"][0]["logprobs"]["content"]]
    assert [lp for lp, m in zip(t.behaviour_logprobs.tolist(), mask, strict=True) if m] == (
        pytest.approx(lps)
    )
    assert min(lps) < -1.0  # sampled at temperature 1 from a real distribution
