"""The status heartbeat says when it cannot write (a warning, once per episode) and when it works
again; it never raises into the service. The sink is a fake (a status store that fails on
demand): what is under test is the reporter's logging, not Redis."""

from __future__ import annotations

import json
import logging
import threading

from common.telemetry.heartbeat import StatusReporter
from common.telemetry.metrics import PhaseTimer
from tests.waiting import wait_until


class FlakySink:  # a fake of Bus.write_status
    def __init__(self) -> None:
        self.fail, self.docs = True, []

    def write_status(self, service: str, sid: str, doc: str) -> None:
        if self.fail:
            raise ConnectionError("Redis unreachable")
        self.docs.append(doc)


def test_heartbeat_failures_are_warnings_once_per_episode(caplog):
    sink = FlakySink()
    rep = StatusReporter(sink, "scorer", "scorer-0", PhaseTimer("scorer"), lambda: {})
    caplog.set_level(logging.WARNING, logger="common.telemetry.heartbeat")
    for _ in range(3):
        rep.write()
    sink.fail = False
    rep.write()
    rep.write()
    said = [r for r in caplog.records if r.name == "common.telemetry.heartbeat"]
    assert [r.levelno for r in said] == [logging.WARNING, logging.WARNING]
    assert "failed (Redis unreachable)" in said[0].getMessage()
    assert "works again" in said[1].getMessage()
    assert len(sink.docs) == 2


class HeldSink:  # a fake of Bus.write_status whose first write is held (Redis out of memory)
    def __init__(self) -> None:
        self.entered, self.release, self.docs = threading.Event(), threading.Event(), []

    def write_status(self, service: str, sid: str, doc: str) -> None:
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(10)
        self.docs.append(json.loads(doc))


def test_the_last_document_written_is_the_one_stop_writes():
    """A heartbeat held up in a write when the service stops lands before the final document,
    not after it (seen in the Redis-at-maxmemory e2e run: the learner's status said v4 after it
    finished at v6)."""
    sink, state = HeldSink(), {"version": 4}
    rep = StatusReporter(sink, "learner", "learner-0", PhaseTimer("learner"),
                         lambda: dict(state), interval_s=0.01).start()  # fmt: skip
    assert sink.entered.wait(5)  # the thread's write of version 4 is held
    state["version"] = 6
    stopper = threading.Thread(target=rep.stop)
    stopper.start()
    wait_until(
        rep._stop.is_set, timeout_s=5, what="stop() called, its write waiting on the held one"
    )
    sink.release.set()
    stopper.join(5)
    rep._thread.join(5)  # the held write has landed too
    assert [d["version"] for d in sink.docs] == [4, 6], sink.docs
