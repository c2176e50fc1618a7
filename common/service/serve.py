"""What a service's entry runs around its loop: a stable replica id, the ``/metrics`` ``/healthz``
``/readyz`` endpoint, the status heartbeat, a clean stop on SIGTERM/SIGINT, and a stop with exit
code 0 when the learner says the run is finished (``run_end``)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable
from typing import Any

from common.bus.settings import BusStopping
from common.service.exit_codes import EXIT_STOPPED
from common.service.run_end import RunEndWatch
from common.telemetry.exposition import identity
from common.telemetry.health import HealthServer
from common.telemetry.heartbeat import StatusReporter

log = logging.getLogger(__name__)


def service_id(kind: str, given: str | None = None) -> str:
    """A stable replica id: given, or TETHER_SERVICE_ID, or host-pid (not stable across restarts)."""
    return (
        given
        or os.environ.get("TETHER_SERVICE_ID")
        or f"{kind}-{socket.gethostname()}-{os.getpid()}"
    )


def serve_async(
    svc: Any,
    kind: str,
    sid: str,
    port: int,
    *,
    num_cycles: int,
    cleanup: Callable[[], None] | None = None,
) -> int:
    """Run an asyncio service (``svc.run()``, ``svc.stop()``, ``svc.ready``, ``svc.live``,
    ``svc.status()``, ``svc.bus``, ``svc.timer``) with health/metrics endpoints
    (every series labelled run, kind and replica: ``exposition``), a status
    heartbeat, clean SIGTERM/SIGINT handling and the end of the run (``run_end``).

    Returns the exit code: 0 when the run is finished (the learner's run-finished record for a
    run of ``num_cycles`` cycles: at start, or seen while serving), ``EXIT_STOPPED`` (75) when a
    signal stopped it before that, so that whoever restarts services (a Kubernetes Job's
    pod failure policy, a supervisor) can tell a finished run from a stopped replica."""
    watch = RunEndWatch(svc.bus, num_cycles=num_cycles)
    if watch.check():
        log.info(
            "%s %s: the run is already finished (policy version %s); nothing to do",
            kind, sid, watch.record.get("version") if watch.record else None,
        )  # fmt: skip
        return 0
    labels = identity(run=svc.bus.settings.run, kind=kind, replica=sid)
    health = HealthServer(port, ready=lambda: svc.ready, live=svc.live, identity=labels).start()
    status = StatusReporter(
        svc.bus, kind, sid, svc.timer, svc.status, metrics_port=health.port
    ).start()
    stopping = False

    def stop() -> None:
        nonlocal stopping
        stopping = True
        svc.bus.stopping.set()  # a wait for room downstream gives up
        svc.stop()

    async def go() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        ender = asyncio.create_task(watch.watch(stop))
        try:
            await svc.run()
        except (asyncio.CancelledError, BusStopping):
            if not stopping:
                raise
        finally:
            ender.cancel()

    try:
        asyncio.run(go())
    finally:
        status.stop()
        health.stop()
        if cleanup is not None:
            cleanup()
    if watch.record is not None:
        log.info("%s %s stopped: the run is finished", kind, sid)
        return 0
    if stopping:
        log.info("%s %s stopped before the run's end (exit code %d)", kind, sid, EXIT_STOPPED)
        return EXIT_STOPPED
    log.info("%s %s stopped", kind, sid)
    return 0
