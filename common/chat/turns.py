"""Token-in, token-out conversations: environment turns appended as ids, and the re-render check.

What Tether trains on is the ids as generated: the prompt's ids, then each assistant turn's ids
exactly as vLLM sampled them (never decoded and re-encoded), then each tool or environment turn's
ids, and so on. The next turn's prompt is exactly the ids so far.

**Environment turns by template difference.** The ids of new messages (tool results, an
environment's reply) are found by rendering a fixed base conversation that ends with an
assistant turn, followed by the new messages (and the generation prompt), and keeping what
comes after the base assistant turn's end-of-turn token: the assistant turn's own suffix
(``\\n`` in ChatML), the new turns' markup and content, and the header of the next assistant
turn. The model's real earlier turns never go through the template again, so nothing the model
wrote is rewritten.

Where that end-of-turn token lies is found by counting, not by comparing prefixes: the base
assistant turn's end is the k-th end-of-turn id of the base rendering, and the delta starts after
the k-th end-of-turn id of the longer rendering. So a template may render the base's *earlier*
turns differently once more messages follow (Qwen3 writes an empty ``<think>`` block into the
last assistant turn only; templates move or merge a system message, or put the tool list before
the last user message) and the delta is still exact. At start the encoder renders the same new
messages after two different bases and requires the same delta (``TemplateDeltaError``
otherwise, naming the rule): a template whose rendering of new turns depends on the content of
earlier ones cannot be served by difference.

Limits: the new messages must not change how the template renders what comes *before* them in
a way that adds or removes end-of-turn ids (no published template here does); and a rewrite of
earlier turns that the template would make is *not* made to the episode's ids (they are what
the model was shown): Mistral's tool list, which its template puts before the last user
message, stays where the prompt had it when an environment adds a user turn; Qwen3's dropped
past reasoning stays in the ids. The re-render check below measures these differences.

**The re-render check** (``generator.template_check``): rendering the whole conversation again
from its messages is what a system without token-in/token-out trains on. It differs from the ids
as generated wherever the template rewrites what the model wrote. ``rerender_mismatch`` finds
the first differing id and ``mismatch_kind`` says what kind of difference it is:

- ``tokens``: the same text, other ids (the model sampled a non-canonical BPE split);
- ``serialisation``: the texts differ only in how JSON is written (a call in compact JSON,
  another key order) or in whitespace;
- ``content``: the re-render shows the model something else than what it wrote (a template
  that drops the content written beside a call, or earlier reasoning).

``warn`` counts episodes by kind; ``strict`` also refuses ``content`` episodes (trained with no
loss), the only kind where the training ids differ in meaning from what the conversation would
show the model again. A malformed call is re-rendered as the text the model wrote (as the agent
endpoint shows it), so a negative example is never refused; ``off`` skips the check.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

BASE = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
# a second base, to check that the ids of new turns do not depend on the earlier conversation
OTHER_BASE = [
    {"role": "user", "content": "What is the time, please?"},
    {"role": "assistant", "content": "It is noon."},
]
# the probe's tool message: a 9-character call id, as Mistral's template requires
PROBE_TOOL = {"role": "tool", "name": "probe", "content": "42", "tool_call_id": "probe0001"}
PROBE_USER = {"role": "user", "content": "And now?"}


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
    """Ids of environment turns for one tokenizer, template, tool list and template kwargs.

    Raises ``TemplateDeltaError`` at construction when the template cannot be served by
    difference (the message names the rule that fails and what to do)."""

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
        base = self._render_checked(BASE, add_generation_prompt=False)
        if tools and base == self._render_without_tools():
            raise TemplateDeltaError(
                "the chat template ignores `tools`: the model would never be told which tools "
                'it has. Set generator.tool_prompt = "system" (or "auto") to have Tether '
                "write the tool list into the system message, or use the model's own tool-aware "
                "template (Qwen2.5, Qwen3, Llama 3.x, Mistral, Phi-4-mini have one)."
            )
        self.k, self.end_token = self._assistant_end(BASE, base)
        probe = [PROBE_TOOL] if tools else [PROBE_USER]
        delta = self.env_turn(probe)
        other = self._delta(OTHER_BASE, probe)
        if delta != other:
            raise TemplateDeltaError(
                "the chat template renders a new "
                f"{probe[0]['role']} turn differently depending on the earlier conversation, "
                "so its ids cannot be appended by difference; use a template whose rendering of "
                "a turn depends only on that turn (the model's published one usually does)."
            )
        if "42" not in str(tokenizer.decode(delta)) and tools:
            raise TemplateDeltaError(
                "the chat template does not render the content of a tool message; use the "
                "model's own tool-aware template."
            )

    def _render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> list[int]:
        return render_ids(self.tokenizer, messages, tools=self.tools,
                          add_generation_prompt=add_generation_prompt,
                          template_kwargs=self.kwargs)  # fmt: skip

    def _render_without_tools(self) -> list[int] | None:
        try:
            return render_ids(self.tokenizer, BASE, tools=None, add_generation_prompt=False,
                              template_kwargs=self.kwargs)  # fmt: skip
        except Exception:  # a template that needs its tools (Phi-4-mini's) does not ignore them
            return None

    def _render_checked(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool):
        try:
            return self._render(messages, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja's TemplateError, raise_exception(...), TypeError ...
            raise TemplateDeltaError(
                f"the chat template refused the conversation of roles "
                f"{[m['role'] for m in messages]}: {exc}"[:600]
            ) from None

    def _assistant_end(self, base_msgs: list[dict[str, Any]], base: list[int]) -> tuple[int, int]:
        """(k, id): the base assistant turn ends at the k-th end-of-turn id of its rendering."""
        head = self._render_checked(base_msgs[:-1], add_generation_prompt=True)
        same = next((i for i, (a, b) in enumerate(zip(head, base, strict=False)) if a != b),
                    min(len(head), len(base)))  # fmt: skip
        ends = [i for i, t in enumerate(base) if t in self.end_ids and i >= same]
        if not ends:
            raise TemplateDeltaError(
                "the chat template's assistant turn ends with none of the model's end-of-turn "
                f"ids {sorted(self.end_ids)}; Tether cannot tell where a turn ends. Give the "
                "tokenizer an eos_token that its template writes after each assistant message."
            )
        k = sum(1 for t in base[: ends[0] + 1] if t in self.end_ids)
        return k, base[ends[0]]

    def _delta(self, base_msgs: list[dict[str, Any]], messages: list[dict[str, Any]]) -> list[int]:
        full = self._render_checked([*base_msgs, *messages], add_generation_prompt=True)
        ends = [i for i, t in enumerate(full) if t in self.end_ids]
        if len(ends) < self.k:
            raise TemplateDeltaError(
                "the chat template drops end-of-turn ids of earlier turns once messages of roles "
                f"{[m['role'] for m in messages]} follow, so where their ids start cannot be found"
            )
        return full[ends[self.k - 1] + 1 :]

    def env_turn(self, messages: list[dict[str, Any]], *, turn_closed: bool = True) -> list[int]:
        """Ids to append after an assistant turn: the turn's suffix, ``messages`` and the next
        assistant header. ``turn_closed=False`` (the turn stopped without an end-of-turn token,
        e.g. at a stop string) puts the end-of-turn token first. ``TemplateDeltaError`` when the
        template refuses the messages."""
        delta = self._delta(BASE, messages)
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


def _canonical(text: str) -> str:
    """``text`` with every JSON object or list written one way (sorted keys, compact) and
    whitespace removed (templates trim turns): what ``serialisation`` differences leave equal."""
    out, i, decoder = [], 0, json.JSONDecoder()
    while i < len(text):
        if text[i] in "{[":
            try:
                obj, end = decoder.raw_decode(text, i)
            except ValueError:
                pass
            else:
                out.append(json.dumps(obj, sort_keys=True, separators=(",", ":")))
                i = end
                continue
        out.append(text[i])
        i += 1
    return re.sub(r"\s+", "", "".join(out))


def mismatch_kind(tokenizer: Any, ids: Sequence[int], rendered: Sequence[int]) -> str:
    """``tokens``, ``serialisation`` or ``content`` (module docstring) for ``ids`` that differ
    from ``rendered`` over the length of ``ids``."""
    mine = str(tokenizer.decode(list(ids), skip_special_tokens=False))
    theirs = str(tokenizer.decode(list(rendered), skip_special_tokens=False))
    if mine == theirs:
        return "tokens"
    if _canonical(mine) == _canonical(theirs):
        return "serialisation"
    return "content"
