"""Tiny random models in the structure of real model families, built here without a download.

Users bring Llama-3, Qwen2.5, Qwen3, Gemma-2, Phi-3 and MoE checkpoints; Tether's own fixture
(``common.demo.tiny_model``) is one architecture with a byte-level vocabulary. Each family here is
the family's own Hugging Face config class with small dimensions and the family's real
structure — untied ``lm_head`` where the family unties it, q/k-norm, soft-capping, sliding
windows, fused projection names, routed experts — plus a BPE tokenizer trained locally with the
family's special tokens and BOS convention (``common.demo.family_tokenizers``) and a chat template in
the family's format (``common.demo.family_templates``).

Builds are deterministic and cached inside the clone: ``build_family(name)`` writes
``.cache/families/<name>-<fingerprint>/`` once (atomically: build in a temporary directory,
then rename) and reuses it. Weights are saved in bf16 like published checkpoints; the learner
keeps fp32 master weights of those values.

Random weights give flat next-token distributions, which hide log-prob mismatches; every
model's final norm is scaled so its logits have a standard deviation of about
``LOGIT_STD`` (sampled log-probs then spread over several nats), and Gemma-2's query/key
projections are scaled so attention scores reach its soft-cap.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.demo import family_templates as templates
from common.demo.family_tokenizers import (
    LLAMA3_SPLIT,
    QWEN2_SPLIT,
    add_bos_processor,
    train_tokenizer,
)

BUILD_VERSION = 3  # bump when a change below alters the files a build writes
LOGIT_STD = 3.0
GEMMA_ATTN_SCORE_STD = 25.0  # pre-soft-cap attention scores; the cap is 50


@dataclass(frozen=True, kw_only=True)
class Family:
    """What makes a family: its HF architecture, tokenizer, special tokens and config knobs."""

    name: str  # short id: the cache directory, the test id, the README row
    title: str  # what users call it
    architecture: str  # HF ``architectures[0]``; vLLM registers a class of the same name
    model_type: str
    style: str  # tokenizer style: "byte_level" or "sentencepiece"
    specials_first: tuple[str, ...] = ()  # special tokens at ids 0..k-1
    specials_last: tuple[str, ...] = ()  # special tokens appended after the trained pieces
    trained_pieces: int = 8192  # tokenizer entries before specials_last (bytes included)
    split: str = LLAMA3_SPLIT  # byte-level regex split
    prefix_space: bool = True  # SentencePiece style: prepend "▁"
    bos: str | None = None  # added by add_special_tokens=True and carried by the template
    eos: str = ""  # the tokenizer's eos_token: what ends an assistant turn
    stop: tuple[str, ...] = ()  # generation_config eos ids besides ``eos``
    pad: str | None = None
    unk: str | None = None
    chat_template: str = ""
    vocab_multiple: int = 1  # the model's vocabulary is padded up to a multiple of this
    config: dict[str, Any] = field(default_factory=dict)  # the config class's own fields
    notes: str = ""  # what the family exercises


_LLAMA3_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
)  # fmt: skip
_QWEN_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip
_QWEN3_SPECIALS = (*_QWEN_SPECIALS, "<tool_response>", "</tool_response>", "<think>", "</think>")
_PHI3_ADDED = (
    "<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
    "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>",
    "<|user|>",
)  # fmt: skip

# What the Qwen2.5/Qwen3 tokenizers share: byte-level BPE with Qwen2's digit-by-digit split,
# ChatML turns ended by <|im_end|>, no BOS, a vocabulary padded to a multiple of 128.
_QWEN_TOKENIZER: dict[str, Any] = {
    "style": "byte_level", "split": QWEN2_SPLIT, "eos": "<|im_end|>", "stop": ("<|endoftext|>",),
    "pad": "<|endoftext|>", "vocab_multiple": 128,
}  # fmt: skip
_DENSE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048}  # fmt: skip

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="llama3", title="Llama 3.x", architecture="LlamaForCausalLM",
            model_type="llama", style="byte_level", specials_last=_LLAMA3_SPECIALS,
            bos="<|begin_of_text|>", eos="<|eot_id|>", stop=("<|end_of_text|>", "<|eom_id|>"),
            chat_template=templates.LLAMA3,
            config={**_DENSE, "head_dim": 64, "tie_word_embeddings": False,
                    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                        "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 256}},
            notes="untied lm_head, BOS, llama3 RoPE scaling, GQA",
        ),
        Family(
            name="qwen2.5", title="Qwen2.5", architecture="Qwen2ForCausalLM",
            model_type="qwen2", specials_last=_QWEN_SPECIALS, chat_template=templates.QWEN25,
            **_QWEN_TOKENIZER,
            config={**_DENSE, "tie_word_embeddings": False, "rope_theta": 1000000.0,
                    "use_sliding_window": False},
            notes="untied lm_head (7B+), q/k/v bias, padded vocabulary, no BOS",
        ),
        Family(
            name="qwen3", title="Qwen3", architecture="Qwen3ForCausalLM",
            model_type="qwen3", specials_last=_QWEN3_SPECIALS, chat_template=templates.QWEN3,
            **_QWEN_TOKENIZER,
            config={**_DENSE, "head_dim": 128, "tie_word_embeddings": True,
                    "rope_theta": 1000000.0},
            notes="q/k-norm, head_dim 128 ≠ hidden/heads, tied embeddings (≤4B), no BOS",
        ),
        Family(
            name="gemma2", title="Gemma 2", architecture="Gemma2ForCausalLM",
            model_type="gemma2", style="sentencepiece", prefix_space=False,
            specials_first=("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>",
                            "<end_of_turn>"),
            bos="<bos>", eos="<end_of_turn>", stop=("<eos>",), pad="<pad>", unk="<unk>",
            chat_template=templates.GEMMA,
            config={**_DENSE, "head_dim": 64, "query_pre_attn_scalar": 64,
                    "tie_word_embeddings": True, "sliding_window": 16,
                    "layer_types": ["sliding_attention", "full_attention"],
                    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                    "hidden_activation": "gelu_pytorch_tanh"},
            notes="logit and attention soft-capping, 16-token sliding window, BOS, "
            "tied embeddings scaled by √hidden",
        ),
        Family(
            name="phi3", title="Phi-3", architecture="Phi3ForCausalLM", model_type="phi3",
            style="sentencepiece", specials_first=("<unk>", "<s>", "</s>"),
            specials_last=_PHI3_ADDED, bos="<s>", eos="<|end|>",
            stop=("<|endoftext|>",), pad="<|endoftext|>", unk="<unk>",
            chat_template=templates.PHI3, vocab_multiple=64,
            config={**_DENSE, "num_key_value_heads": 4, "tie_word_embeddings": False,
                    "original_max_position_embeddings": 2048},
            notes="fused qkv_proj / gate_up_proj in the HF names, untied lm_head, BOS",
        ),
        Family(
            name="qwen3-moe", title="Qwen3-MoE", architecture="Qwen3MoeForCausalLM",
            model_type="qwen3_moe", specials_last=_QWEN3_SPECIALS, chat_template=templates.QWEN3,
            **_QWEN_TOKENIZER,
            config={**_DENSE, "head_dim": 64, "tie_word_embeddings": False,
                    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                    "decoder_sparse_step": 1, "norm_topk_prob": True, "rope_theta": 1000000.0},
            notes="8 routed experts (top-2), q/k-norm, untied lm_head",
        ),
    )
}  # fmt: skip


def clone_root() -> Path:
    """The repository clone this module lives in (the nearest parent with pyproject.toml)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").exists():
            return parent
    return here.parent


