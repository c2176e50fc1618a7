"""Token-in, token-out conversations: environment turns appended as ids, and the re-render check.

What Tether trains on is the ids as generated: the prompt's ids, then each assistant turn's ids
exactly as vLLM sampled them (never decoded and re-encoded), then each tool or environment turn's
ids, and so on. The next turn's prompt is exactly the ids so far.

**Environment turns by template difference.** The ids of new messages (tool results, an
environment's reply) are found by rendering a fixed base conversation that ends with an
assistant turn, with and without the new messages (and the generation prompt), and keeping what
comes after the base's end-of-turn token: the assistant turn's own suffix (``\\n`` in ChatML),
the new turns' markup and content, and the header of the next assistant turn. The model's real
earlier turns never go through the template again, so nothing the model wrote is rewritten.
This is what verl, prime-rl's renderer bridge and SkyRL do; the template must render the base as
a prefix of the longer conversation (``TemplateDeltaError`` otherwise, at start-up).

**The re-render check** (``generator.template_check``): rendering the whole conversation again
from its messages is what a system without token-in/token-out trains on. It differs from the ids
as generated wherever the template rewrites what the model wrote: tool calls re-serialised from
their parsed form, BPE merges across the boundary of a turn, templates that drop earlier
reasoning (Qwen3's removes ``<think>…</think>`` from past assistant turns). ``first_mismatch``
finds the first differing id; ``warn`` counts episodes with one, ``strict`` also refuses them
(no loss), ``off`` skips the check.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

BASE = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]


class TemplateDeltaError(ValueError):
    """The chat template cannot append turns by difference (named with the fix)."""


def render_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The template's text tokenised without special tokens on top, as
    ``common.data.prompts.encode_prompt`` does (the template writes BOS itself)."""
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools or None,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **(template_kwargs or {}),
    )
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def end_of_turn_ids(tokenizer: Any, model_dir: str | None = None) -> set[int]:
    """The ids that end an assistant turn: the tokenizer's eos and the generation config's."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_dir:
        try:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        except (OSError, ValueError):
            pass
    return ids


class TurnEncoder:
    """Ids of environment turns for one tokenizer, template, tool list and template kwargs."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        end_ids: Iterable[int],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer, self.tools, self.kwargs = tokenizer, tools, template_kwargs or {}
        self.end_ids = set(end_ids)
        base = self._render(BASE, add_generation_prompt=False)
        if tools and base == render_ids(tokenizer, BASE, tools=None, add_generation_prompt=False,
                                        template_kwargs=self.kwargs):  # fmt: skip
            raise TemplateDeltaError(
                "the chat template ignores `tools`: the model would never be told which tools "
                "it has. Use the model's own tool-aware template (Qwen2.5, Qwen3, Llama 3.x "
                "have one) or write the tool list into the prompt yourself."
            )
        ends = [i for i, t in enumerate(base) if t in self.end_ids]
        if not ends:
            raise TemplateDeltaError(
                "the chat template's assistant turn ends with none of the model's end-of-turn "
                f"ids {sorted(self.end_ids)}; Tether cannot tell where a turn ends. Give the "
                "tokenizer an eos_token that its template writes after each assistant message."
            )
        self.cut = ends[-1] + 1
        self.base = base
        self.end_token = base[ends[-1]]

    def _render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> list[int]:
        return render_ids(self.tokenizer, messages, tools=self.tools,
                          add_generation_prompt=add_generation_prompt,
                          template_kwargs=self.kwargs)  # fmt: skip

    def env_turn(self, messages: list[dict[str, Any]], *, turn_closed: bool = True) -> list[int]:
        """Ids to append after an assistant turn: the turn's suffix, ``messages`` and the next
        assistant header. ``turn_closed=False`` (the turn stopped without an end-of-turn token,
        e.g. at a stop string) puts the end-of-turn token first."""
        full = self._render([*BASE, *messages], add_generation_prompt=True)
        if full[: self.cut] != self.base[: self.cut]:
            raise TemplateDeltaError(
                "the chat template renders a conversation differently once messages follow it "
                f"(roles {[m['role'] for m in messages]}), so their ids cannot be appended by "
                "difference; use a template that renders earlier turns the same way whatever "
                "follows them."
            )
        delta = full[self.cut :]
        return delta if turn_closed else [self.end_token, *delta]


def first_mismatch(ids: Sequence[int], rendered: Sequence[int]) -> int:
    """The first index where ``ids`` (as generated) and ``rendered`` (re-rendered) differ, over
    the length of ``ids``; -1 when ``ids`` is a prefix of ``rendered``."""
    for i, (a, b) in enumerate(zip(ids, rendered, strict=False)):
        if a != b:
            return i
    return -1 if len(rendered) >= len(ids) else len(rendered)


def rerender_mismatch(
    encoder: TurnEncoder, messages: list[dict[str, Any]], ids: Sequence[int]
) -> int:
    """The re-render check: render ``messages`` (the prompt's, then every turn's, ending before
    the last assistant turn) with the generation prompt and compare with ``ids``, the episode's
    ids up to the start of its last assistant turn. -1 when they agree."""
    rendered = encoder._render(messages, add_generation_prompt=True)
    return first_mismatch(ids, rendered)
