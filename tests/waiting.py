"""Waiting in tests: on a condition with a deadline, never on a fixed sleep (a sleep is a guess
about another thread's or process's speed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(pred: Callable[[], T], *, timeout_s: float = 10.0, what: str = "condition",
               poll_s: float = 0.01) -> T:  # fmt: skip
    """``pred()`` once it is truthy, polled every ``poll_s``; ``AssertionError`` naming ``what``
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


async def until(pred: Callable[[], T], *, timeout_s: float = 10.0, what: str = "condition",
                poll_s: float = 0.01) -> T:  # fmt: skip
    """``wait_until`` on an event loop the test drives itself (``engine.run``): the loop's own
    tasks run between polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(poll_s)