def default_root() -> Path:
    return clone_root() / ".cache" / "families"


def fingerprint(family: Family) -> str:
    spec = json.dumps({"v": BUILD_VERSION, **asdict(family)}, sort_keys=True, default=str)
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def build_family(name: str, root: str | Path | None = None) -> Path:
    """The model directory of family ``name`` under ``root`` (default ``.cache/families``),
    built on first use. Same name, same build: the directory name carries a fingerprint of
    the family's definition, so a changed definition builds afresh."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}: choose one of {', '.join(FAMILIES)}")
    family = FAMILIES[name]
    out = Path(root or default_root()) / f"{name}-{fingerprint(family)}"
    if (out / "tether_family.json").exists():
        return out
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = build_tokenizer(family, tmp)
    _build_model(family, tokenizer, tmp)
    (tmp / "tether_family.json").write_text(json.dumps({"family": name, **asdict(family)}))
    try:
        tmp.rename(out)
    except OSError:  # another process built it meanwhile: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_tokenizer(family: Family, out_dir: Path) -> Any:
    """Train the family's tokenizer and save it (with its chat template) to ``out_dir``."""
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer(
        style=family.style,  # type: ignore[arg-type]
        special_tokens=list(family.specials_first),
        vocab_size=family.trained_pieces,
        split_pattern=family.split,
        prefix_space=family.prefix_space,
    )
    tok.add_special_tokens(list(family.specials_last))
    if family.bos:
        add_bos_processor(tok, family.bos)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=family.bos,
        eos_token=family.eos,
        pad_token=family.pad,
        unk_token=family.unk,
        chat_template=family.chat_template,
    )
    fast.save_pretrained(str(out_dir))
    return fast


