"""Real BPE tokenizers trained here, in the two styles that the common model families use.

No tokenizer can be downloaded, so the model-family fixtures (``common.demo.model_families``) train
their own with the ``tokenizers`` library on a corpus generated below. Two styles:

- ``byte_level`` (Llama-3, Qwen2.5, Qwen3): GPT-2-style byte-level BPE after a regex split
  (the family's own pattern), so every byte sequence is encodable without an unknown token.
- ``sentencepiece`` (Gemma, Mistral, Phi-3): SentencePiece-style BPE: spaces become ``▁``,
  pieces start at a ``▁``, and characters outside the vocabulary fall back to the 256
  ``<0xNN>`` byte tokens (``byte_fallback``), as the families' ``tokenizer.json`` files do.

Special tokens come first in the vocabulary (ids ``0..k-1``), in the order the family gives.
The corpus and the training are deterministic: the same arguments give the same
``tokenizer.json``, byte for byte (``tests/services/test_model_families.py`` checks it).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any, Literal

Style = Literal["byte_level", "sentencepiece"]

# The regex splits of the families' tokenizers (Llama-3 keeps up to three digits together;
# Qwen2 splits every digit).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
CORPUS_LINES = 40_000

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "qu", "r", "s", "t",
           "v", "w", "z", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr"]  # fmt: skip
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "oo", "ou", "y"]
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "x"]
_PUNCT = [".", ",", "?", "!", ";", ":"]
_EXTRA = "é ü ß ñ ç ø å λ π Σ — … “ ” 你 好 世 界 😀".split()  # multi-byte UTF-8 pieces


def _word(rng: random.Random) -> str:
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
        for _ in range(rng.choice((1, 1, 2, 2, 3)))
    )


def corpus(seed: int = 0, lines: int = CORPUS_LINES) -> Iterator[str]:
    """Deterministic text: Zipf-distributed pseudo-words in sentences, arithmetic with
    ``\\boxed{}`` answers, numbers, code-like lines and some non-ASCII characters."""
    rng = random.Random(seed)
    lexicon = sorted({_word(rng) for _ in range(12_000)})
    rng.shuffle(lexicon)
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(lexicon))))
    for i in range(lines):
        kind = i % 5
        if kind == 0:
            a, b = rng.randrange(1000), rng.randrange(1000)
            yield f"What is {a}+{b}? Answer in \\boxed{{}}. The answer is \\boxed{{{a + b}}}."
        elif kind == 1:
            name, value = rng.choice(lexicon[:300]), rng.randrange(10**6)
            yield f"    {name}_{rng.randrange(9)} = compute({name}, {value}) * {rng.random():.3f}"
        else:
            words = rng.choices(lexicon, cum_weights=cum_weights, k=rng.randrange(4, 24))
            if rng.random() < 0.3:
                words.insert(rng.randrange(len(words)), rng.choice(_EXTRA))
            sentence = " ".join(words)
            yield sentence[:1].upper() + sentence[1:] + rng.choice(_PUNCT)


def train_tokenizer(
    *,
    style: Style,
    special_tokens: list[str],
    vocab_size: int,
    split_pattern: str = LLAMA3_SPLIT,
    prefix_space: bool = True,
    seed: int = 0,
) -> Any:
    """A trained ``tokenizers.Tokenizer`` with ``vocab_size`` entries, specials included.

    ``split_pattern``: the byte-level style's regex split. ``prefix_space``: the SentencePiece
    style prepends ``▁`` to the text (Llama-2/Mistral/Phi-3 do, Gemma does not).
    """
    if style == "byte_level":
        return _train_byte_level(special_tokens, vocab_size, split_pattern, seed)
    if style == "sentencepiece":
        return _train_sentencepiece(special_tokens, vocab_size, prefix_space, seed)
    raise ValueError(f"tokenizer style {style!r}: use 'byte_level' or 'sentencepiece'")


def _train_byte_level(specials: list[str], vocab_size: int, pattern: str, seed: int) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return tok


def _train_sentencepiece(specials: list[str], vocab_size: int, prefix_space: bool, seed: int):
    """Train with a ``Metaspace`` split, then rebuild the model with the byte tokens placed
    after the specials and ``byte_fallback`` on (the trainer cannot add either itself)."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    scheme = "first" if prefix_space else "never"
    meta = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=True)
    probe = Tokenizer(models.BPE())
    probe.pre_tokenizer = meta
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(BYTE_TOKENS),
        special_tokens=specials,
        limit_alphabet=200,
        show_progress=False,
    )
    probe.train_from_iterator(corpus(seed), trainer=trainer)
    trained = json.loads(probe.to_str())["model"]
    pieces = sorted(trained["vocab"].items(), key=lambda kv: kv[1])
    ordered = specials + BYTE_TOKENS + [p for p, _ in pieces if p not in set(specials)]
    vocab = {piece: i for i, piece in enumerate(ordered)}
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    unk = "<unk>" if "<unk>" in vocab else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True,
                               fuse_unk=True))  # fmt: skip
    # SentencePiece always adds its dummy prefix ("  x" -> "▁▁▁x"); a Metaspace pre-tokenizer
    # does not when the text starts with a space, so the prefix is a normalizer step, as in the
    # Llama-2-style tokenizer.json files (which also put a "▁" after every special token).
    steps_in = [normalizers.Prepend("▁")] if prefix_space else []
    tok.normalizer = normalizers.Sequence([*steps_in, normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens(specials)
    return tok


def add_bos_processor(tok: Any, bos: str) -> None:
    """Encoding with ``add_special_tokens=True`` puts ``bos`` first (Llama-3, Gemma, Mistral)."""
    from tokenizers import processors

    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
