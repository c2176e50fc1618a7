"""Waiting in tests: on a condition with a deadline, never on a fixed sleep (a sleep is a guess
about another thread's or process's speed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _checked(pred: Callable[[], T], deadline: float, timeout_s: float, what: str) -> T:
    """``pred()``; ``AssertionError`` naming ``what`` if it is falsy and ``deadline`` has passed."""
    value = pred()
    if not value and time.monotonic() >= deadline:
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
    return value


def wait_until(pred: Callable[[], T], *, timeout_s: float = 10.0, what: str = "condition",
               poll_s: float = 0.01) -> T:  # fmt: skip
    """``pred()`` once it is truthy, polled every ``poll_s``; ``AssertionError`` naming ``what``
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := _checked(pred, deadline, timeout_s, what)):
        time.sleep(poll_s)
    return value


async def until(pred: Callable[[], T], *, timeout_s: float = 10.0, what: str = "condition",
                poll_s: float = 0.01) -> T:  # fmt: skip
    """``wait_until`` on an event loop the test drives itself (``engine.run``): the loop's own
    tasks run between polls."""
    deadline = time.monotonic() + timeout_s
    while not (value := _checked(pred, deadline, timeout_s, what)):
        await asyncio.sleep(poll_s)
    return value
