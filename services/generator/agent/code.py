"""Your agent's code as the generator runs it: loaded from ``[agent]``, run per sample on an event
loop of its own, and what it returns turned into a reward.

**The interface.** ``async def run(client, task)``, or a class with that method (made once per
generator with no arguments). ``client`` is an ``openai.AsyncOpenAI`` pointed at this episode
on the generator's endpoint (``base_url`` carries the episode's id, ``api_key`` the run's token;
it does not retry). ``task`` is a dict: ``prompt`` (text, or the chat messages), ``messages``
(the prompt as chat messages), ``ground_truth``, ``metadata``, ``split`` (``train``/``eval``),
``prompt_id``, ``sample_index``, ``episode_id``, and ``base_url``/``api_key`` for a client of
your own. What ``run`` returns:

- a number: the episode's reward (component ``agent``);
- a dict of numbers: reward components (reward = their sum; held-out accuracy reads
  ``correct``);
- ``{"answer": text}``: the scorer grades ``text`` against the ground truth, as it grades a
  response (rule or solver mode, with its reward settings);
- ``None``: the scorer grades the last reply's text.

**Isolation.** The agents of all episodes share one event loop in a thread of their own, so an
agent that blocks (synchronous I/O, a long computation) stalls only agents, never the
generator's loop (vLLM, weights, the endpoint). It does stall every other agent, so it is
found: a watchdog thread sends the agents' loop a heartbeat and, when one waits longer than
``BLOCKED_AFTER_S``, logs a warning naming the episode whose code holds the loop and the line
it is on, and counts it (``tether_generator_agent_blocked_total``). Write agents that await:
``await asyncio.sleep`` not ``time.sleep``, the ``client`` Tether hands you (or ``httpx.AsyncClient``)
not ``requests``, and ``await asyncio.to_thread(f, ...)`` for a slow synchronous function. Each episode runs under ``agent.timeout_s``,
measured on the generator's loop: past it, or when the code raises, the episode ends with the
error recorded (``agent_timeout`` / ``agent_error``), its requests still in flight are cancelled,
and the generator goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import linecache
import logging
import math
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

from common.tools.functions import ToolDefinitionError
from common.tools.registry import import_target
from services.generator.agent.gym import GymAgent

AgentFn = Callable[[Any, dict[str, Any]], Awaitable[Any]]
log = logging.getLogger(__name__)
BLOCKED_AFTER_S = 0.5  # a heartbeat of the agents' loop waiting longer: an agent blocks it


class AgentCodeError(ValueError):
    """The agent named in ``[agent]`` cannot be used (the message names the setting)."""


def load_agent(agent: Any) -> AgentFn:
    """The coroutine function ``[agent]`` names (``agent``: the ``AgentConfig`` section)."""
    if agent.gym_env:
        factory = _imported(agent.gym_env, "agent.gym_env")
        return GymAgent(factory, max_requests=agent.max_requests).run
    obj = _imported(agent.run, "agent.run")
    if inspect.isclass(obj):
        try:
            obj = obj()
        except Exception as exc:
            raise AgentCodeError(f"agent.run = {agent.run!r}: making the class with no arguments "
                                 f"failed: {exc!r}") from exc  # fmt: skip
        fn = getattr(obj, "run", None)
    else:
        fn = obj
    if not inspect.iscoroutinefunction(fn):
        raise AgentCodeError(
            f"agent.run = {agent.run!r} must be an `async def run(client, task)` function, or a "
            "class with such a `run` method"
        )
    try:
        inspect.signature(fn).bind(None, {})
    except TypeError as exc:
        raise AgentCodeError(f"agent.run = {agent.run!r} must take (client, task): {exc}") from exc
    return fn


def _imported(target: str, setting: str) -> Any:
    try:
        return import_target(target, setting=setting)
    except ToolDefinitionError as exc:
        raise AgentCodeError(str(exc)) from exc


def reward_of(result: Any) -> tuple[dict[str, float] | None, str | None]:
    """(reward components, answer for the scorer) of what ``run`` returned; TypeError or
    ValueError (with the reason) for anything else."""
    if result is None:
        return None, None
    if isinstance(result, (int, float)):
        return {"agent": _finite(result, "the reward")}, None
    if isinstance(result, dict) and "answer" in result:
        if set(result) != {"answer"} or not isinstance(result["answer"], str):
            raise TypeError('return {"answer": "<text>"} alone to have the scorer grade it')
        return None, result["answer"]
    if isinstance(result, dict) and result and all(isinstance(k, str) for k in result):
        return {k: _finite(v, f"reward component {k!r}") for k, v in result.items()}, None
    raise TypeError(
        f"the agent returned {type(result).__name__}; return a number, a dict of numbers, "
        '{"answer": text} or None'
    )


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


class AgentLoop:
    """An event loop in a daemon thread where every episode's agent code runs, watched for
    code that blocks it (module docstring). ``on_blocked(episode, where, seconds)`` is called
    once per blocking stretch."""

    def __init__(
        self, *, blocked_after_s: float = BLOCKED_AFTER_S,
        on_blocked: Callable[[str, str, float], None] | None = None,
    ) -> None:  # fmt: skip
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="tether-agents", daemon=True)
        self._watch = threading.Thread(target=self._watchdog, name="tether-agents-watch",
                                       daemon=True)  # fmt: skip
        self._stop = threading.Event()
        self.blocked_after_s, self.on_blocked = blocked_after_s, on_blocked
        self._sent: float | None = None  # when the pending heartbeat was sent

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        self._thread.start()
        self._watch.start()

    def submit(self, work: Awaitable[Any]) -> Future:
        return asyncio.run_coroutine_threadsafe(work, self.loop)  # type: ignore[arg-type]

    def _beat(self) -> None:
        self._sent = None

    def _watchdog(self) -> None:
        reported = False
        while not self._stop.wait(self.blocked_after_s / 4):
            if self._sent is None:
                reported = False
                self._sent = time.monotonic()
                try:
                    self.loop.call_soon_threadsafe(self._beat)
                except RuntimeError:  # the loop is closed
                    return
                continue
            waited = time.monotonic() - self._sent
            if waited > self.blocked_after_s and not reported:
                reported = True
                self._report(waited)

    def _report(self, waited: float) -> None:
        task = asyncio.current_task(self.loop)
        episode = task.get_name() if task is not None else "?"
        frame = sys._current_frames().get(self._thread.ident or -1)
        where = "?"
        if frame is not None:
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}: {line}"
        log.warning(
            "agent code blocks the agents' event loop (%.1f s so far; every other agent waits): "
            "%s at %s. Await instead (asyncio.sleep, an async client, asyncio.to_thread).",
            waited, episode, where,
        )  # fmt: skip
        if self.on_blocked is not None:
            self.on_blocked(episode, where, waited)

    def stop(self) -> None:
        """Stop the loop (agents still running are abandoned: the thread is a daemon)."""
        self._stop.set()
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)
