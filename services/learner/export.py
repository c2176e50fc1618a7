"""Export the policy as a Hugging Face directory (safetensors + config + tokenizer).

``tether export CHECKPOINT OUT`` calls ``export_hf`` on a checkpoint directory (or a run directory,
meaning its latest checkpoint); the learner can also call it on the live (possibly FSDP-sharded)
model, which is a collective: every rank calls it and rank 0 writes. The output loads with
``transformers.AutoModelForCausalLM.from_pretrained`` and with vLLM.

A LoRA policy (``learner.lora_rank``) is exported twice, side by side:

- ``OUT/merged/``: the base model with the adapter merged into its weights (peft's
  ``merge_and_unload``), a plain HF model directory like a full fine-tuning export;
- ``OUT/adapter/``: the PEFT adapter directory (``adapter_config.json``,
  ``adapter_model.safetensors``, the tokenizer), for ``peft.PeftModel.from_pretrained`` on the
  base model or vLLM's ``LoRARequest`` (``base_model_name_or_path`` names the base directory).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.learner import lora
from services.learner.checkpoint import ADAPTER_FILE

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json")


def _resolve_checkpoint(path: Path) -> Path:
    from services.learner.checkpoint import latest_checkpoint

    weights = ("model.safetensors", ADAPTER_FILE)
    if (path / "meta.json").exists() and any((path / w).exists() for w in weights):
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ValueError(
            f"{path} is neither a checkpoint directory (step-<N>/ with meta.json) nor a run "
            "directory with checkpoints/: pass `<run_dir>/checkpoints/step-<N>` or the run dir"
        )
    return latest


def _tokenizer_home(ckpt: Path) -> Path | None:
    """The checkpoint dir if it holds a tokenizer, else the model directory the run started from."""
    if any((ckpt / m).exists() for m in _TOKENIZER_MARKERS):
        return ckpt
    source = json.loads((ckpt / "meta.json").read_text(encoding="utf-8")).get("source_model_dir")
    return Path(source) if source else None


def _state_from_checkpoint(ckpt: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    from transformers import AutoConfig

    from services.learner.checkpoint import read_model_state

    config = AutoConfig.from_pretrained(str(ckpt))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return config, read_model_state(ckpt, tie_word_embeddings=tied)


def _write_hf(config: Any, state: dict[str, torch.Tensor], out: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = copy.deepcopy(config)
    config.use_cache = True  # the learner turns the KV cache off for training; inference wants it
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in state:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    model.load_state_dict(state, strict=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    model.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(tmp))
    generation_config = tokenizer_dir / "generation_config.json"
    if generation_config.exists():
        shutil.copyfile(generation_config, tmp / "generation_config.json")
    if out.exists():
        out.rmdir()  # checked empty by the caller
    tmp.rename(out)


def _adapter_from_checkpoint(ckpt: Path) -> tuple[str, dict, dict]:
    """(base model dir, adapter tensors, adapter config) of a LoRA checkpoint."""
    from safetensors.torch import load_file

    meta = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))
    base = meta.get("source_model_dir")
    if not base or not (Path(base) / "config.json").exists():
        raise ValueError(
            f"{ckpt} is a LoRA checkpoint whose base model directory {base!r} is not here: the "
            "adapter is exported merged into that base, so it must be readable where you export"
        )
    config = json.loads((ckpt / "adapter_config.json").read_text(encoding="utf-8"))
    return str(base), load_file(str(ckpt / ADAPTER_FILE)), config


def _write_lora(
    base_dir: str, state: dict, config: dict, *, out: Path, tokenizer_dir: Path
) -> None:
    """``OUT/adapter/`` (PEFT) and ``OUT/merged/`` (the base with the adapter merged in)."""
    import torch
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.learner.model import attention_kwargs

    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    adapter_dir, merged_dir = tmp / "adapter", tmp / "merged"
    adapter_dir.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(adapter_dir / ADAPTER_FILE))
    doc = {**config, "base_model_name_or_path": str(Path(base_dir).resolve())}
    (adapter_dir / "adapter_config.json").write_text(json.dumps(doc, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.save_pretrained(str(adapter_dir))
    base = AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, **attention_kwargs(base_dir)
    )
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.config.use_cache = True
    merged.save_pretrained(str(merged_dir))
    tokenizer.save_pretrained(str(merged_dir))
    generation_config = tokenizer_dir / "generation_config.json"
    if generation_config.exists():
        shutil.copyfile(generation_config, merged_dir / "generation_config.json")
    if out.exists():
        out.rmdir()  # checked empty by the caller
    tmp.rename(out)


def export_hf(
    source: str | Path | torch.nn.Module,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
) -> Path | None:
    """Write a HF model directory to ``out_dir`` from a checkpoint, a run dir, or a live model.

    ``tokenizer_dir``: where the tokenizer (and ``generation_config.json``) come from, usually the
    original model directory. For a checkpoint it defaults to the model directory the run started
    from (recorded in ``meta.json``); a live model needs it.
    Returns ``out_dir`` (``None`` on ranks other than 0 for a live sharded model).
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"export output {out} already exists and is not empty: pick a new path")
    adapter: tuple[str, dict, dict] | None = None  # LoRA: (base dir, adapter state, config)
    if isinstance(source, str | Path):
        ckpt = _resolve_checkpoint(Path(source))
        tok_dir: Path | None = Path(tokenizer_dir) if tokenizer_dir else _tokenizer_home(ckpt)
        if (ckpt / ADAPTER_FILE).exists():
            adapter = _adapter_from_checkpoint(ckpt)
        else:
            config, state = _state_from_checkpoint(ckpt)
    elif lora.is_lora(source):
        state = lora.adapter_state(source)  # collective under FSDP
        if not state:
            return None
        base = str(source.tether_source_dir)
        adapter = (base, state, lora.adapter_config(source, base_model=base))
        tok_dir = Path(tokenizer_dir) if tokenizer_dir else None
    else:
        from services.learner.gather import full_state_dict_cpu

        state = full_state_dict_cpu(source, drop_tied=False)  # collective under FSDP
        if not state:
            return None
        config = source.config
        tok_dir = Path(tokenizer_dir) if tokenizer_dir else None
    if tok_dir is None:
        raise ValueError(
            "the checkpoint does not record the model directory it started from, so there is no "
            "tokenizer to copy: pass the tokenizer directory (tether export … --tokenizer DIR)"
        )
    if not any((tok_dir / m).exists() for m in _TOKENIZER_MARKERS):
        raise ValueError(
            f"no tokenizer found in {tok_dir}: pass tokenizer_dir (the original model directory "
            "the run started from) so the export is loadable on its own"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    if adapter is not None:
        _write_lora(*adapter, out=out, tokenizer_dir=tok_dir)
    else:
        _write_hf(config, state, out, tok_dir)
    logger.info("exported %s to %s", source if not hasattr(source, "config") else "model", out)
    return out
