"""The tools demo's agent loop written as user code: an ordinary ``openai.AsyncOpenAI`` client
talking to the generator's endpoint (``tether demo --task tools --agent``, or
``agent.run = "tether.demo.tool_agent:run"``).

It does what the built-in loop (``services/generator/episodes.py``) does with
``generator.max_turns = 3`` and ``generator.tools = ["calculator"]``: ask, run each calculator call
the model makes, send back the answers, until the model answers without a call, runs out of its
token budget or of turns (``agent.max_turns = 3``); then return ``None``, so the scorer grades its last reply against the
product, as it grades the built-in loop's episodes. For the same sampled tokens its trajectories
are the built-in loop's, id for id (``tests/services/test_agent_parity.py``).

Differences a user may meet: the calculator runs here, in the agent's own process (it parses by
an AST whitelist and computes nothing else), not in Tether's tool sandbox; a call the model
writes malformed comes back as plain text (OpenAI's shape has no place for it), so this loop
takes it as the final answer where the built-in loop answers it with an error message.
"""

from __future__ import annotations

import json
from typing import Any

from common.tools.calculator import calculator
from common.tools.registry import tool_schemas

MAX_TURNS = 3  # the built-in loop's generator.max_turns in tools.toml
TOOLS = tool_schemas(["calculator"])


def _call(name: str, arguments: str) -> str:
    """What the built-in loop's sandbox answers for a calculator call."""
    if name != "calculator":
        return f"Error: unknown tool {name!r}; tools: calculator"
    try:
        args = json.loads(arguments)
        return calculator(**args)
    except Exception as exc:  # the tool's own error is the answer
        return f"Error: {type(exc).__name__}: {exc}"


async def run(client: Any, task: dict[str, Any]) -> None:
    import openai

    messages: list[dict[str, Any]] = list(task["messages"])
    for turn in range(MAX_TURNS):
        try:
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS
            )
        except openai.BadRequestError as exc:
            if exc.code == "context_length_exceeded":  # no room left: the last reply stands
                return None
            raise
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if not choice.message.tool_calls or choice.finish_reason == "length":
            return None
        if turn == MAX_TURNS - 1:  # out of turns: the call is not run (finish max_turns)
            return None
        for call in choice.message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": _call(call.function.name, call.function.arguments)})  # fmt: skip
    return None
