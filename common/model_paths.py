"""Where a service finds the policy model and tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from common.config import ConfigError

if TYPE_CHECKING:
    from common.config import TetherConfig


def policy_paths(cfg: TetherConfig) -> tuple[str, str]:
    """(model directory, tokenizer directory); refuses a missing local directory up front."""
    model = cfg.run.model
    if not model:
        raise ConfigError(
            "run.model is empty: set it to a local Hugging Face model directory (--model DIR); "
            "`tether demo` builds a tiny one and sets it for you."
        )
    tok = cfg.run.tokenizer or model
    for what, path in (("run.model", model), ("run.tokenizer", tok)):
        p = Path(path)
        if (
            (p.is_absolute() or path.startswith("."))
            and not (p / "config.json").exists()
            and what == "run.model"
        ):
            raise ConfigError(
                f"{what} = {path!r} has no config.json: it must be a Hugging Face model directory."
            )
    return model, tok
