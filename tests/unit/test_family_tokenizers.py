"""The model-family fixtures' tokenizers and builds (``fixtures.model_families``): sizes, special
tokens, BOS conventions, chat templates, and that builds are deterministic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.data.prompts import encode_prompt
from fixtures.model_families import FAMILIES, build_family, build_tokenizer, default_root

pytestmark = pytest.mark.slow  # the first build of each family trains a tokenizer (~5 s)

ROOT = default_root()  # .cache/families: built once per clone, shared with the bench
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "\\boxed{4}"},
    {"role": "user", "content": "And 3+3?"},
]
TEXTS = ["What is 12+34? Answer in \\boxed{}.", "naïve café — 你好 😀\n\tindent", "  two  spaces"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def built(request):
    from transformers import AutoTokenizer

    model_dir = build_family(request.param, ROOT)
    return FAMILIES[request.param], model_dir, AutoTokenizer.from_pretrained(str(model_dir))


def test_vocabulary_and_special_tokens(built) -> None:
    family, model_dir, tok = built
    assert len(tok) >= 8192
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] >= len(tok) and config["architectures"] == [family.architecture]
    for special in (*family.specials_first, *family.specials_last):
        assert tok(special, add_special_tokens=False).input_ids == [
            tok.convert_tokens_to_ids(special)
        ], special
    assert tok.eos_token == family.eos and tok.bos_token == family.bos
    generation = json.loads((model_dir / "generation_config.json").read_text())
    stops = {tok.convert_tokens_to_ids(t) for t in (family.eos, *family.stop)}
    assert set(generation["eos_token_id"]) == stops


def test_bos_once_in_chat_prompts_and_per_convention_in_raw_text(built) -> None:
    family, _, tok = built
    chat_ids = encode_prompt(tok, CHAT)  # the generator's encoding: template, no added specials
    raw_with = tok(TEXTS[0], add_special_tokens=True).input_ids
    raw_without = tok(TEXTS[0], add_special_tokens=False).input_ids
    if family.bos:
        bos = tok.convert_tokens_to_ids(family.bos)
        assert chat_ids[0] == bos and chat_ids.count(bos) == 1
        assert raw_with == [bos, *raw_without]
    else:
        assert raw_with == raw_without
        assert tok.bos_token_id is None or tok.bos_token_id not in chat_ids


def test_chat_template_closes_turns_and_opens_the_assistant_turn(built) -> None:
    family, _, tok = built
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.count("\\boxed{4}") == 1 and "And 3+3?" in text and "Be brief." in text
    answered = tok.apply_chat_template(CHAT[:3], tokenize=False)
    after_answer = answered.split("\\boxed{4}", 1)[1]
    assert after_answer.startswith(family.eos), after_answer[:40]
    prompt = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    bare = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=False)
    assert prompt.startswith(bare) and len(prompt) > len(bare)


def test_decoding_restores_the_text(built) -> None:
    _, _, tok = built
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == text


def test_builds_are_deterministic(tmp_path: Path) -> None:
    """Two builds of a family, one tokenizer style each, are identical byte for byte."""
    for name in ("qwen2.5", "phi3"):
        first, second = (build_family(name, tmp_path / str(i)) for i in range(2))
        for f in ("tokenizer.json", "model.safetensors", "config.json"):
            assert (first / f).read_bytes() == (second / f).read_bytes(), f"{name}: {f}"
        assert (first / f).read_bytes() == (build_family(name, ROOT) / f).read_bytes()


def test_tokenizer_training_is_deterministic(tmp_path: Path) -> None:
    family = FAMILIES["gemma2"]
    build_tokenizer(family, tmp_path / "a")
    build_tokenizer(family, tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()