def _token_ids(tokenizer: Any, family: Family) -> dict[str, Any]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (family.eos, *family.stop)}
    return {
        "bos_token_id": tokenizer.convert_tokens_to_ids(family.bos) if family.bos else None,
        "eos_token_id": [ids[family.eos], *(ids[t] for t in family.stop)],
        "pad_token_id": tokenizer.convert_tokens_to_ids(family.pad) if family.pad else None,
    }


def _build_model(family: Family, tokenizer: Any, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    vocab = -(-len(tokenizer) // family.vocab_multiple) * family.vocab_multiple
    ids = _token_ids(tokenizer, family)
    config = AutoConfig.for_model(
        family.model_type, vocab_size=vocab, architectures=[family.architecture],
        **{**ids, "eos_token_id": ids["eos_token_id"][0]}, **family.config,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        _sharpen(model, family, tokenizer)
    model.generation_config = GenerationConfig(**ids)
    model.to(torch.bfloat16).save_pretrained(str(out_dir), safe_serialization=True)


def _sharpen(model: Any, family: Family, tokenizer: Any) -> None:
    """Scale the output projection (and, for Gemma-2, queries and keys) so distributions are
    peaked enough for a log-prob mismatch to show (see the module docstring)."""
    import torch

    if family.model_type == "gemma2":
        hidden, head_dim = model.config.hidden_size, model.config.head_dim
        scalar = model.config.query_pre_attn_scalar
        # score std = (σ² · hidden) · √head_dim / √scalar for unit-variance normed inputs
        sigma = (GEMMA_ATTN_SCORE_STD * (scalar / head_dim) ** 0.5 / hidden) ** 0.5
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.normal_(0.0, sigma, generator=torch.Generator().manual_seed(1))
    text = "What is 12+34? Answer in \\boxed{}. The quick brown fox jumps over the lazy dog."
    ids = torch.tensor([tokenizer(text, add_special_tokens=True).input_ids])
    # The final norm's gain scales the logits and nothing else. (Scaling a tied embedding
    # would also scale the input, and the model would only ever repeat its input token.)
    norm = model.model.norm
    offset = 1.0 if "Gemma" in type(norm).__name__ else 0.0  # Gemma's norm computes x·(1 + w)
    for _ in range(3):  # soft-capped logits are not linear in the gain: iterate
        std = float(model(input_ids=ids).logits.float().std())
        norm.weight.copy_((norm.weight + offset) * (LOGIT_STD / std) - offset)
