"""Build a tiny Qwen2-architecture model + byte-level tokenizer on disk, with no download.

Used by the demo, the tests and the benchmarks: nothing can be fetched from a model hub here, so
Tether builds what it needs. The directory is a normal Hugging Face model directory that both
transformers and vLLM load. A randomly initialised model emits noise; the demo warms it up with a
short supervised pass (see ``tether.demo.warmup``) before RL.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# with tools=True: one token each, as in Qwen's tokenizers (and short episodes on this CPU)
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
BOS_TOKEN = "<s>"  # only with bos=True: a tokenizer that adds BOS, like Llama's, Mistral's, Gemma's

# A ChatML template like Qwen's, so `apply_chat_template` works for chat-style datasets.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# ChatML with Hermes-style tools, as Qwen2.5 writes them but with a short system turn: each tool
# as `name(parameter, ...)` (Qwen's full JSON schemas would make the tiny model's prompts four
# times longer, and every CPU step with them), calls as <tool_call> JSON blocks, consecutive
# tool results in one user turn of <tool_response> blocks.
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + tool['function']['name'] + '('"
    " + tool['function']['parameters']['properties'] | list | join(', ') + ')' }}{%- endfor %}"
    "{{- '\n</tools><|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\n' + message['content'] }}{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '\n<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + call['function']['arguments'] | tojson + '}</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>' + message['content'] + '</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def build_tokenizer(out_dir: str | Path, *, bos: bool = False, tools: bool = False):
    """Byte-level BPE with the 256 byte symbols and no merges, plus ChatML special tokens.

    ``bos=True``: the tokenizer also adds ``<s>`` in front of raw text (a ``TemplateProcessing``
    post-processor, as Llama's does) and its chat template writes ``<s>`` itself.
    ``tools=True``: ``TOOL_TOKENS`` are special tokens too and the template renders tools
    (``TOOLS_CHAT_TEMPLATE``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {sym: i for i, sym in enumerate(sorted(byte_alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        SPECIAL_TOKENS + ([BOS_TOKEN] if bos else []) + (TOOL_TOKENS if tools else [])
    )
    if bos:
        bos_id = tok.token_to_id(BOS_TOKEN)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, bos_id)],
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=BOS_TOKEN if bos else None,
        unk_token=None,
    )
    template = TOOLS_CHAT_TEMPLATE if tools else CHAT_TEMPLATE
    fast.chat_template = ("{{ bos_token }}" if bos else "") + template
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    vocab_size: int | None = None,
    seed: int = 0,
    bos: bool = False,
    tools: bool = False,
    rope_theta: float | None = None,
    overwrite: bool = False,
) -> Path:
    """Write tokenizer + randomly initialised Qwen2 model to ``out_dir``; reuse it if present.

    ``vocab_size`` (default: the tokenizer's size) pads the embedding and the tied LM head to a
    real tokenizer's vocabulary, e.g. 151936 for Qwen2.5, so a benchmark pays the LM head's cost;
    the extra rows are never produced by this tokenizer. ``bos``: a tokenizer that adds BOS
    (``build_tokenizer``); ``tools``: tool tokens and a tool-aware template; ``rope_theta``:
    the rotary base (None: transformers' default, 10000).

    Returns the directory. ``overwrite=False`` keeps an existing complete build (the marker file
    ``tether_tiny.json`` records the parameters that made it).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    params: dict[str, Any] = {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads or num_heads,
        "intermediate_size": intermediate_size or 4 * hidden_size,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
    }
    if vocab_size is not None:
        params["vocab_size"] = vocab_size  # absent when defaulted: older markers still match
    if bos:
        params["bos"] = True  # likewise
    if tools:
        params["tools"] = True  # likewise
    if rope_theta is not None:
        params["rope_theta"] = rope_theta  # likewise
    marker = out / "tether_tiny.json"
    if marker.exists() and not overwrite and json.loads(marker.read_text()) == params:
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, bos=bos, tools=tools)
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens"
        )
    rope: dict[str, Any] = {}
    if rope_theta is not None:
        rope["rope_parameters"] = {"rope_type": "default", "rope_theta": float(rope_theta)}
    config = Qwen2Config(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=params["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=params["num_kv_heads"],
        max_position_embeddings=max_position_embeddings,
        **rope,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        use_sliding_window=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    marker.write_text(json.dumps(params))
    return out
