"""A scripted tool episode through the model's real chat template, run once at start (preflight).

Building the ``TurnEncoder`` proves that environment turns can be appended by difference; this
plays whole episodes the way the agent loop will, with no engine: the template writes an
assistant turn that calls a tool (its own serialisation of the call), the tool format must parse
that text back to the same call, the tool results are appended by difference, and the template
must render the whole conversation afterwards, with one call and, where the format allows more
than one per turn, with two. Each step that fails raises ``TemplateDeltaError`` naming the rule
and what to do, so a template Tether cannot serve is refused before any model is loaded.
"""

from __future__ import annotations

from typing import Any

from common.chat.turns import TemplateDeltaError, TurnEncoder, render_ids

QUESTION = {"role": "user", "content": "Use the tool, please."}


def _call(name: str, k: int) -> dict[str, Any]:
    return {"type": "function", "id": f"rehearse{k}", "function": {"name": name, "arguments": {}}}


def rehearse(tokenizer: Any, encoder: TurnEncoder, tool_format: Any) -> None:
    """Play the one-call and (format permitting) two-call episodes; ``TemplateDeltaError``
    naming the failing rule otherwise."""
    tools = encoder.tools or []
    if not tools:
        return
    name = tools[0]["function"]["name"]
    counts = (1,) if tool_format.max_calls == 1 else (1, 2)
    for n in counts:
        calls = [_call(name, k) for k in range(n)]
        turn = {"role": "assistant", "content": "", "tool_calls": calls}
        where = f"an episode with {n} call{'s' if n > 1 else ''} in a turn"
        try:
            head = render_ids(tokenizer, [QUESTION], tools=tools, add_generation_prompt=True,
                              template_kwargs=encoder.kwargs)  # fmt: skip
            written = render_ids(tokenizer, [QUESTION, turn], tools=tools,
                                 add_generation_prompt=False, template_kwargs=encoder.kwargs)  # fmt: skip
        except Exception as exc:
            raise TemplateDeltaError(f"{where}: the chat template refuses the assistant turn "
                                     f"that calls {name!r}: {exc}"[:600]) from None  # fmt: skip
        if written[: len(head)] != head:
            raise TemplateDeltaError(
                f"{where}: the chat template renders the prompt differently once an assistant "
                "turn follows it, so a turn's ids cannot follow the prompt's ids"
            )
        body = written[len(head) :]
        end = next((i for i, t in enumerate(body) if t in encoder.end_ids), len(body))
        parsed = tool_format.parse(str(tokenizer.decode(body[:end], skip_special_tokens=False)))
        got = [c.name for c in parsed.calls if not c.error]
        if got != [name] * n:
            raise TemplateDeltaError(
                f"{where}: the chat template writes the call(s) as {parsed.content or body!r:.200}"
                f", which generator.tool_format = {tool_format.name!r} parses as {got}; set "
                "generator.tool_format to the format this template writes"
            )
        results = [{"role": "tool", "name": name, "content": "ok", "tool_call_id": c["id"]}
                   for c in calls]  # fmt: skip
        encoder.env_turn(results)  # raises TemplateDeltaError naming the rule
        try:
            render_ids(tokenizer, [QUESTION, turn, *results, {"role": "assistant", "content": "Done."}],
                       tools=tools, add_generation_prompt=False, template_kwargs=encoder.kwargs)  # fmt: skip
        except Exception as exc:
            raise TemplateDeltaError(f"{where}: the chat template refuses the finished "
                                     f"conversation: {exc}"[:600]) from None  # fmt: skip
