"""One update produced unit by unit while it is sent, so that the sender never holds the whole
model: the producer (the learner's gather, or an update kept in memory) fills a ``UnitFeed``
one unit at a time, and each sender (the chain's first link, or one thread per member
pairwise) reads the units in order. A unit is let go as soon as every reader has sent it, and
the producer waits while ``window`` units are held, so a publish holds at most ``window``
units (each at most a bucket, or one tensor larger than a bucket) besides what it is gathering.

A publish is one or more passes over the units (``Passes``): its round (the publisher's
thread) asks for a pass for the members that still need the version; the producer (the
caller's thread) makes each pass asked for, and learns that none is needed any more from
``Passes.next``. A chain that broke mid-publish is served again by a second pass.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from common.weights.layout import WeightSyncError

WINDOW = 2  # units held at a time: one being sent while the next is produced


class UnitFeed:
    """The units of one pass, in order, from one producer to the readers registered before it
    starts; a reader that stops (failed, called off) leaves and no longer holds units back."""

    def __init__(self, n_units: int, *, window: int = WINDOW, stall_s: float | None = None) -> None:
        self.n_units, self.window, self.stall_s = n_units, window, stall_s
        self._cond = threading.Condition()
        self._units: dict[int, Any] = {}
        self._produced = 0  # units put so far
        self._positions: dict[int, int] = {}  # reader id -> next unit it reads
        self._moved: dict[int, float] = {}  # reader id -> when it last took a unit
        self._made: dict[int, float] = {}  # unit -> when it was put (units still held)
        self._left_behind: set[int] = set()
        self._closed = False  # the producer stopped before the end (its pass was abandoned)

    def reader(self) -> FeedReader:
        with self._cond:
            # a reader that came later would find units let go: register all, then produce
            assert not self._produced, "a feed's readers register before its first unit"
            rid = len(self._positions) + len(self._left_behind)
            self._positions[rid], self._moved[rid] = 0, time.monotonic()
        return FeedReader(self, rid)

    def put(self, unit: Any, *, deadline: float) -> bool:
        """Hand the next unit to the readers; waits while ``window`` units are held. A reader
        that took nothing for ``stall_s`` meanwhile is left behind (its sender fails: the member
        is dropped) so that one stuck member does not hold the others, and at ``deadline`` all
        are. Returns False when no reader is left (the caller still makes the pass, but drops
        its units): it never raises, since every learner rank gathers the pass's units."""
        with self._cond:
            while self._positions and self._produced - min(self._positions.values()) >= self.window:
                self._leave_behind_stalled()
                if time.monotonic() >= deadline:  # every reader left behind: the pass goes on
                    for rid in list(self._positions):  # (the learner's ranks are in it) unsent
                        self._left_behind.add(rid)
                        self._drop_reader(rid)
                    break
                self._cond.wait(timeout=max(0.0, min(0.1, deadline - time.monotonic())))
            if not self._positions:
                self._produced += 1
                return False
            self._units[self._produced] = unit
            self._made[self._produced] = time.monotonic()
            self._produced += 1
            self._cond.notify_all()
            return True

    def _leave_behind_stalled(self) -> None:
        if self.stall_s is None or not self._positions:
            return
        low = min(self._positions.values())
        now = time.monotonic()
        for rid, pos in list(self._positions.items()):
            # stalled: the unit it needs has been there, and it took nothing, for stall_s
            since = max(self._moved[rid], self._made.get(pos, now))
            if pos == low and now - since > self.stall_s:
                self._left_behind.add(rid)
                self._drop_reader(rid)

    def abandon(self) -> None:
        """The producer stops before the end: readers waiting for a unit fail."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _get(self, rid: int, k: int, deadline: float | None) -> Any:
        with self._cond:
            while self._produced <= k and not self._closed and rid not in self._left_behind:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WeightSyncError("weight publish: the next unit did not come in time")
                self._cond.wait(timeout=0.1 if left is None else min(0.1, left))
            if rid in self._left_behind:
                raise WeightSyncError(f"weight publish: stalled for over {self.stall_s} s")
            if self._produced <= k:
                raise WeightSyncError("weight publish: the pass was abandoned")
            return self._units[k]

    def _advance(self, rid: int, k: int) -> None:
        with self._cond:
            if rid not in self._positions:  # it left (called off) while sending this unit
                return
            self._positions[rid], self._moved[rid] = k + 1, time.monotonic()
            self._release()

    def _leave(self, rid: int) -> None:
        with self._cond:
            self._drop_reader(rid)

    def _drop_reader(self, rid: int) -> None:
        self._positions.pop(rid, None)
        self._release()

    def _release(self) -> None:
        """Let go of every unit all remaining readers have sent (lock held)."""
        low = min(self._positions.values(), default=self._produced)
        for j in [j for j in self._units if j < low]:
            del self._units[j]
            self._made.pop(j, None)
        self._cond.notify_all()

    def held(self) -> int:
        """Units held now (tests)."""
        with self._cond:
            return len(self._units)


class FeedReader:
    """One sender's view of a feed: iterate it for the units (each waits for the producer, up
    to ``deadline``); ``leave()`` (also on exit from ``with``) lets the producer go on."""

    def __init__(self, feed: UnitFeed, rid: int) -> None:
        self.feed, self.rid = feed, rid
        self.deadline: float | None = None

    def units(self, deadline: float | None = None):
        self.deadline = deadline
        for k in range(self.feed.n_units):
            unit = self.feed._get(self.rid, k, deadline)
            yield unit
            self.feed._advance(self.rid, k)

    def leave(self) -> None:
        self.feed._leave(self.rid)

    def __enter__(self) -> FeedReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.leave()


class HeldFeed:
    """The feed of an update held whole in memory: every reader goes at its own pace and
    nothing is produced (``reader()`` returns the feed itself). A unit held elsewhere than
    ``device`` (a streamed update's copy in host memory, sent over NCCL) is copied there as it
    is read, one at a time."""

    def __init__(self, units: list, device: Any = None) -> None:
        self._units, self._device = units, device

    def reader(self) -> HeldFeed:
        return self

    def units(self, deadline: float | None = None):
        if self._device is None:
            return iter(self._units)
        return (u.to(self._device) for u in self._units)

    def leave(self) -> None:
        pass

    def __enter__(self) -> HeldFeed:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class Passes:
    """How a publish's round asks its producer for passes: ``ask(feed)`` hands over the feed
    of the next pass, ``done()`` says no more; the producer takes them with ``next()``."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._asked: list[UnitFeed] = []
        self._done = False

    def ask(self, feed: UnitFeed) -> None:
        with self._cond:
            self._asked.append(feed)
            self._cond.notify_all()

    def done(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def next(self, *, deadline: float) -> UnitFeed | None:
        """The next pass to make, or None when the round needs no more (or at ``deadline``)."""
        with self._cond:
            while not self._asked and not self._done:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(timeout=min(0.1, left))
            return self._asked.pop(0) if self._asked else None
