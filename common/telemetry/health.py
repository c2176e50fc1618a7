"""``/metrics`` (Prometheus text), ``/healthz`` (liveness) and ``/readyz`` (readiness) on one port
per service (``<section>.metrics_port``; 0 picks a free one).

Liveness is a heartbeat, not "the HTTP thread answers": the main loop (and, in a generator, a
probe of the vLLM engine) calls ``Liveness.beat(part)`` whenever it makes progress, and
``/healthz`` answers 503 when any part has been silent for longer than ``stall_s`` seconds
(``<section>.liveness_s``), or before the first beat (still loading: the start-up probe covers
that). Readiness is the service's own ``ready()`` and liveness together, so a wedged or loading
service is never ready."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from common.telemetry.exposition import Identified

log = logging.getLogger(__name__)


class Liveness:
    """Named heartbeats (``loop``, ``engine``, ...), each judged against ``stall_s``."""

    def __init__(self, stall_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if stall_s <= 0:
            raise ValueError(f"stall_s must be > 0 seconds, got {stall_s}")
        self.stall_s, self._clock = stall_s, clock
        self._beats: dict[str, float] = {}
        self._lock = threading.Lock()

    def beat(self, part: str = "loop") -> None:
        with self._lock:
            self._beats[part] = self._clock()

    def check(self) -> tuple[bool, str]:
        """(alive, why): every part beat within ``stall_s``; not alive before the first beat."""
        with self._lock:
            beats = dict(self._beats)
        if not beats:
            return False, "starting: the main loop has not run yet"
        now = self._clock()
        silent = [
            f"{part} made no progress for {now - t:.0f} s (limit {self.stall_s:.0f} s)"
            for part, t in sorted(beats.items())
            if now - t > self.stall_s
        ]
        return (not silent), ("; ".join(silent) or "ok")


class HealthServer:
    """``/metrics`` (Prometheus text), ``/healthz`` (``live.check()``), ``/readyz`` (``ready()``
    and live). Without ``live`` (tools, tests of other parts) ``/healthz`` is always 200."""

    def __init__(
        self,
        port: int,
        ready: Callable[[], bool],
        *,
        live: Liveness | None = None,
        host: str = "0.0.0.0",
        identity: Mapping[str, str] | None = None,
    ) -> None:
        """``identity``: the ``run``, ``kind`` and ``replica`` labels every served series
        carries (``exposition.identity``); without it the registry is served as it is."""
        outer = self
        served: Any = Identified(REGISTRY, identity) if identity else REGISTRY

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                ctype = "text/plain"
                if self.path.startswith("/metrics"):
                    body, ctype, code = generate_latest(served), CONTENT_TYPE_LATEST, 200
                elif self.path.startswith("/healthz"):
                    ok, why = outer.alive()
                    body, code = (
                        f"{'ok' if ok else 'unhealthy'}: {why}\n".encode(),
                        (200 if ok else 503),
                    )
                elif self.path.startswith("/readyz"):
                    ok = outer.alive()[0] and outer.ready()
                    body, code = (b"ready\n" if ok else b"not ready\n"), (200 if ok else 503)
                else:
                    body, code = b"not found\n", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.ready, self.live = ready, live
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="health", daemon=True
        )

    def alive(self) -> tuple[bool, str]:
        return self.live.check() if self.live is not None else (True, "no heartbeat kept")

    def start(self) -> HealthServer:
        self._thread.start()
        log.info("metrics and health on :%d (/metrics /healthz /readyz)", self.port)
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
