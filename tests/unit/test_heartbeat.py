"""The status heartbeat says when it cannot write (a warning, once per episode) and when it works
again; it never raises into the service. The sink is a fake (a status store that fails on
demand): what is under test is the reporter's logging, not Redis."""

from __future__ import annotations

import logging

from common.telemetry.heartbeat import StatusReporter
from common.telemetry.metrics import PhaseTimer


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
