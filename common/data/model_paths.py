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
