"""math-verify grading in worker processes, under a hard per-item timeout of Tether's own.

Why processes: math-verify's built-in timeout uses SIGALRM, which only works on a process's main
thread, and a sympy simplification can run for minutes (``9^{9^{9^{9}}}`` never finishes). Each
worker is a separate process; the pool SIGKILLs a worker that overruns ``timeout_s`` and starts a
replacement, so one pathological answer costs one item (reason ``timeout``), never the scorer.

Protocol (explicit, no pickle of data): every message is one UTF-8 JSON object sent with
``Connection.send_bytes`` over a ``multiprocessing`` pipe.
  worker -> pool  ``{"ready": true}``                     once, after warming math-verify up
  pool -> worker  ``{"id": n, "answer": s, "gold": s}``   one item
  worker -> pool  ``{"id": n, "correct": b, "reason": s}``
  pool -> worker  ``{"stop": true}``                      on close()

``grade_many`` is the only entry point for "grade these (answer, ground_truth) pairs"; where the
answer came from (rule extraction, a solver model) is the caller's business.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from common.telemetry.metrics import metric
from services.scorer.grading_worker import (
    BAD_GROUND_TRUTH,
    ERROR,
    NO_ANSWER,
    TIMEOUT,
    UNPARSEABLE_ANSWER,
    worker_main,
)

log = logging.getLogger(__name__)

MAX_TEXT_CHARS = 10_000  # longer answers/ground truths are graded as "unparseable_answer"
WORKER_START_TIMEOUT_S = 120.0
MAX_CONSECUTIVE_START_FAILURES = 3


@dataclass(frozen=True)
class GradeResult:
    correct: bool
    reason: str
    seconds: float


@dataclass
class _Worker:
    proc: multiprocessing.process.BaseProcess
    conn: Connection
    started_at: float
    ready: bool = False
    item: int | None = None  # index into the current grade_many call's items
    msg_id: int = 0
    deadline: float = 0.0
    dispatched_at: float = 0.0


# ----------------------------------------------------------------------------- metrics


def _metrics(registry) -> dict:
    """The pool's metrics in ``registry`` (None: the global one), made on first use."""
    return {
        "seconds": metric(
            "Histogram",
            "tether_scorer_grade_seconds",
            "Wall time to grade one (answer, ground truth) pair, dispatch to result.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        ),
        "timeouts": metric(
            "Counter",
            "tether_scorer_grade_timeouts_total",
            "Items whose grading overran the hard timeout (worker SIGKILLed).",
            registry=registry,
        ),
        "errors": metric(
            "Counter",
            "tether_scorer_grade_errors_total",
            "Items that could not be graded, by reason.",
            ["reason"],
            registry=registry,
            initial=(BAD_GROUND_TRUTH, "worker_crash", "exception"),
        ),
        "restarts": metric(
            "Counter",
            "tether_scorer_grade_worker_restarts_total",
            "Grading workers replaced, by cause (timeout, crash, start_failure).",
            ["cause"],
            registry=registry,
            initial=("timeout", "crash", "start_failure"),
        ),
    }


# ----------------------------------------------------------------------------- pool side


@dataclass
class _Call:
    """State of one grade_many call."""

    items: list[tuple[str, str]]
    results: list[GradeResult | None]
    queue: deque[int] = field(default_factory=deque)


class GraderPool:
    """``workers`` grading processes; each item gets at most ``timeout_s`` seconds of grading.

    ``registry``: the prometheus_client registry for the metrics (default: the global one).
    ``memory_limit_bytes``: RLIMIT_AS per worker (a MemoryError there grades the item "error").
    ``test_only_sleep_hook``: tests only; an answer ``"__tether_test_only_sleep__:<seconds>"``
    then makes the worker sleep, to exercise the timeout and kill paths deterministically.
    Not re-entrant: concurrent ``grade_many`` calls from several threads are serialised.
    Use as a context manager, or call ``close()``.
    """

    def __init__(
        self,
        workers: int,
        timeout_s: float,
        *,
        start_method: str = "forkserver",
        memory_limit_bytes: int | None = None,
        registry=None,
        test_only_sleep_hook: bool = False,
    ) -> None:
        if workers < 1:
            raise ValueError(f"GraderPool workers must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"GraderPool timeout_s must be > 0 seconds, got {timeout_s}")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(
                f"GraderPool start_method must be 'forkserver' or 'spawn', got {start_method!r} "
                "(fork is unsafe in a process that runs threads or an inference engine)"
            )
        self.timeout_s = float(timeout_s)
        self._ctx: Any = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # Replacement workers fork from a server that already imported math-verify, so a
            # timeout costs a fork, not a fresh interpreter. No effect once the server runs.
            self._ctx.set_forkserver_preload(["math_verify", worker_main.__module__])
        self._memory_limit_bytes = memory_limit_bytes
        self._sleep_hook = test_only_sleep_hook
        self._metrics = _metrics(registry)
        self._lock = threading.Lock()
        self._next_id = 0
        self._start_failures = 0
        self._closed = False
        self._workers = [self._spawn() for _ in range(workers)]

    # -- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc.pid is not None]

    def wait_ready(self, timeout_s: float = WORKER_START_TIMEOUT_S) -> None:
        """Block until every worker has warmed up (for readiness probes and benchmarks)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not all(w.ready for w in self._workers):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"grading workers not ready after {timeout_s:.0f} s")
                self._pump(_Call(items=[], results=[]))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for worker in self._workers:
                try:
                    worker.conn.send_bytes(b'{"stop": true}')
                except OSError:
                    pass
            for worker in self._workers:
                worker.proc.join(timeout=2.0)
                if worker.proc.is_alive():
                    worker.proc.kill()
                    worker.proc.join()
                worker.conn.close()

    # -- grading -------------------------------------------------------------------------

    def grade_many(self, items: Sequence[tuple[str | None, str | None]]) -> list[GradeResult]:
        """Grade (answer, ground_truth) pairs concurrently across workers, results in order."""
        call = _Call(items=[], results=[None] * len(items))
        for index, (answer, gold) in enumerate(items):
            call.items.append((answer or "", gold or ""))
            early = self._early_result(answer, gold)
            if early is None:
                call.queue.append(index)
            else:
                call.results[index] = early
        with self._lock:
            if self._closed:
                raise RuntimeError("GraderPool.grade_many called after close()")
            while call.queue or any(w.item is not None for w in self._workers):
                self._dispatch(call)
                self._pump(call)
        assert all(r is not None for r in call.results)
        return call.results  # type: ignore[return-value]

    def _early_result(self, answer: str | None, gold: str | None) -> GradeResult | None:
        """Items decided without a worker: nothing to compare, or too long to be a real answer."""
        if not isinstance(gold, str) or not gold.strip() or len(gold) > MAX_TEXT_CHARS:
            self._metrics["errors"].labels(reason=BAD_GROUND_TRUTH).inc()
            return GradeResult(False, BAD_GROUND_TRUTH, 0.0)
        if not isinstance(answer, str) or not answer.strip():
            return GradeResult(False, NO_ANSWER, 0.0)
        if len(answer) > MAX_TEXT_CHARS:
            return GradeResult(False, UNPARSEABLE_ANSWER, 0.0)
        return None

    def _dispatch(self, call: _Call) -> None:
        for slot, worker in enumerate(self._workers):
            if not call.queue:
                return
            if not worker.ready or worker.item is not None:
                continue
            if not worker.proc.is_alive():  # died while idle: no item is lost, just replace it
                self._replace(slot, cause="crash")
                continue
            index = call.queue.popleft()
            answer, gold = call.items[index]
            self._next_id += 1
            try:
                worker.conn.send_bytes(
                    json.dumps({"id": self._next_id, "answer": answer, "gold": gold}).encode()
                )
            except OSError:
                call.queue.appendleft(index)  # never reached the worker: grade it elsewhere
                self._replace(slot, cause="crash")
                continue
            now = time.monotonic()
            worker.item, worker.msg_id, worker.dispatched_at = index, self._next_id, now
            worker.deadline = now + self.timeout_s

    def _pump(self, call: _Call) -> None:
        """Wait for one round of events (results, deaths, deadlines) and handle them."""
        now = time.monotonic()
        deadlines = [w.deadline for w in self._workers if w.item is not None]
        deadlines += [w.started_at + WORKER_START_TIMEOUT_S for w in self._workers if not w.ready]
        wait_s = max(0.0, min(deadlines) - now) if deadlines else 1.0
        handles = [w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers]
        ready = set(wait(handles, timeout=wait_s))
        for slot, worker in enumerate(self._workers):
            if worker.conn in ready or worker.proc.sentinel in ready:
                self._on_event(call, slot)
        now = time.monotonic()
        for slot, worker in enumerate(self._workers):
            if worker.item is not None and now >= worker.deadline:
                self._finish(call, worker, GradeResult(False, TIMEOUT, now - worker.dispatched_at))
                self._metrics["timeouts"].inc()
                self._replace(slot, cause="timeout")
            elif not worker.ready and now >= worker.started_at + WORKER_START_TIMEOUT_S:
                self._replace(slot, cause="start_failure")

    def _on_event(self, call: _Call, slot: int) -> None:
        worker = self._workers[slot]
        dead = False
        try:
            while worker.conn.poll():
                self._on_message(call, worker, json.loads(worker.conn.recv_bytes()))
        except (EOFError, OSError, ValueError, KeyError, TypeError):
            dead = True  # closed pipe, or garbled output: either way the worker is gone
        if not dead and worker.proc.is_alive():
            return
        if worker.item is not None:
            seconds = time.monotonic() - worker.dispatched_at
            self._finish(call, worker, GradeResult(False, ERROR, seconds))
            self._metrics["errors"].labels(reason="worker_crash").inc()
        self._replace(slot, cause="crash" if worker.ready else "start_failure")

    def _on_message(self, call: _Call, worker: _Worker, message: dict) -> None:
        if message.get("ready"):
            worker.ready = True
            self._start_failures = 0
            return
        if worker.item is None or message.get("id") != worker.msg_id:
            return  # a stale reply; cannot happen with one item in flight per worker
        reason = str(message["reason"])
        if reason == ERROR:
            self._metrics["errors"].labels(reason="exception").inc()
        elif reason == BAD_GROUND_TRUTH:
            self._metrics["errors"].labels(reason=BAD_GROUND_TRUTH).inc()
        seconds = time.monotonic() - worker.dispatched_at
        self._finish(call, worker, GradeResult(bool(message["correct"]), reason, seconds))

    def _finish(self, call: _Call, worker: _Worker, result: GradeResult) -> None:
        assert worker.item is not None
        if worker.item < len(call.results):
            call.results[worker.item] = result
        self._metrics["seconds"].observe(result.seconds)
        worker.item = None

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=worker_main,
            args=(child_conn, self._memory_limit_bytes, self._sleep_hook),
            name="tether-grader",
            daemon=True,
        )
        proc.start()
        child_conn.close()  # only the worker holds its end: the pool sees EOF when it dies
        return _Worker(proc=proc, conn=parent_conn, started_at=time.monotonic())

    def _replace(self, slot: int, *, cause: str) -> None:
        """SIGKILL the worker in ``slot`` (if still alive) and start a fresh one there."""
        old = self._workers[slot]
        # Process.kill, not os.kill on the pid: the worker may exit and be reaped between a
        # liveness check and the signal (a fresh-clone CI run hit ProcessLookupError there);
        # multiprocessing signals only a child it has not reaped and ignores one already gone.
        old.proc.kill()
        old.proc.join(timeout=5.0)
        old.conn.close()
        log.warning(
            "replacing grading worker pid %s (%s, exit code %s)",
            old.proc.pid,
            cause,
            old.proc.exitcode,
        )
        self._metrics["restarts"].labels(cause=cause).inc()
        if cause == "start_failure":
            self._start_failures += 1
            if self._start_failures >= MAX_CONSECUTIVE_START_FAILURES:
                raise RuntimeError(
                    f"{self._start_failures} grading workers in a row died before becoming "
                    "ready; check that math-verify imports in this environment "
                    "(pip install 'math-verify[antlr4_13_2]') and the worker memory limit"
                )
        self._workers[slot] = self._spawn()
