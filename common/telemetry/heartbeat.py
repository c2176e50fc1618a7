"""The status heartbeat: every few seconds a service writes one JSON document (its phase seconds,
counters, version, pid, metrics port) to the bus's status hash, which ``tether status`` reads."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from common.telemetry.metrics import PhaseTimer

log = logging.getLogger(__name__)


class StatusSink(Protocol):
    """Where heartbeats go: ``common.bus`` ``Bus.write_status``."""

    def write_status(self, service: str, sid: str, doc: str) -> None: ...


class StatusReporter:
    """Writes this replica's field ``<service>:<id>`` of the status hash every ``interval_s``."""

    def __init__(
        self,
        bus: StatusSink,
        service: str,
        sid: str,
        timer: PhaseTimer,
        extra: Callable[[], dict[str, Any]],
        *,
        interval_s: float = 2.0,
        metrics_port: int | None = None,
    ) -> None:
        self.bus, self.service, self.sid, self.timer, self.extra = bus, service, sid, timer, extra
        self.metrics_port = metrics_port
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"status-{service}", daemon=True)
        self.started = time.time()
        self._failing_since: float | None = None  # time.monotonic() of the first failed write
        # one write at a time, each with the document of its own moment: a write the thread
        # started before stop() (held up by a Redis out of memory, say) must land before the
        # final one, or the service's last word in `tether status` is an older document
        self._writing = threading.Lock()

    def start(self) -> StatusReporter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.write()

    def write(self) -> None:
        with self._writing:
            self._write()

    def _write(self) -> None:
        doc = {
            "service": self.service,
            "id": self.sid,
            "heartbeat": time.time(),
            "started": self.started,
            "phases": self.timer.snapshot(),
            "metrics_port": self.metrics_port,
            "pid": os.getpid(),
        }
        try:
            doc.update(self.extra())
            self.bus.write_status(self.service, self.sid, json.dumps(doc))
        except Exception as exc:  # best effort, but said: `tether status` shows this one silent
            if self._failing_since is None:
                self._failing_since = time.monotonic()
                log.warning(
                    "status heartbeat of %s %s failed (%s); `tether status` shows it silent "
                    "until a write works again (retried every %.0f s)",
                    self.service, self.sid, exc, self.interval_s,
                )  # fmt: skip
            return
        if self._failing_since is not None:
            log.warning(
                "status heartbeat of %s %s works again after %.0f s",
                self.service, self.sid, time.monotonic() - self._failing_since,
            )  # fmt: skip
            self._failing_since = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write()
