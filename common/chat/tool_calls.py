"""Tool calls in each model family's own format: parsed out of what the model wrote.

Formats (``generator.tool_format``; ``auto`` picks one from the model's ``model_type``):

- ``hermes`` — Qwen2.5, Qwen3, Qwen3-MoE (and Hermes/NousResearch models): every call is a
  JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
  ``</tool_call>``; text outside the blocks is the message's content.
- ``llama3_json`` — Llama 3.1/3.2/3.3 ("JSON based tool calling"): the whole message is a JSON
  object ``{"name": ..., "parameters": {...}}`` (``arguments`` also read), optionally after
  ``<|python_tag|>``; several calls are separated by ``;``. A message that does not start with
  ``{`` is a final answer.

Families without a tool format Tether can parse are refused by name: Gemma 2 (no tool role and
no call syntax in its template) and Phi-3 (likewise). A model whose ``model_type`` is unknown
needs ``generator.tool_format`` set explicitly.

A call that cannot be parsed (broken JSON, no name, arguments that are not an object) is not
dropped: it becomes a ``ToolCall`` with ``error`` set, which the episode answers with an error
message to the model and counts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


class ToolFormatError(ValueError):
    """No tool format for this model (the message names the setting and the choices)."""


@dataclass
class ToolCall:
    """One call as the model wrote it. ``error`` is set when it could not be parsed."""

    name: str
    arguments: dict[str, Any]
    raw: str
    error: str = ""

    def message(self) -> dict[str, Any]:
        """The OpenAI-style ``tool_calls`` entry chat templates render."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    """An assistant turn split into its content and its calls."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The assistant message an OpenAI-compatible client would hold for this turn."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        good = [c.message() for c in self.calls if not c.error]
        if good:
            out["tool_calls"] = good
        return out


def _call_from_json(raw: str, *, args_keys: tuple[str, ...]) -> ToolCall:
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        return ToolCall(name="", arguments={}, raw=raw, error=f"the call is not valid JSON ({exc})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall(name="", arguments={}, raw=raw, error='the call needs a "name" string')
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass
    if not isinstance(args, dict):
        return ToolCall(name=obj["name"], arguments={}, raw=raw,
                        error=f'"{args_keys[0]}" must be a JSON object')  # fmt: skip
    return ToolCall(name=obj["name"], arguments=args, raw=raw)


class HermesFormat:
    name = "hermes"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls = [
            _call_from_json(m.group(1).strip(), args_keys=("arguments", "parameters"))
            for m in self._block.finditer(text)
        ]
        content = self._block.sub("", text)
        if "<tool_call>" in content:  # opened, never closed
            raw = content[content.index("<tool_call>") :]
            calls.append(ToolCall(name="", arguments={}, raw=raw,
                                  error="<tool_call> is not closed by </tool_call>"))  # fmt: skip
            content = content[: content.index("<tool_call>")]
        return ParsedTurn(content=content.strip(), calls=calls)


class Llama3JsonFormat:
    name = "llama3_json"
    _tag = "<|python_tag|>"

    def parse(self, text: str) -> ParsedTurn:
        body = text.strip()
        if body.startswith(self._tag):
            body = body[len(self._tag) :].strip()
        if not body.startswith("{"):
            return ParsedTurn(content=text.strip())
        calls = [
            _call_from_json(part.strip(), args_keys=("parameters", "arguments"))
            for part in _split_calls(body)
        ]
        return ParsedTurn(content="", calls=calls)


def _split_calls(body: str) -> list[str]:
    """``{...}; {...}`` split at the ``;`` between top-level objects (not inside strings)."""
    parts, depth, start, in_str, escape = [], 0, 0, False, False
    for i, ch in enumerate(body):
        if in_str:
            escape = not escape and ch == "\\"
            if ch == '"' and not escape:
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p for p in parts if p.strip()]


ToolFormat = HermesFormat | Llama3JsonFormat
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat())}
# model_type (config.json) -> format
BY_MODEL_TYPE = {
    "qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
    "llama": "llama3_json",
}  # fmt: skip
WITHOUT_FORMAT = {"gemma": "Gemma", "gemma2": "Gemma 2", "gemma3_text": "Gemma 3", "phi3": "Phi-3"}


def tool_format(setting: str, *, model_type: str, vocab: Any = ()) -> ToolFormat:
    """The format named by ``generator.tool_format`` (``auto``: from ``model_type``).

    ``vocab``: the tokenizer's tokens; a ``llama`` model is taken for Llama 3.x only when it has
    ``<|eot_id|>`` (Llama 2 and other ``llama``-type models have no tool format)."""
    choices = ", ".join(FORMATS)
    if setting != "auto":
        if setting not in FORMATS:
            raise ToolFormatError(
                f"generator.tool_format = {setting!r} is not a tool format; choose auto, {choices}"
            )
        return FORMATS[setting]
    if model_type in WITHOUT_FORMAT:
        raise ToolFormatError(
            f"{WITHOUT_FORMAT[model_type]} models ({model_type}) have no tool-call format: their "
            "chat template has no tool role and no call syntax, so Tether cannot tell a tool "
            "call from an answer. Use a model with one (Qwen2.5, Qwen3, Llama 3.x), or set "
            f"generator.tool_format to one of {choices} if your fine-tune was trained on it."
        )
    name = BY_MODEL_TYPE.get(model_type)
    if name == "llama3_json" and "<|eot_id|>" not in vocab:
        name = None
    if name is None:
        raise ToolFormatError(
            f"Tether does not know the tool-call format of model_type {model_type!r}; set "
            f"generator.tool_format to the one the model was trained on ({choices})."
        )
    return FORMATS[name]
