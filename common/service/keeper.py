"""``python -m common.service.keeper [options] -- PROGRAM [ARGS...]``: keep one service running
inside its container, with the restart rules Docker's restart policies cannot express.

Docker restarts a container on any non-zero exit (``on-failure``) or on every exit
(``unless-stopped``), and never when it turns unhealthy. A Tether service says more with its
exit code (``exit_codes``): 0 the run is finished, 2 its configuration or data was refused
(restarting cannot help), 75 it was stopped by a signal, anything else a crash. The keeper runs
the service as its child (in its own process group) and:

- exits 0 when the service exits 0, 2 when it exits 2, 75 when it was stopped: never restarted;
- restarts a crashed service (a non-zero code, a signal: SIGKILL by the OOM killer) after a
  back-off, at most ``--max-restarts`` times within ``--window-s`` (then it exits with the
  crash's code, and the container stays stopped: bounded);
- restarts a service whose ``--health-url`` (its ``/healthz``: the loop's heartbeat) has failed
  ``--unhealthy-after`` checks in a row, once it has answered 200 or ``--start-s`` has passed
  since it started (loading a model takes minutes): SIGTERM, then SIGKILL to its group after
  ``--stop-timeout-s``; counted like a crash;
- passes SIGTERM and SIGINT on to the service and waits for it (a clean stop: the service stops
  its own children), and kills what is left of its process group after it exits (vLLM's engine
  core, grading workers, after a crash).

The compose files run every Tether service under it with Docker's ``restart: "no"``: the keeper
is the restart policy. It runs as the service's parent, under Docker's init; a SIGKILL of the
container's init (``docker kill``) is a manual stop, which no restart policy undoes.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque

from common.service.exit_codes import EXIT_REFUSED, EXIT_STOPPED

log = logging.getLogger("tether.keeper")

FINAL_CODES = (0, EXIT_REFUSED, EXIT_STOPPED)  # what a service decided: never restarted


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m common.service.keeper", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--max-restarts", type=int, default=5, help="crashes tolerated per window")
    p.add_argument("--window-s", type=float, default=3600.0, help="the window, in seconds")
    p.add_argument("--health-url", default="", help="the service's /healthz; empty = no checks")
    p.add_argument(
        "--start-s",
        type=float,
        default=900.0,
        help="seconds a starting service may take to answer /healthz 200",
    )
    p.add_argument("--check-every-s", type=float, default=10.0)
    p.add_argument("--unhealthy-after", type=int, default=6, help="failed checks in a row")
    p.add_argument(
        "--stop-timeout-s",
        type=float,
        default=60.0,
        help="seconds between SIGTERM and SIGKILL when the keeper stops the service",
    )
    p.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM [ARGS...]")
    a = p.parse_args(argv)
    if a.program[:1] == ["--"]:
        a.program = a.program[1:]
    if not a.program:
        p.error("no program: python -m common.service.keeper [options] -- PROGRAM [ARGS...]")
    if a.max_restarts < 0 or a.window_s <= 0 or a.unhealthy_after < 1 or a.check_every_s <= 0:
        p.error("--max-restarts >= 0, --window-s > 0, --unhealthy-after >= 1, --check-every-s > 0")
    return a


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Keeper:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.crashes: deque[float] = deque()
        self.stopping = False
        self.proc: subprocess.Popen | None = None

    def on_signal(self, signum: int, _frame: object) -> None:
        self.stopping = True
        self._signal(signum)

    def _signal(self, sig: int, *, group: bool = False) -> None:
        """Signal the service (it stops its own children, e.g. vLLM's engine core, in order),
        or its whole process group."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig) if group else self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def _reap_group(self) -> None:
        """SIGKILL what the service left in its process group (its leader has exited)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _watch(self) -> int | None:
        """Wait for the service to exit (its code) or turn unhealthy (None)."""
        assert self.proc is not None
        started, answered, failures = time.monotonic(), False, 0
        next_check = started + self.a.check_every_s
        while True:
            code = self.proc.poll()
            if code is not None:
                return code
            if self.a.health_url and not self.stopping and time.monotonic() >= next_check:
                next_check = time.monotonic() + self.a.check_every_s
                if _healthy(self.a.health_url):
                    answered, failures = True, 0
                elif answered or time.monotonic() - started > self.a.start_s:
                    failures += 1
                    if failures >= self.a.unhealthy_after:
                        return None
            time.sleep(0.2)

    def _stop_unhealthy(self) -> None:
        log.error("%s is unhealthy (%d failed checks of %s): stopping it to restart it",
                  self.a.program[0], self.a.unhealthy_after, self.a.health_url)  # fmt: skip
        self._signal(signal.SIGTERM)
        assert self.proc is not None
        try:
            self.proc.wait(self.a.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL, group=True)
            self.proc.wait()

    def run(self) -> int:
        while True:
            self.proc = subprocess.Popen(self.a.program, start_new_session=True)
            log.info("started %s (pid %d)", " ".join(self.a.program), self.proc.pid)
            code = self._watch()
            if code is None:
                self._stop_unhealthy()
                code = self.proc.returncode
                why = "unhealthy"
            else:
                why = f"exit code {code}"
            self._reap_group()
            if self.stopping or (why != "unhealthy" and code in FINAL_CODES):
                log.info("%s ended (%s): not restarted", self.a.program[0], why)
                return EXIT_STOPPED if self.stopping and code not in FINAL_CODES else code
            now = time.monotonic()
            self.crashes.append(now)
            while self.crashes and now - self.crashes[0] > self.a.window_s:
                self.crashes.popleft()
            if len(self.crashes) > self.a.max_restarts:
                log.error("%s failed %d times within %.0f s (%s): giving up",
                          self.a.program[0], len(self.crashes), self.a.window_s, why)  # fmt: skip
                return code if code > 0 else 128 - code  # a signal -N exits as 128+N
            delay = min(30.0, 2.0 ** (len(self.crashes) - 1))
            log.warning("%s failed (%s): restart %d of at most %d in %.0f s",
                        self.a.program[0], why, len(self.crashes), self.a.max_restarts, delay)  # fmt: skip
            until = time.monotonic() + delay
            while time.monotonic() < until and not self.stopping:
                time.sleep(0.1)
            if self.stopping:
                return EXIT_STOPPED


def main(argv: list[str] | None = None) -> int:
    a = _args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    keeper = Keeper(a)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, keeper.on_signal)
    return keeper.run()


if __name__ == "__main__":
    raise SystemExit(main())
