"""A service stand-in for tests/services/test_keeper.py: each start appends a line to
``--starts``; what this life does is the ``--lives`` entry for its start number (the last one
repeats): ``exit:N`` (exit with code N), ``kill`` (SIGKILL itself: a crash), ``serve:ok`` /
``serve:sick-after:S`` (serve /healthz 200, then 503 after S seconds, until SIGTERM, then exit
75), with a grandchild process that stays in its group."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--starts", required=True)
    p.add_argument("--lives", required=True, help="comma-separated, one per start")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--grandchild-pid-file", default="")
    a = p.parse_args()
    with open(a.starts, "a") as f:
        f.write(f"{os.getpid()}\n")
    n = sum(1 for _ in open(a.starts))
    lives = a.lives.split(",")
    life = lives[min(n, len(lives)) - 1]
    # SIGTERM is taken from here on: a test that sees the grandchild's pid file may send it at once
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if a.grandchild_pid_file:
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(a.grandchild_pid_file, "w") as f:
            f.write(str(g.pid))
    if life.startswith("exit:"):
        raise SystemExit(int(life.split(":")[1]))
    if life == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sick_after = float(life.split(":")[2]) if life.startswith("serve:sick-after") else 1e9
    born = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            code = 200 if time.monotonic() - born < sick_after else 503
            self.send_response(code)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stop.wait()
    raise SystemExit(75)


if __name__ == "__main__":
    main()
