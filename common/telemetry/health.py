"""``/metrics`` (Prometheus text), ``/healthz`` (process alive) and ``/readyz`` (ready to work) on
one port per service (``<section>.metrics_port``; 0 picks a free one)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)


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
