"""``common.weights.store_calls``: a store call that goes unanswered (a partition) raises within
the limit, and the connection is then refused at once, so that the receiver rejoins."""

from __future__ import annotations

import threading
import time

import pytest

from common.weights.layout import WeightSyncError
from common.weights.store_calls import BoundedStore, StoreCaller


class _Store:
    """A store whose calls answer at once, or hang (until ``release``) while ``hang`` is set."""

    def __init__(self) -> None:
        self.hang = threading.Event()
        self.release = threading.Event()
        self.keys: dict[str, bytes] = {}

    def _wait(self) -> None:
        if self.hang.is_set():
            self.release.wait(30)

    def check(self, keys):
        self._wait()
        return all(k in self.keys for k in keys)

    def get(self, key):
        self._wait()
        if key not in self.keys:
            raise RuntimeError(f"no key {key}")
        return self.keys[key]

    def set(self, key, value):
        self._wait()
        self.keys[key] = value.encode()

    def add(self, key, amount):
        self._wait()
        n = int(self.keys.get(key, b"0")) + amount
        self.keys[key] = str(n).encode()
        return n

    def append(self, key, value):
        self._wait()
        self.keys[key] = self.keys.get(key, b"") + value.encode()

    def multi_get(self, keys):
        self._wait()
        return [self.keys[k] for k in keys]


def test_answered_calls_pass_through_and_raise_as_the_store_does():
    raw = _Store()
    caller = StoreCaller(5.0)
    store = BoundedStore(raw, caller)
    store.set("a", "1")
    assert store.check(["a"]) and not store.check(["b"])
    assert store.get("a") == b"1"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    store.append("a", "2")
    assert store.multi_get(["a", "n"]) == [b"12", b"5"]
    with pytest.raises(RuntimeError, match="no key b"):
        store.get("b")
    assert not caller.broken  # an error answered is not a broken connection
    caller.close()


def test_an_unanswered_call_raises_within_the_limit_and_later_calls_at_once():
    raw = _Store()
    caller = StoreCaller(0.3)
    store = BoundedStore(raw, caller)
    raw.hang.set()
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="did not answer within 0.3 s"):
        store.check(["dropped"])
    assert 0.3 <= time.monotonic() - t0 < 2.0
    raw.hang.clear()  # the link is back: the connection stays refused all the same (rejoin)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="did not answer"):
        store.set("progress", "1")
    assert time.monotonic() - t0 < 0.1
    assert "progress" not in raw.keys
    raw.release.set()  # the stuck call returns; the helper thread then ends on close
    caller.close()
