"""Reading checkpoints of format 1 (Tethers before sharded checkpoints): the whole model and the
whole optimizer state, gathered by rank 0 into ``model.safetensors``, ``optimizer.safetensors``
and ``optimizer.json``. They still resume (and export): every rank reads the whole files and
keeps its own shards, so resuming one costs a whole fp32 copy of the model and its optimizer
state per rank for a moment; the next checkpoint is written in the sharded format.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from services.learner import lora
from services.learner.checkpoint_state import joined_optimizer_state

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
ADAPTER_FILE = "adapter_model.safetensors"  # a LoRA learner's checkpoint (both formats)


def is_v1(checkpoint_dir: Path) -> bool:
    meta = json.loads((checkpoint_dir / "meta.json").read_text(encoding="utf-8"))
    return meta.get("format_version") == FORMAT_VERSION


def read_model_state(checkpoint_dir: Path, *, tie_word_embeddings: bool) -> dict[str, Any]:
    """The checkpoint's whole model state dict (CPU), with a tied ``lm_head.weight`` re-added."""
    from safetensors.torch import load_file

    state = load_file(str(checkpoint_dir / "model.safetensors"))
    if tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def load_state(checkpoint_dir: Path, *, model: Any, optimizer: Any) -> None:
    """Model and optimizer from a format-1 checkpoint (every rank reads the whole files)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    logger.warning(
        "%s is a format-1 (whole-state) checkpoint: every rank reads the whole model and "
        "optimizer state to resume from it; the next checkpoint is written sharded",
        checkpoint_dir,
    )
    options = StateDictOptions(full_state_dict=True)
    if (checkpoint_dir / ADAPTER_FILE).exists():  # LoRA: the adapter; the base is run.model
        lora.load_adapter_state(model, load_file(str(checkpoint_dir / ADAPTER_FILE)))
    else:
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        state = read_model_state(checkpoint_dir, tie_word_embeddings=tied)
        set_model_state_dict(model, state, options=options)
    meta = json.loads((checkpoint_dir / "optimizer.json").read_text(encoding="utf-8"))
    tensors = load_file(str(checkpoint_dir / "optimizer.safetensors"))
    set_optimizer_state_dict(
        model, optimizer, joined_optimizer_state(tensors, meta, prefix=""), options=options
    )
