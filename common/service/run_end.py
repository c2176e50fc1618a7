"""The end of a run, as every service sees it: the learner's run-finished record in Redis.

When the learner has trained its last cycle, written the final checkpoint and collected the last
held-out round, rank 0 writes ``<run>:run:finished`` (``mark_finished``): a JSON document with
the run's ``num_cycles``, the final policy version and the time. Generators and scorers watch
for it (``RunEndWatch``, every ``POLL_S``) and stop by themselves with exit code 0, so a finished
run ends everywhere: a generator's GPU is released (its Kubernetes Job completes), a compose
stack's services stop, and nothing waits for a learner that is not coming back. A service that
starts after the end (a pod replaced, ``docker compose up``) exits 0 at once.

A record counts only for a configuration whose ``run.num_cycles`` it reaches: raise
``num_cycles`` to extend a finished run under the same name and the services keep running (the
learner, resuming below the new end, deletes the stale record with ``clear``).

A run may end early (`tether finish`, ``request_finish``): the learner dispatches no new cycle,
trains the cycles it has dispatched (every prompt it sent out is trained, filtered or dropped as
stale: the books stay whole), then finishes as at its end. Its record names the configured
``num_cycles`` (so every service of that configuration stops) and ``ended_early_at_cycle``, the
cycles it trained; a learner restarted on that run finds it finished at that cycle.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from common.protocol import streams

log = logging.getLogger(__name__)

POLL_S = 2.0  # how often a service looks for the record: its exit comes within ~this after it


class _KeyStore(Protocol):
    """The part of ``common.bus.client.Bus`` this module needs."""

    def get(self, name: str) -> str | None: ...

    def set(self, name: str, value: str | int | float) -> None: ...

    def delete(self, name: str) -> None: ...


def mark_finished(
    bus: _KeyStore, *, num_cycles: int, version: int, ended_early_at_cycle: int | None = None
) -> None:
    """Learner rank 0, at the end of a finished run: every service may stop.
    ``ended_early_at_cycle``: the run was asked to end early (``request_finish``) and trained
    this many cycles of its ``num_cycles``."""
    doc: dict[str, Any] = {"num_cycles": int(num_cycles), "version": int(version),
                           "at": time.time()}  # fmt: skip
    if ended_early_at_cycle is not None:
        doc["ended_early_at_cycle"] = int(ended_early_at_cycle)
    bus.set(streams.RUN_FINISHED, json.dumps(doc))
    bus.delete(streams.RUN_FINISH_REQUEST)  # answered
    early = (
        "" if ended_early_at_cycle is None else f", ended early after cycle {ended_early_at_cycle}"
    )
    log.info("run finished at policy version %d%s: generators and scorers stop by themselves",
             version, early)  # fmt: skip


def request_finish(bus: _KeyStore) -> None:
    """An operator (`tether finish`): end the run early, once the cycles dispatched so far are
    trained."""
    bus.set(streams.RUN_FINISH_REQUEST, json.dumps({"at": time.time()}))


def finish_requested(bus: _KeyStore) -> bool:
    """Learner rank 0, once a cycle: whether an operator asked the run to end early."""
    return bus.get(streams.RUN_FINISH_REQUEST) is not None


def clear(bus: _KeyStore) -> None:
    """Learner rank 0, resuming a run that is not finished: forget an earlier end (and a request
    to end early that came after it: it asked to end the run that had ended)."""
    if bus.get(streams.RUN_FINISHED) is not None:
        bus.delete(streams.RUN_FINISH_REQUEST)
    bus.delete(streams.RUN_FINISHED)


def record(bus: _KeyStore) -> dict[str, Any] | None:
    """The run-finished record as written (``mark_finished``), whatever run length it ends;
    None when there is none or it is malformed."""
    raw = bus.get(streams.RUN_FINISHED)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        int(doc["num_cycles"])
    except (ValueError, KeyError, TypeError):
        log.warning("ignoring a malformed run-finished record: %r", raw[:200])
        return None
    return doc


def finished(bus: _KeyStore, *, num_cycles: int) -> dict[str, Any] | None:
    """The run-finished record if it ends a run of ``num_cycles`` cycles, else None."""
    doc = record(bus)
    return doc if doc is not None and int(doc["num_cycles"]) >= num_cycles else None


class RunEndWatch:
    """Polls for the run-finished record and calls ``on_end`` once when it appears."""

    def __init__(self, bus: _KeyStore, *, num_cycles: int, poll_s: float = POLL_S) -> None:
        self.bus, self.num_cycles, self.poll_s = bus, num_cycles, poll_s
        self.record: dict[str, Any] | None = None

    def check(self) -> bool:
        """True (and ``record`` set) once the run is finished."""
        if self.record is None:
            self.record = finished(self.bus, num_cycles=self.num_cycles)
        return self.record is not None

    async def watch(self, on_end: Callable[[], None]) -> None:
        """Until the record appears (then ``on_end()``) or the task is cancelled. Redis trouble
        is the bus's to report (it retries, then raises): here it only delays the check."""
        while True:
            try:
                ended = await asyncio.to_thread(self.check)
            except Exception as exc:  # noqa: BLE001 - the service's own loop meets it too
                log.debug("run-end check failed: %s", exc)
                ended = False
            if ended:
                assert self.record is not None
                log.info(
                    "the run is finished (the learner reached policy version %s): stopping",
                    self.record.get("version"),
                )
                on_end()
                return
            await asyncio.sleep(self.poll_s)
