"""Tool calls in each model family's own format: parsed out of what the model wrote.

Formats (``generator.tool_format``; ``auto`` picks one from the model's ``model_type``):

- ``hermes`` — Qwen2.5, Qwen3, Qwen3-MoE (and Hermes/NousResearch models): every call is a
  JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
  ``</tool_call>``; text outside the blocks is the message's content.
- ``llama3_json`` — Llama 3.1/3.2/3.3 ("JSON based tool calling"): the whole message is a JSON
  object ``{"name": ..., "parameters": {...}}`` (``arguments`` also read), optionally after
  ``<|python_tag|>``. A message that does not start with ``{`` is a final answer. The published
  templates allow **one call per turn** ("This model only supports single tool-calls at once!"):
  a second call written after ``;`` is parsed, not run, and answered with an error.
- ``mistral`` — Mistral (Nemo, Small): ``[TOOL_CALLS]`` then a JSON list of
  ``{"name", "arguments", "id"}``; text before it is the content. The template needs a
  9-character alphanumeric call id; a call without one gets one.
- ``qwen3_xml`` — Qwen3-Coder: ``<tool_call><function=NAME><parameter=P>value</parameter>…
  </function></tool_call>``; a value that reads as JSON (a number, a list) is taken as such.
- ``phi4_mini`` — Phi-4-mini: ``<|tool_call|>{"name", "arguments"}<|/tool_call|>``.

**Reasoning.** Text before ``</think>`` (a ``<think>`` block, or everything up to ``</think>``
when the template opened the block in the prompt) is the turn's reasoning, returned apart
(``reasoning``; the endpoint's ``reasoning_content``) and never searched for calls: a call
written inside ``<think>`` is not run. A block opened and never closed makes the whole turn
reasoning.

Families without a tool format Tether can parse are refused by name by ``auto``: Gemma 2 (no
tool role and no call syntax in its template), Phi-3/3.5 and SmolLM2 (likewise). Set a format
and ``common.chat.tool_prompt`` teaches it to them through the system message. A model whose ``model_type``
is unknown needs ``generator.tool_format`` set explicitly; a name that is not a format is
refused with the list.

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
    """One call as the model wrote it. ``error`` is set when it could not be parsed; ``id`` is
    the model's own call id where its format has one (Mistral), else set by whoever answers it."""

    name: str
    arguments: dict[str, Any]
    raw: str
    error: str = ""
    id: str = ""

    def message(self) -> dict[str, Any]:
        """The OpenAI-style ``tool_calls`` entry chat templates render."""
        out: dict[str, Any] = {
            "type": "function", "function": {"name": self.name, "arguments": self.arguments},
        }  # fmt: skip
        if self.id:
            out["id"] = self.id
        return out


@dataclass
class ParsedTurn:
    """An assistant turn split into its reasoning, its content and its calls."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""

    def message(self, *, max_calls: int | None = None) -> dict[str, Any]:
        """The assistant message an OpenAI-compatible client would hold for this turn: the
        well-formed calls, at most ``max_calls`` of them (the ones that were run)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        good = [c.message() for c in self.calls if not c.error][:max_calls]
        if good:
            out["tool_calls"] = good
        return out


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, the rest) of a turn's text (module docstring)."""
    if "</think>" in text:
        head, _, rest = text.partition("</think>")
        return head.split("<think>", 1)[-1].strip("\n"), rest.lstrip("\n")
    if "<think>" in text:  # opened, never closed: all of it is reasoning
        head, _, rest = text.partition("<think>")
        return rest.strip("\n"), head
    return "", text


def _call_from_json(raw: str, *, args_keys: tuple[str, ...]) -> ToolCall:
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        return ToolCall(name="", arguments={}, raw=raw, error=f"the call is not valid JSON ({exc})")
    return _call_from_obj(obj, raw, args_keys=args_keys)


def _call_from_obj(obj: Any, raw: str, *, args_keys: tuple[str, ...]) -> ToolCall:
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
    call_id = obj["id"] if isinstance(obj.get("id"), str) else ""
    return ToolCall(name=obj["name"], arguments=args, raw=raw, id=call_id)


