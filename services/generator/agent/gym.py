"""Tether's agent loop for a gym-style environment (``agent.gym_env``), run through the
endpoint like any agent.

**The protocol** (SkyRL-gym's ``init``/``step`` and OpenEnv's ``reset``/``step``, in chat
messages). ``agent.gym_env`` names a class or factory, called with no arguments once per
episode; the object has

- ``reset(task) -> messages``: the conversation to start from (a list of chat messages; ``task``
  is the dict an agent's ``run`` gets: ``prompt``, ``messages``, ``ground_truth``, ``metadata``…);
- ``step(message) -> (messages, reward, done)``: ``message`` is the model's reply as an OpenAI
  chat message (``role``, ``content``, ``tool_calls`` with JSON-text arguments); the answer is
  the messages to append (tool results, a user turn), this step's reward and whether the episode
  is over;
- optionally ``tools``: a list of OpenAI tool schemas offered to the model on every turn,
  ``max_tokens``: the most ids of one reply (else a reply may use all the episode has left of
  ``run.max_response_tokens``), and ``close()``, called when the episode ends.

Each method may be plain or ``async``; plain ones run in a worker thread, so a slow environment
holds only its own episode. The episode's reward is the sum of its steps' rewards. An episode
not done after ``agent.max_requests`` replies ends as ``max_turns`` with the rewards so far (cut
short: ``learner.overlong_filter`` masks it).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any


class MaxRequestsReached(Exception):
    """The environment was not done after ``agent.max_requests`` replies."""

    def __init__(self, reward: float) -> None:
        super().__init__(f"not done after the episode's turns (reward so far {reward})")
        self.reward = reward


async def _call(fn: Any, *args: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    out = await asyncio.to_thread(fn, *args)
    return await out if inspect.isawaitable(out) else out


def _messages(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
        raise TypeError(f"{where} must return a list of chat messages ({{'role', 'content'}})")
    return [dict(m) for m in value]


def reply_message(message: Any) -> dict[str, Any]:
    """An ``openai`` reply message as the plain dict a chat request sends back."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls
        ]  # fmt: skip
    return out


class GymAgent:
    def __init__(self, factory: Any, *, max_requests: int = 16) -> None:
        if not callable(factory):
            raise TypeError("agent.gym_env must name a class or a factory function")
        self.factory, self.max_requests = factory, max_requests

    async def run(self, client: Any, task: dict[str, Any]) -> float:
        env = await _call(self.factory)
        for name in ("reset", "step"):
            if not callable(getattr(env, name, None)):
                raise TypeError(f"the gym environment has no {name}() method")
        try:
            messages = _messages(await _call(env.reset, task), "reset(task)")
            extra: dict[str, Any] = {}
            if tools := getattr(env, "tools", None):
                extra["tools"] = tools
            if max_tokens := getattr(env, "max_tokens", None):  # per reply (else: what is left)
                extra["max_tokens"] = int(max_tokens)
            total = 0.0
            for _ in range(self.max_requests):
                resp = await client.chat.completions.create(
                    model="tether", messages=messages, **extra
                )
                reply = reply_message(resp.choices[0].message)
                messages.append(reply)
                out = await _call(env.step, reply)
                if not (isinstance(out, tuple) and len(out) == 3):
                    raise TypeError("step(message) must return (messages, reward, done)")
                new, reward, done = out
                total += float(reward)
                if done:
                    return total
                messages.extend(_messages(new, "step(message)"))
            raise MaxRequestsReached(total)
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                await _call(close)
