"""Tools offered through the system message, for chat templates that do not render a tool list.

Many published templates render ``tools`` themselves (Qwen2.5/Qwen3, Llama 3.x, Mistral,
Phi-4-mini). Others have no tool support at all: SmolLM2's ChatML template renders each
message's role and content and nothing else, so ``apply_chat_template(messages, tools=...)``
silently drops the tool list and every ``tool_calls`` entry. Such a model can still be taught a
call syntax in its prompt, which is how tool use is usually bootstrapped on a small model.

``generator.tool_prompt`` says where the tool list goes:

- ``template``: the model's template renders it (refused at start when the template ignores it);
- ``system``: Tether writes it into the system message (appended to the conversation's own
  system message, or a new one first; at the head of the first user message where the template
  has no system role, as Gemma's), as a JSON schema per tool and one example call in the syntax
  of ``generator.tool_format``. It writes each assistant turn's ``tool_calls`` into its content
  in that syntax, since the template would drop them, and each tool result as a user message,
  ``<tool_response>`` … ``</tool_response>`` (the results of one turn's calls in one message),
  since such templates have no tool role. The template then renders plain messages
  (``tools=None``);
- ``auto``: ``template`` where the template renders a tool list, else ``system``.

``SystemTools`` applies this to a tokenizer: it stands in for it everywhere a conversation is
rendered (the loader's length check, the generator's prompts, the turn encoder, the agent
endpoint, the re-render check), so that every place renders the same text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.chat.tool_calls import ToolFormat, tool_format

MODES = ("auto", "template", "system")
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "probe", "description": "A probe.",
    "parameters": {"type": "object", "properties": {}, "required": []}}}]  # fmt: skip
_PROBE = [{"role": "user", "content": "Hi."}]


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes a tool list it is given: the probe
    conversation renders differently with one than without (a template that refuses to render
    without its tools, as Phi-4-mini's may, counts as rendering them)."""

    def render(tools: list[dict[str, Any]] | None) -> str:
        return str(tokenizer.apply_chat_template(_PROBE, tools=tools, tokenize=False,
                                                 add_generation_prompt=True))  # fmt: skip

    try:
        without = render(None)
    except Exception:  # noqa: BLE001 - needs its tools: it renders them
        return True
    return render(_PROBE_TOOLS) != without


def renders_system(tokenizer: Any) -> bool:
    """Whether the chat template writes a system message's text (Gemma's refuses the role)."""
    marker = "Tether-system-probe"
    try:
        text = tokenizer.apply_chat_template([{"role": "system", "content": marker}, *_PROBE],
                                             tokenize=False, add_generation_prompt=True)  # fmt: skip
    except Exception:  # noqa: BLE001 - raise_exception("System role not supported") and the like
        return False
    return marker in str(text)


def resolve_mode(mode: str, tokenizer: Any) -> str:
    """``template`` or ``system`` for ``generator.tool_prompt`` = ``mode`` (``auto``: by
    ``renders_tools``)."""
    if mode not in MODES:
        raise ValueError(f"generator.tool_prompt = {mode!r}; choose one of {', '.join(MODES)}")
    if mode != "auto":
        return mode
    return "template" if renders_tools(tokenizer) else "system"


def system_text(tools: list[dict[str, Any]], fmt: ToolFormat) -> str:
    """The tool list and the call syntax, as the system message's text."""
    schemas = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    first = tools[0].get("function", tools[0])
    props = first.get("parameters", {}).get("properties", {})
    example = fmt.write([{"name": first["name"], "arguments": {k: f"<{k}>" for k in props}}])
    return (
        "You can call tools. Each one is described by a JSON schema, one per line:\n"
        f"{schemas}\n\n"
        "To call a tool, write the call in exactly this form, with the tool's name and its "
        f"arguments as JSON:\n{example}\n"
        "The tool's result comes back in the next user message, between <tool_response> and "
        "</tool_response>. Write no call when you give your final answer."
    )


