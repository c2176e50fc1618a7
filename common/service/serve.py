"""What a service's entry runs around its loop: a stable replica id, the ``/metrics`` ``/healthz``
``/readyz`` endpoint, the status heartbeat and a clean stop on SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

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
    svc: Any, kind: str, sid: str, port: int, *, cleanup: Callable[[], None] | None = None
) -> int:
    """Run an asyncio service (``svc.run()``, ``svc.stop()``, ``svc.ready``, ``svc.live``,
    ``svc.status()``, ``svc.bus``, ``svc.timer``) with health/metrics endpoints, a status heartbeat and clean
    SIGTERM/SIGINT handling. Returns the exit code."""
    import asyncio
    import signal

    health = HealthServer(port, ready=lambda: svc.ready, live=svc.live).start()
    status = StatusReporter(
        svc.bus, kind, sid, svc.timer, svc.status, metrics_port=health.port
    ).start()

    async def go() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, svc.stop)
        await svc.run()

    try:
        asyncio.run(go())
    finally:
        status.stop()
        health.stop()
        if cleanup is not None:
            cleanup()
    log.info("%s %s stopped", kind, sid)
    return 0