class _TaggedJson:
    """Calls as JSON objects between an opening and a closing tag, content around them."""

    name = ""
    open_tag, close_tag = "", ""
    max_calls: int | None = None

    def parse(self, text: str) -> ParsedTurn:
        reasoning, text = split_reasoning(text)
        block = re.compile(re.escape(self.open_tag) + r"(.*?)" + re.escape(self.close_tag),
                           re.DOTALL)  # fmt: skip
        calls = [self._call(m.group(1).strip()) for m in block.finditer(text)]
        content = block.sub("", text)
        if self.open_tag in content:  # opened, never closed
            at = content.index(self.open_tag)
            calls.append(ToolCall(name="", arguments={}, raw=content[at:],
                                  error=f"{self.open_tag} is not closed by {self.close_tag}"))  # fmt: skip
            content = content[:at]
        return ParsedTurn(content=content.strip(), calls=calls, reasoning=reasoning)

    def _call(self, raw: str) -> ToolCall:
        return _call_from_json(raw, args_keys=("arguments", "parameters"))

    def write(self, calls: list[dict[str, Any]]) -> str:
        """``calls`` (``{"name", "arguments"}``) as the model writes them: what ``parse`` reads."""
        return "\n".join(f"{self.open_tag}\n{self._body(c)}\n{self.close_tag}" for c in calls)

    def _body(self, call: dict[str, Any]) -> str:
        return json.dumps({"name": call["name"], "arguments": call["arguments"]},
                          ensure_ascii=False)  # fmt: skip


class HermesFormat(_TaggedJson):
    name = "hermes"
    open_tag, close_tag = "<tool_call>", "</tool_call>"


class Phi4MiniFormat(_TaggedJson):
    name = "phi4_mini"
    open_tag, close_tag = "<|tool_call|>", "<|/tool_call|>"


class Qwen3XmlFormat(_TaggedJson):
    name = "qwen3_xml"
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    _function = re.compile(r"^<function=([^>\n]+)>(.*)</function>$", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def _call(self, raw: str) -> ToolCall:
        m = self._function.match(raw)
        if m is None:
            return ToolCall(name="", arguments={}, raw=raw,
                            error="a call is <function=NAME>…</function> inside <tool_call>")  # fmt: skip
        args: dict[str, Any] = {}
        for p in self._parameter.finditer(m.group(2)):
            value: Any = p.group(2)
            try:
                parsed = json.loads(value)
                value = value if isinstance(parsed, str) else parsed
            except ValueError:
                pass
            args[p.group(1).strip()] = value
        leftover = self._parameter.sub("", m.group(2)).strip()
        if leftover:
            return ToolCall(name=m.group(1).strip(), arguments={}, raw=raw,
                            error=f"text outside <parameter=…> blocks: {leftover[:80]!r}")  # fmt: skip
        return ToolCall(name=m.group(1).strip(), arguments=args, raw=raw)

    def _body(self, call: dict[str, Any]) -> str:
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
            for k, v in call["arguments"].items()
        )
        return f"<function={call['name']}>\n{params}</function>"


class Llama3JsonFormat:
    name = "llama3_json"
    _tag = "<|python_tag|>"
    max_calls: int | None = 1

    def parse(self, text: str) -> ParsedTurn:
        reasoning, text = split_reasoning(text)
        body = text.strip()
        if body.startswith(self._tag):
            body = body[len(self._tag) :].strip()
        if not body.startswith("{"):
            return ParsedTurn(content=text.strip(), reasoning=reasoning)
        calls = [
            _call_from_json(part.strip(), args_keys=("parameters", "arguments"))
            for part in _split_calls(body)
        ]
        return ParsedTurn(content="", calls=calls, reasoning=reasoning)

    def write(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]},
                                    ensure_ascii=False) for c in calls)  # fmt: skip


