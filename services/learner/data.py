"""The learner's prompt sets: loaded and validated before anything expensive starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config.schema import TetherConfig
    from common.data.datasets import PromptSet


def load_datasets(cfg: TetherConfig) -> tuple[PromptSet, PromptSet | None]:
    """(train, eval or None), tokenised with the policy's tokenizer. Bad rows and over-long
    prompts follow data.overlong_prompt_policy; ``DatasetError`` names the setting or the row.
    ``tether learner`` gets them from its preflight (``common.service.preflight``), which loads them the
    same way; this is for callers that build a learner without it."""
    from common.service.settings import policy_tokenizer, prompt_sets_for

    return prompt_sets_for(cfg, policy_tokenizer(cfg))
