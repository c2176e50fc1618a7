"""A generator's calls to the learner's weight store, each answered within a time limit.

A c10d ``TCPStore`` client waits for a reply with no time limit of its own: the store's
``timeout`` bounds only waits for a key. Across a partition (a generator's link cut, or one
way), a call sent into it blocks until TCP gives up (minutes) or, once the link is back, until
the kernel's retransmission back-off next resends the request: up to two minutes after the
heal. Every call a receiver makes (its cancel checks, progress, results, polls) would hold its
update, the engine paused around it, that long (found by ``tests/e2e/test_e2e_partitions.py``:
a generator cut off from the learner for 75 s was still waiting in a cancel check 30 s after
the heal).

So each call runs on one helper thread per connection and the caller waits at most
``limit_s``; a call not answered by then marks the connection broken, every later call raises
``WeightSyncError`` at once, and the receiver rejoins on a new connection. A call stuck on the
helper thread stays there until TCP lets it go (the thread is a daemon: it never holds up the
process's exit). The gloo rendezvous through the store (``make_pair_group``) goes through the
raw client, bounded by its own timeout.
"""

from __future__ import annotations

import queue
import threading
from concurrent import futures
from concurrent.futures import Future
from typing import Any

from common.weights.layout import WeightSyncError

CALL_LIMIT_S = 10.0  # the most a generator waits for one answer (its timeout_s, if less)


class StoreCaller:
    """The helper thread of one store connection (see the module docstring)."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.broken = ""  # why, once a call went unanswered
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="wsync-store", daemon=True).start()

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                fut.set_exception(e)

    def call(self, fn, *args) -> Any:
        if self.broken:
            raise WeightSyncError(self.broken)
        fut: Future = Future()
        self._q.put((fut, fn, args))
        try:
            return fut.result(timeout=self.limit_s)
        except futures.TimeoutError:
            fut.cancel()
            self.broken = (
                f"the learner's weight store did not answer within {self.limit_s:g} s (the "
                "network between them cut?): rejoining on a new connection"
            )
            raise WeightSyncError(self.broken) from None

    def close(self) -> None:
        """The helper thread ends after the call it is in, if any."""
        self._q.put(None)


class BoundedStore:
    """The calls a receiver makes on ``raw`` (a c10d store: the client, or a ``PrefixStore``
    over it), each through ``caller``: answered within its limit, or ``WeightSyncError``."""

    def __init__(self, raw: Any, caller: StoreCaller) -> None:
        self.raw, self.caller = raw, caller

    def check(self, keys: list[str]) -> bool:
        return self.caller.call(self.raw.check, keys)

    def get(self, key: str) -> bytes:
        return self.caller.call(self.raw.get, key)

    def set(self, key: str, value: str) -> None:
        self.caller.call(self.raw.set, key, value)

    def add(self, key: str, amount: int) -> int:
        return self.caller.call(self.raw.add, key, amount)

    def append(self, key: str, value: str) -> None:
        self.caller.call(self.raw.append, key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.caller.call(self.raw.multi_get, keys)