def with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               fmt: ToolFormat, *, system_role: bool = True) -> list[dict[str, Any]]:  # fmt: skip
    """``messages`` for a template without tool support: the tool list in the system message
    (when there are tools; ``system_role`` False: at the head of the first user message), every
    assistant turn's ``tool_calls`` written into its content, and tool results as user turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") != "tool":
            out.append(_calls_in_content(m, fmt))
            continue
        response = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
        if out and out[-1].get(_RESULTS):  # the results of one turn's calls: one user turn
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{response}"}
        else:
            out.append({"role": "user", "content": response, _RESULTS: True})
    out = [{k: v for k, v in m.items() if k != _RESULTS} for m in out]
    if not tools:
        return out
    block = system_text(tools, fmt)
    at = 0 if system_role else next((i for i, m in enumerate(out) if m.get("role") == "user"), 0)
    role = "system" if system_role else "user"
    if out and out[at].get("role") == role:
        head = _text(out[at].get("content"))
        text = f"{head}\n\n{block}" if role == "system" else f"{block}\n\n{head}"
        return [*out[:at], {**out[at], "content": text if head else block}, *out[at + 1 :]]
    return [{"role": role, "content": block}, *out]


_RESULTS = "_tool_results"  # marks a user turn made of tool results, while it is being built


def _text(content: Any) -> str:
    """A message's content as text (OpenAI content parts joined)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _calls_in_content(message: dict[str, Any], fmt: ToolFormat) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    written = fmt.write([_plain(c) for c in calls])
    content = _text(message.get("content"))
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": f"{content}\n{written}" if content else written}


def _plain(call: dict[str, Any]) -> dict[str, Any]:
    """``{"name", "arguments", "id"}`` of an OpenAI-style ``tool_calls`` entry. Arguments sent as
    a JSON string are read as the object; a string that is not JSON is kept as written, as the
    agent endpoint keeps it (``openai_api._tool_call``)."""
    fn = call.get("function", call)
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass
    return {"name": fn.get("name", ""), "arguments": args, "id": call.get("id", "")}


class SystemTools:
    """``tokenizer`` with ``apply_chat_template`` rendering tools the ``system`` way (see the
    module docstring); everything else is the tokenizer's own."""

    def __init__(self, tokenizer: Any, fmt: ToolFormat) -> None:
        self._tokenizer, self.tool_format = tokenizer, fmt
        self.system_role = renders_system(tokenizer)

    def apply_chat_template(self, conversation: list[dict[str, Any]], *args: Any,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> Any:  # fmt: skip
        messages = with_tools(list(conversation), tools, self.tool_format,
                              system_role=self.system_role)  # fmt: skip
        return self._tokenizer.apply_chat_template(messages, *args, tools=None, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)


def for_tools(tokenizer: Any, *, mode: str, fmt: ToolFormat | None) -> Any:
    """The tokenizer to render tool conversations with: ``tokenizer`` itself, or ``SystemTools``
    around it when ``mode`` resolves to ``system`` (``fmt``: the call syntax; None: no tools, so
    nothing to write)."""
    if fmt is None or resolve_mode(mode, tokenizer) == "template":
        return tokenizer
    return SystemTools(tokenizer, fmt)


def for_model(tokenizer: Any, *, model_dir: str | Path, format_setting: str,
              mode: str) -> tuple[Any, ToolFormat]:  # fmt: skip
    """(the tokenizer to render tool conversations with, the call format) for the policy in
    ``model_dir`` and ``generator.tool_format`` / ``generator.tool_prompt`` =
    ``format_setting`` / ``mode``. ``ToolFormatError`` when the model has no call format."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    fmt = tool_format(format_setting, model_type=config.get("model_type", ""),
                      vocab=tokenizer.get_vocab())  # fmt: skip
    return for_tools(tokenizer, mode=mode, fmt=fmt), fmt