class MistralFormat:
    name = "mistral"
    _tag = "[TOOL_CALLS]"
    max_calls: int | None = None

    def parse(self, text: str) -> ParsedTurn:
        reasoning, text = split_reasoning(text)
        if self._tag not in text:
            return ParsedTurn(content=text.strip(), reasoning=reasoning)
        content, _, body = text.partition(self._tag)
        body = body.strip()
        try:
            objs = json.loads(body)
        except ValueError as exc:
            bad = ToolCall(name="", arguments={}, raw=body, error=f"the calls are not valid JSON "
                           f"({exc})")  # fmt: skip
            return ParsedTurn(content=content.strip(), calls=[bad], reasoning=reasoning)
        objs = objs if isinstance(objs, list) else [objs]
        calls = [_call_from_obj(o, json.dumps(o), args_keys=("arguments", "parameters"))
                 for o in objs]  # fmt: skip
        return ParsedTurn(content=content.strip(), calls=calls, reasoning=reasoning)

    def write(self, calls: list[dict[str, Any]]) -> str:
        objs = [{"name": c["name"], "arguments": c["arguments"],
                 "id": c.get("id") or f"call{k:05d}"} for k, c in enumerate(calls)]  # fmt: skip
        return self._tag + json.dumps(objs, ensure_ascii=False)


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


ToolFormat = HermesFormat | Llama3JsonFormat | MistralFormat | Qwen3XmlFormat | Phi4MiniFormat
FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat(), Qwen3XmlFormat(),
              Phi4MiniFormat())
}  # fmt: skip
# model_type (config.json) -> format
BY_MODEL_TYPE = {
    "qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
    "llama": "llama3_json", "mistral": "mistral", "phi3": "phi4_mini",
}  # fmt: skip
WITHOUT_FORMAT = {"gemma": "Gemma", "gemma2": "Gemma 2", "gemma3_text": "Gemma 3"}
# a model_type shared by families with and without tools: the token that tells them apart
NEEDS_TOKEN = {"llama3_json": ("<|eot_id|>", "Llama 2, SmolLM2 and other llama-type"),
               "phi4_mini": ("<|tool_call|>", "Phi-3 and Phi-3.5"),
               "mistral": ("[TOOL_CALLS]", "Mistral 7B v0.1/v0.2")}  # fmt: skip


def tool_format(setting: str, *, model_type: str, vocab: Any = ()) -> ToolFormat:
    """The format named by ``generator.tool_format`` (``auto``: from ``model_type``).

    ``vocab``: the tokenizer's tokens; where one ``model_type`` covers families with and
    without tool calls (``llama``: Llama 3.x or Llama 2/SmolLM2; ``phi3``: Phi-4-mini or
    Phi-3) the format is taken only when the vocabulary has its marker token."""
    choices = ", ".join(FORMATS)
    if setting != "auto":
        if setting not in FORMATS:
            raise ToolFormatError(
                f"generator.tool_format = {setting!r} is not a tool format; choose auto, {choices}"
            )
        return FORMATS[setting]
    name = BY_MODEL_TYPE.get(model_type)
    without = WITHOUT_FORMAT.get(model_type)
    if name is not None and name in NEEDS_TOKEN and NEEDS_TOKEN[name][0] not in vocab:
        without, name = NEEDS_TOKEN[name][1], None
    if without is not None:
        raise ToolFormatError(
            f"{without} models ({model_type}) have no tool-call format: their chat template "
            "has no tool role and no call syntax, so Tether cannot tell a tool call from an "
            "answer. Use a model with one (Qwen2.5, Qwen3, Llama 3.x, Mistral, Phi-4-mini), or "
            f"set generator.tool_format to one of {choices} (hermes is the usual choice): "
            "generator.tool_prompt then writes the tool list and that call syntax into the "
            "system message, since the template does not."
        )
    if name is None:
        raise ToolFormatError(
            f"Tether does not know the tool-call format of model_type {model_type!r}; set "
            f"generator.tool_format to the one the model was trained on ({choices})."
        )
    return FORMATS[name]
