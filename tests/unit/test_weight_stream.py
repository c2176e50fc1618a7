"""``common.weights.stream``: a streamed update holds at most its window of units, a reader
that stops is left behind without holding the others, and the producer never raises (every
learner rank takes part in each pass it makes)."""

from __future__ import annotations

import threading
import time

import pytest

from common.weights.layout import WeightSyncError
from common.weights.stream import Passes, UnitFeed


def _read_all(reader, out: list, *, delay_s: float = 0.0) -> None:
    try:
        for unit in reader.units(time.monotonic() + 10):
            out.append(unit)
            time.sleep(delay_s)
    except WeightSyncError as exc:
        out.append(exc)
    finally:
        reader.leave()


def test_at_most_the_window_is_held_and_every_reader_gets_every_unit() -> None:
    feed = UnitFeed(20, window=2)
    outs: list[list] = [[], []]
    readers = [feed.reader() for _ in outs]
    threads = [threading.Thread(target=_read_all, args=(r, o), kwargs={"delay_s": 0.002})
               for r, o in zip(readers, outs, strict=True)]  # fmt: skip
    for t in threads:
        t.start()
    held = []
    for k in range(20):
        assert feed.put(k, deadline=time.monotonic() + 10)
        held.append(feed.held())
    for t in threads:
        t.join(10)
    assert outs == [list(range(20)), list(range(20))]
    assert max(held) <= 2
    assert feed.held() == 0  # every unit let go once both readers sent it


def test_a_stalled_reader_is_left_behind_and_the_others_go_on() -> None:
    feed = UnitFeed(10, window=2, stall_s=0.2)
    fast: list = []
    r_fast, r_stuck = feed.reader(), feed.reader()
    fast_thread = threading.Thread(target=_read_all, args=(r_fast, fast))
    fast_thread.start()
    release = threading.Event()  # the stuck reader takes one unit, then reads no more
    stuck_thread = threading.Thread(target=lambda: (next(r_stuck.units()), release.wait(10)))
    stuck_thread.start()
    t0 = time.monotonic()
    for k in range(10):
        feed.put(k, deadline=time.monotonic() + 10)
    assert time.monotonic() - t0 < 3.0  # not held until the deadline
    fast_thread.join(10)  # its reader ends once it has every unit
    assert not fast_thread.is_alive() and fast == list(range(10))
    with pytest.raises(WeightSyncError, match="stalled"):
        feed._get(r_stuck.rid, 1, None)
    release.set()
    stuck_thread.join(10)


def test_the_producer_never_raises_at_the_deadline() -> None:
    feed = UnitFeed(5, window=1)
    feed.reader()  # never reads
    assert feed.put(0, deadline=time.monotonic() + 0.1)
    assert feed.put(1, deadline=time.monotonic() + 0.1) is False  # left behind, units dropped
    assert all(feed.put(k, deadline=time.monotonic()) is False for k in range(2, 5))


def test_passes_hand_each_feed_over_then_say_none() -> None:
    passes = Passes()
    first = UnitFeed(1)
    passes.ask(first)
    assert passes.next(deadline=time.monotonic() + 1) is first
    threading.Timer(0.05, passes.done).start()
    assert passes.next(deadline=time.monotonic() + 5) is None
    assert Passes().next(deadline=time.monotonic() + 0.05) is None  # nobody asked in time


def test_a_reader_registers_before_the_first_unit() -> None:
    """A reader registered later would find the units the others had sent let go."""
    feed = UnitFeed(3, window=2)
    early = feed.reader()
    assert feed.put(0, deadline=time.monotonic() + 1)
    with pytest.raises(AssertionError, match="before its first unit"):
        feed.reader()
    assert next(early.units(time.monotonic() + 1)) == 0
