"""Is the pipeline still moving? Rank 0 asks while it waits for a cycle's groups.

Every ``CHECK_EVERY_S`` seconds of waiting, ``Watchdog.check``:

- reads Redis's memory against ``maxmemory`` (the ``tether_bus_redis_*`` gauges: ``tether
  status`` and the TetherRedisMemoryNearLimit alert) and says once, loudly, if the server's
  ``maxmemory-policy`` was changed mid-run to one that evicts (``common.bus.memory``);
- finds **positions that can no longer arrive**. Each position of the cycle is always in exactly
  one place: its prompt unacknowledged on ``prompts`` (undelivered, or pending at a generator,
  the staleness gate included), its group on ``groups`` (likewise, at a scorer), its scored group
  on ``scored`` (undelivered to the learner), or here (buffered, or dead-lettered), because every
  step from one place to the next is one atomic commit. So when one atomic snapshot
  (``Bus.in_flight``, MULTI of XINFO GROUPS) finds nothing anywhere while positions are still
  awaited, those positions are gone: Redis evicted a stream or restarted without its data. Two
  such snapshots in a row (``CHECK_EVERY_S`` apart) and the positions are dispatched again, under
  new prompt ids (a dedupe set that survived must not skip them), instead of waiting forever;
- turns "no progress" into a loud error: when rank 0 has waited ``learner.no_progress_s`` for a
  cycle's groups without a scored group or a dead letter coming, it logs where things sit once
  per stall (and again if it lasts), and ``tether_learner_no_progress_seconds`` and the
  learner's status (``no_progress_s``) show how long it has been.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from common.bus.memory import SAFE_POLICIES

if TYPE_CHECKING:
    from common.bus.client import Bus

log = logging.getLogger(__name__)

CHECK_EVERY_S = 5.0


class Watchdog:
    def __init__(self, bus: Bus, metrics: Any, *, no_progress_s: float) -> None:
        self.bus, self.metrics, self.no_progress_s = bus, metrics, no_progress_s
        self.progress_at = time.monotonic()
        self._checked_at = 0.0
        self._empty_before = False
        self._stall_logged_at: float | None = None
        self._policy_said = False
        self._waiting = False

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around rank 0's wait for a cycle's groups: the silence counts from its start (the
        time spent training before it is not a stall), and is 0 outside it."""
        self.progressed()
        self._waiting = True
        try:
            yield
        finally:
            self._waiting = False
            self.metrics.no_progress.set(0)

    def progressed(self) -> None:
        """A scored group or a dead letter: the pipeline moves."""
        self.progress_at = time.monotonic()
        self._stall_logged_at = None
        self.metrics.no_progress.set(0)

    @property
    def silent_s(self) -> float:
        """Seconds waited without progress (0 when not waiting: training, publishing...)."""
        return time.monotonic() - self.progress_at if self._waiting else 0.0

    def check(self, *, cycle: int, awaited: set[int]) -> set[int]:
        """At most every ``CHECK_EVERY_S``: the memory gauges, the stall report, and the awaited
        positions that can no longer arrive (returned: the caller dispatches them again)."""
        now = time.monotonic()
        if now - self._checked_at < CHECK_EVERY_S:
            return set()
        self._checked_at = now
        self._memory()
        silent = self.silent_s
        self.metrics.no_progress.set(silent)
        if not awaited:
            self._empty_before = False
            return set()
        where = self.bus.in_flight()
        empty = sum(where.values()) == 0
        lost = set(awaited) if empty and self._empty_before else set()
        self._empty_before = empty and not lost
        if lost:
            log.error(
                "cycle %d: %d position(s) %s can no longer arrive: no stream holds them and they "
                "were not dead-lettered (Redis evicted keys or restarted without its data; "
                "`tether bus inspect`). Dispatching them again.",
                cycle, len(lost), sorted(lost)[:8],
            )  # fmt: skip
        elif silent >= self.no_progress_s and self._due_stall_report(now):
            log.error(
                "no progress for %.0f s (learner.no_progress_s = %g) waiting for cycle %d, "
                "%d position(s) missing; in flight: %s. Check the generators and scorers "
                "(`tether status`) and their logs.",
                silent, self.no_progress_s, cycle, len(awaited),
                ", ".join(f"{k} {v}" for k, v in where.items()),
            )  # fmt: skip
        return lost

    def _due_stall_report(self, now: float) -> bool:
        if self._stall_logged_at is not None and now - self._stall_logged_at < self.no_progress_s:
            return False
        self._stall_logged_at = now
        return True

    def _memory(self) -> None:
        try:
            mem = self.bus.memory()
        except Exception as exc:  # noqa: BLE001 - a gauge; the bus logs connection trouble
            log.debug("INFO memory failed: %s", exc)
            return
        if mem.policy not in SAFE_POLICIES and not self._policy_said:
            self._policy_said = True
            log.error(
                "Redis's maxmemory-policy is now %s: when it fills up it deletes Tether's keys "
                "(positions lost that way are dispatched again, at a cost). Fix: `redis-cli "
                "CONFIG SET maxmemory-policy noeviction`.",
                mem.policy,
            )
