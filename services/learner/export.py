"""Export the policy as a Hugging Face directory (safetensors + config + tokenizer).

``tether export CHECKPOINT OUT`` calls ``export_hf`` on a checkpoint directory (or a run directory,
meaning its latest checkpoint); the learner can also call it on the live (possibly FSDP-sharded)
model, which is a collective: every rank calls it and rank 0 writes. The output loads with
``transformers.AutoModelForCausalLM.from_pretrained`` and with vLLM.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json")


def _resolve_checkpoint(path: Path) -> Path:
    from services.learner.checkpoint import latest_checkpoint

    if (path / "meta.json").exists() and (path / "model.safetensors").exists():
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
    if isinstance(source, str | Path):
        ckpt = _resolve_checkpoint(Path(source))
        config, state = _state_from_checkpoint(ckpt)
        tok_dir: Path | None = Path(tokenizer_dir) if tokenizer_dir else _tokenizer_home(ckpt)
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
    _write_hf(config, state, out, tok_dir)
    logger.info("exported %s to %s", source if not hasattr(source, "config") else "model", out)
    return out
