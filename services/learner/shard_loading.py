"""Sharded start-up: build the model on the meta device, shard it, then let each rank read only
its own shards from the Hugging Face safetensors files, so that no rank ever holds the whole model.

The steps, each a function, so that a caller can put its own step between them (a LoRA wrap goes
between ``build_on_meta`` and the sharding, on meta parameters that cost nothing):

1. ``build_on_meta``: the model class of the directory's ``config.json``, built the way
   ``from_pretrained`` builds it (transformers' own init contexts: parameters and buffers on the
   meta device, no weight initialisation). Nothing is allocated.
2. the caller shards it (``model._shard``: FSDP2 ``fully_shard`` on meta parameters, which
   only records each rank's slice).
3. ``load_shards``: transformers' own loader (``convert_and_load_state_dict_in_model``, the
   function ``from_pretrained`` calls) over lazily opened safetensors files, single-file or
   indexed. For a sharded (DTensor) parameter it reads only this rank's rows from the file
   (``DtensorShardOperation``: a slice of the memory map), and for routed experts stored one
   tensor per expert it reads only the experts in this rank's slice before stacking them.
   The same weight conversions run as in ``from_pretrained`` (fused expert projections, renamed
   keys), then its finishing step: non-persistent buffers (rotary frequencies) computed, tied
   embeddings re-tied. So every family loads to the values ``from_pretrained`` gives (tested
   on every family of ``tether bench models`` at 1 and 2 ranks,
   ``tests/services/test_sharded_loading.py``).

Peak memory per rank: its shards, plus the few tensors the loader's threads hold while they
are converted (a stacked expert tensor is built from this rank's experts only). The
safetensors files are memory-mapped: the rows read count in the process's RSS as file pages
(``RssFile``) while they are mapped, not as anonymous memory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a Hugging Face directory: ``model.safetensors``, or every file the
    ``model.safetensors.index.json`` names. Refuses a directory with neither (a PyTorch
    ``.bin`` checkpoint is a pickle: convert it to safetensors first)."""
    path = Path(model_dir)
    if (path / INDEX_FILE).exists():
        index = json.loads((path / INDEX_FILE).read_text(encoding="utf-8"))
        names = sorted(set(index.get("weight_map", {}).values()))
        missing = [n for n in names if not (path / n).exists()]
        if not names or missing:
            raise ValueError(
                f"{path / INDEX_FILE} names {len(names)} weight file(s) and "
                f"{len(missing)} of them are missing ({', '.join(missing[:3])}): copy the whole "
                "model directory"
            )
        return [path / n for n in names]
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    raise ValueError(
        f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}: the learner loads Hugging Face "
        "safetensors weights (a .bin checkpoint is a pickle; re-save it with "
        "`save_pretrained(..., safe_serialization=True)`)"
    )


def build_on_meta(model_dir: str | Path, *, attn: dict[str, Any]) -> Any:
    """The causal LM of ``model_dir``'s config with every parameter on the meta device, built
    as ``from_pretrained`` builds it (fp32: the master weights). ``attn``: the
    ``attn_implementation`` argument, if any."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir), **attn)
    config.name_or_path = str(model_dir)
    return build_meta_from_config(config)


def build_meta_from_config(config: Any) -> Any:
    """``build_on_meta`` for a config object (an export uses it for the weight conversions)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class
    from transformers.utils.generic import ContextManagers

    cls = _get_model_class(config, AutoModelForCausalLM._model_mapping)
    with ContextManagers(cls.get_init_context(torch.float32, False, False, None)):
        model = cls(config)
    # Tied embeddings become one parameter now, before sharding: FSDP2 must see a single
    # parameter (one shard, one padded buffer), not two that the loader ties afterwards.
    model.tie_weights()
    return model


def load_shards(
    model: Any,
    model_dir: str | Path,
    *,
    device: torch.device,
    not_in_files: Callable[[str], bool] | None = None,
) -> None:
    """Fill ``model`` (built by ``build_on_meta``, sharded or not) from ``model_dir``'s
    safetensors files: each rank reads its own slices. Parameters land on ``device``.

    Refuses a checkpoint that misses a parameter or has one of another shape (``from_pretrained``
    would initialise it at random and train from noise). ``not_in_files(name)``: parameters the
    files do not hold by design (a LoRA adapter added on the meta model): they are allocated
    on ``device`` with transformers' default init, for the caller to set. A layer a LoRA
    adapter wraps reads the file's weights under its ``base_layer``."""
    import torch
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    files = safetensors_files(model_dir)
    conversions: Any = get_model_conversion_mapping(model, None, None)  # as from_pretrained's
    load_config = LoadStateDictConfig(
        pretrained_model_name_or_path=str(model_dir),
        device_map={"": str(device)},
        dtype=torch.float32,
        dtype_plan=model._get_dtype_plan(torch.float32),
        weight_mapping=conversions,
    )
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    try:
        wrapped = _wrapped_layers(model)
        lazy = {_as_wrapped(key, wrapped): h.get_slice(key) for h in handles for key in h.keys()}
        info, _ = convert_and_load_state_dict_in_model(model, lazy, load_config)
    finally:
        for h in handles:
            h.__exit__(None, None, None)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = sorted(k for k in set(info.missing_keys) - tied if not (not_in_files or _no)(k))
    if missing or info.mismatched_keys:
        shapes = [f"{k}: file {tuple(a)} vs model {tuple(b)}" for k, a, b in info.mismatched_keys]
        raise ValueError(
            f"{model_dir} does not hold every weight of its {type(model).__name__}: missing "
            f"{missing[:5]}{' …' if len(missing) > 5 else ''}, wrong shape {shapes[:3]}. Point "
            "the learner at a complete Hugging Face directory (its config.json and weights)"
        )
    if info.unexpected_keys:
        logger.warning(
            "%s: %d tensor(s) the model does not use were ignored (e.g. %s)",
            model_dir,
            len(info.unexpected_keys),
            sorted(info.unexpected_keys)[:3],
        )
    # from_pretrained's finishing step: buffers off meta (rotary frequencies computed), ties
    type(model)._finalize_model_loading(model, load_config, info)


def _no(_: str) -> bool:
    return False


def _wrapped_layers(model: Any) -> set[str]:
    """Names of the modules a wrap put around a layer of the file (a LoRA adapter: peft's
    layers keep the original layer as ``base_layer``)."""
    return {n for n, m in model.named_modules() if hasattr(m, "base_layer") and n}


def _as_wrapped(key: str, wrapped: set[str]) -> str:
    """A file's ``<layer>.weight`` as the wrapped model names it (``<layer>.base_layer.weight``)."""
    module, _, leaf = key.rpartition(".")
    return f"{module}.base_layer.{leaf}" if module in wrapped else key
