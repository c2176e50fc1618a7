"""The learner's prompt sets: loaded and validated before anything expensive starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.config import ConfigError

if TYPE_CHECKING:
    from common.config import TetherConfig
    from common.datasets import PromptSet


def load_datasets(cfg: TetherConfig) -> tuple[PromptSet, PromptSet | None]:
    """(train, eval or None). Bad rows and over-long prompts follow data.overlong_prompt_policy;
    ``DatasetError`` names the file and row."""
    from transformers import AutoTokenizer

    from common.datasets import load_prompts
    from common.model_paths import policy_paths

    d, run = cfg.data, cfg.run
    if not d.train_path:
        raise ConfigError(
            "data.train_path is empty: set it to a JSONL/Parquet file or directory of prompts (the demo sets it)."
        )
    tokenizer = AutoTokenizer.from_pretrained(policy_paths(cfg)[1])

    def load(path: str, split: str) -> PromptSet:
        return load_prompts(
            path,
            format=d.format,
            prompt_key=d.prompt_key,
            answer_key=d.answer_key,
            metadata_keys=d.metadata_keys,
            tokenizer=tokenizer,
            apply_chat_template=d.apply_chat_template,
            max_prompt_tokens=run.max_prompt_tokens,
            overlong_policy=d.overlong_prompt_policy,
            split=split,
        )

    return load(d.train_path, "train"), (load(d.eval_path, "eval") if d.eval_path else None)
