"""The one prompt encoding: the loader counts prompt tokens with ``encode_prompt`` and the
generator builds what vLLM receives with it (``prompt_of`` takes a record's or a wire
``PromptMsg``'s prompt), so the length check and the generated prompt cannot differ; the solver
encodes its prompts the same way. It follows the tokenizer's own convention, as transformers
does by default: raw text gets the tokenizer's special tokens (BOS for Llama/Mistral/Gemma-style
tokenizers); a chat-templated prompt gets none on top of the template, which already writes BOS
where the model wants it."""

from __future__ import annotations

from typing import Any


def encode_prompt(
    tokenizer: Any,
    prompt: str | list[dict],
    *,
    apply_chat_template: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a prompt: chat template with a generation prompt, or the raw text.

    ``tools``: the tool schemas of an episode run (``common.tools.registry.tool_schemas``), which
    the template renders into the prompt (Qwen and Llama 3.x templates put them in a system
    turn), so the length the loader counts is the prompt the generator sends.

    Raw text is encoded with the tokenizer's special tokens (``add_special_tokens=True``, the
    transformers default: BOS where the tokenizer adds one). The chat template's text is encoded
    without them, as ``apply_chat_template(tokenize=True)`` does: the template writes BOS itself
    when the model wants it, and adding it again would double it."""
    if apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template; set data.apply_chat_template = false "
                "to feed raw text, or use a tokenizer that has one."
            )
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    if not isinstance(prompt, str):
        raise ValueError(
            "chat-list prompt but data.apply_chat_template is false; set it to true, or give "
            "plain-text prompts."
        )
    return list(tokenizer(prompt, add_special_tokens=True).input_ids)


def prompt_of(item: Any) -> str | list[dict]:
    """The prompt of a ``PromptRecord`` or a wire ``PromptMsg``: its chat list, else its text."""
    return item.messages if item.messages is not None else (item.text or "")
