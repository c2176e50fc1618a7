"""What every Tether service shares at run time: stream and key names, bus settings from the
config, the metrics/health HTTP endpoint, the time breakdown and the status heartbeat.

Streams (all under the run's namespace ``<run>:``)::

    prompts  --(group "generators")-->  generator  --> groups
    groups   --(group "scorers")----->  scorer     --> scored
    scored   --(group "learner")----->  learner    (dispatches prompts, publishes weights)
    dead     dead letters from every consumer group, with the reason

Keys: ``version:learner`` (policy version = optimizer steps done), ``version:generator:<id>``,
``weights:addr`` (host:port of the learner's weight store), ``status:<service>:<id>`` (a hash
refreshed every few seconds: phase seconds, counters, heartbeat) read by ``tether status``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common.bus import Bus, BusSettings
    from common.config import TetherConfig

log = logging.getLogger(__name__)

PROMPTS, GROUPS, SCORED, DEAD = "prompts", "groups", "scored", "dead"
GENERATORS, SCORERS, LEARNER = "generators", "scorers", "learner"


def bus_settings_for(cfg: TetherConfig, *, redis_url: str | None = None) -> BusSettings:
    from common.bus import BusSettings

    url = redis_url or cfg.run.redis_url or os.environ.get("TETHER_REDIS_URL", "")
    if not url:
        from common.config import ConfigError

        raise ConfigError(
            "no Redis URL: set run.redis_url (--redis-url redis://host:6379/0) or start the service "
            "through `tether train`, which starts an embedded server."
        )
    b = cfg.bus
    return BusSettings(
        url=url,
        run=cfg.run.name,
        block_ms=b.block_ms,
        claim_idle_ms=int(b.claim_idle_s * 1000),
        max_deliveries=b.max_deliveries,
        max_message_bytes=int(b.max_message_mb * 1024 * 1024),
        max_backlog=b.max_backlog,
        socket_timeout_s=b.socket_timeout_s,
    )


def service_id(kind: str, given: str | None = None) -> str:
    """A stable replica id: given, or TETHER_SERVICE_ID, or host-pid (not stable across restarts)."""
    return (
        given
        or os.environ.get("TETHER_SERVICE_ID")
        or f"{kind}-{socket.gethostname()}-{os.getpid()}"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PhaseTimer:
    """Where a service spends its time: ``with timer.phase("working"): ...``.

    Exported as ``tether_<service>_phase_seconds_total{phase}``; ``snapshot()`` feeds the status
    heartbeat. Phases used across services: working, waiting_input, blocked_staleness,
    blocked_backpressure, syncing_weights, checkpointing, idle.
    """

    def __init__(self, service: str) -> None:
        from prometheus_client import Counter

        self.service = service
        self.seconds: dict[str, float] = defaultdict(float)
        self._counter = _get_or_make(
            Counter, f"tether_{service}_phase_seconds_total", "seconds spent per phase", ["phase"]
        )
        self._lock = threading.Lock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - start)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[name] += seconds
        self._counter.labels(name).inc(seconds)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.seconds)


_METRICS: dict[str, Any] = {}


def _get_or_make(
    kind: Callable[..., Any], name: str, doc: str, labels: list[str] | None = None, **kw: Any
) -> Any:
    """Create a metric once per process (services may build several loops in one test process)."""
    if name not in _METRICS:
        _METRICS[name] = kind(name, doc, labels or [], **kw)
    return _METRICS[name]


def metric(kind: str, name: str, doc: str, labels: list[str] | None = None, **kw: Any) -> Any:
    import prometheus_client as pc

    return _get_or_make(getattr(pc, kind), name, doc, labels, **kw)


class StatusReporter:
    """Writes ``status:<service>:<id>`` every ``interval_s`` (JSON fields) for ``tether status``."""

    def __init__(
        self,
        bus: Bus,
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

    def start(self) -> StatusReporter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.write()

    def write(self) -> None:
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
            self.bus.call(
                lambda: self.bus.redis.hset(
                    self.bus.key("status"), f"{self.service}:{self.sid}", json.dumps(doc)
                ),
                what="HSET status",
            )
        except Exception as exc:  # status is best effort; the bus logs connection trouble itself
            log.debug("status write failed: %s", exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write()


class HealthServer:
    """``/metrics`` (Prometheus text), ``/healthz`` (process alive), ``/readyz`` (``ready()``)."""

    def __init__(self, port: int, ready: Callable[[], bool], *, host: str = "0.0.0.0") -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                if self.path.startswith("/metrics"):
                    body, ctype, code = generate_latest(), CONTENT_TYPE_LATEST, 200
                elif self.path.startswith("/healthz"):
                    body, ctype, code = b"ok\n", "text/plain", 200
                elif self.path.startswith("/readyz"):
                    ok = outer.ready()
                    body, ctype, code = (
                        (b"ready\n" if ok else b"not ready\n"),
                        "text/plain",
                        200 if ok else 503,
                    )
                else:
                    body, ctype, code = b"not found\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.ready = ready
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="health", daemon=True
        )

    def start(self) -> HealthServer:
        self._thread.start()
        log.info("metrics and health on :%d (/metrics /healthz /readyz)", self.port)
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_async(
    svc: Any, kind: str, sid: str, port: int, *, cleanup: Callable[[], None] | None = None
) -> int:
    """Run an asyncio service (``svc.run()``, ``svc.stop()``, ``svc.ready``, ``svc.status()``,
    ``svc.bus``, ``svc.timer``) with health/metrics endpoints, a status heartbeat and clean
    SIGTERM/SIGINT handling. Returns the exit code."""
    import asyncio
    import signal

    health = HealthServer(port, ready=lambda: svc.ready).start()
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


SUPERVISOR_ENV = "TETHER_SUPERVISOR_PID"  # set by `tether train` for the services it starts


def stop_with_supervisor() -> None:
    """Under `tether train`: have the kernel send this service SIGTERM if the launcher dies.

    A launcher killed with SIGKILL cannot stop its services; without this they would keep running
    (and holding their engines' memory) with nobody supervising them. SIGTERM, not SIGKILL, so
    each service shuts down the way it does on Ctrl-C: its engine and workers go with it. Linux
    only (``prctl(PR_SET_PDEATHSIG)``); elsewhere, and outside `tether train`, a no-op. The signal
    follows the parent process: for learner ranks under ``torchrun`` that is torchrun, which the
    launcher starts through ``common.supervised`` so that it, too, stops with the launcher."""
    import signal
    import sys

    supervisor = os.environ.get(SUPERVISOR_ENV)
    if not supervisor or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0):
        log.warning("prctl(PR_SET_PDEATHSIG) failed: this service would outlive a killed launcher")
        return
    try:  # the launcher may have died before the request above: then nobody will signal us
        os.kill(int(supervisor), 0)
    except ProcessLookupError:
        log.warning("the launcher (pid %s) is gone; stopping", supervisor)
        os.kill(os.getpid(), signal.SIGTERM)


def pid_running(pid: int) -> bool:
    """True while ``pid`` exists and has not exited; a zombie (exited, not yet reaped) has.
    Linux (/proc); False where /proc is missing."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
