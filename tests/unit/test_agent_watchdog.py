"""An agent that blocks the agents' event loop is found and named (``AgentLoop``'s watchdog),
and one that awaits is not."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from services.generator.agent.code import AgentLoop


def _run(agent, caplog):
    seen: list[tuple[str, str, float]] = []
    done = threading.Event()
    loop = AgentLoop(blocked_after_s=0.2, on_blocked=lambda *a: (seen.append(a), done.set()))
    loop.start()

    async def episode():
        asyncio.current_task().set_name("episode e1")
        await agent()

    try:
        with caplog.at_level(logging.WARNING, logger="services.generator.agent.code"):
            loop.submit(episode()).result(timeout=10)
            done.wait(timeout=0.5)  # a report in flight lands
    finally:
        loop.stop()
    return seen


def test_a_blocking_agent_is_named_with_its_line(caplog):
    async def blocking():
        time.sleep(1.0)  # the mistake: a synchronous sleep on the event loop

    seen = _run(blocking, caplog)
    assert len(seen) == 1
    episode, where, seconds = seen[0]
    assert episode == "episode e1" and "time.sleep(1.0)" in where and seconds > 0.2
    assert "episode e1" in caplog.text and "blocks the agents' event loop" in caplog.text


def test_an_agent_that_awaits_is_not_reported(caplog):
    async def awaiting():
        await asyncio.sleep(1.0)

    assert _run(awaiting, caplog) == []
