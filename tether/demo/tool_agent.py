"""The tools demo's agent loop written as user code: an ordinary ``openai.AsyncOpenAI`` client
talking to the generator's endpoint (``tether demo --task tools --agent``, or
``agent.run = "tether.demo.tool_agent:run"``).

It does what the built-in loop (``services/generator/agent/tool_loop.py``) does with
``generator.max_turns = 3`` and ``generator.tools = ["calculator"]``: ask, run each calculator call
the model makes, send back the answers, until the model answers without a call, runs out of its
token budget or of turns (``agent.max_requests = 3``); then return ``None``, so the scorer grades its last reply against the
product, as it grades the built-in loop's episodes. For the same sampled tokens its trajectories
are the built-in loop's, id for id (``tests/services/test_agent_parity.py``).

The calculator runs in Tether's tool sandbox (``common.tools.sandbox``: worker processes with
per-call limits, no environment, no network where the OS allows), never in the generator's
process: one sandbox per agents' event loop, started at the first call and kept for the
generator's life. A difference a user may meet: a call the model writes malformed comes back as plain text (OpenAI's shape has no place for it), so this loop
takes it as the final answer where the built-in loop answers it with an error message.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from common.tools.registry import resolve_tools, tool_schemas
from common.tools.sandbox import ToolSandbox

MAX_TURNS = 3  # the built-in loop's generator.max_turns in tools.toml
TOOLS = tool_schemas(["calculator"])
OUTPUT_MAX_CHARS = 2000  # the built-in loop's generator.tool_output_max_chars
_SANDBOXES: dict[int, ToolSandbox] = {}  # one per event loop
_STARTING: dict[int, asyncio.Lock] = {}


async def _sandbox() -> ToolSandbox:
    key = id(asyncio.get_running_loop())
    async with _STARTING.setdefault(key, asyncio.Lock()):
        if key not in _SANDBOXES:
            box = ToolSandbox(resolve_tools(["calculator"]), workers=2, isolation="auto")
            await box.start()
            _SANDBOXES[key] = box
    return _SANDBOXES[key]


async def _call(name: str, arguments: str) -> str:
    """What the built-in loop's sandbox answers for a call, from the same sandbox."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except ValueError as exc:
        return f"Error: the arguments are not JSON ({exc})"
    result = await (await _sandbox()).call(name, args if isinstance(args, dict) else {})
    text = result.text
    if len(text) > OUTPUT_MAX_CHARS:
        text = f"{text[:OUTPUT_MAX_CHARS]}\n… ({len(text) - OUTPUT_MAX_CHARS} more characters cut)"
    return text


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
                             "content": await _call(call.function.name,
                                                    call.function.arguments)})  # fmt: skip
    return None
