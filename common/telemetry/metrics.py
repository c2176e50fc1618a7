"""One way to make a Prometheus metric, and the phase timer every service reports.

``metric`` creates a metric once per process and registry and hands the same object back to
every later caller: services may build several loops in one process (tests, benchmarks), and
prometheus_client refuses a second registration of a name. Nothing registers at import time.
Names follow ``tether_<service>_<what>_<unit>`` and labels stay bounded (no trajectory ids).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import prometheus_client as pc

_METRICS: dict[tuple[int, str], Any] = {}
_LOCK = threading.Lock()


def metric(
    kind: str,
    name: str,
    doc: str,
    labels: list[str] | tuple[str, ...] | None = None,
    *,
    registry: Any = None,
    initial: Iterable[str | tuple[str, ...]] = (),
    **kw: Any,
) -> Any:
    """The ``kind`` ("Counter", "Gauge", "Histogram") called ``name`` in ``registry`` (default:
    prometheus_client's global one), created on first use.

    ``initial``: label values (a string for one label, a tuple for several) whose series exist
    from the start at 0, so a dashboard shows 0 rather than "No data" and ``increase()`` sees
    the first event. Counters and histograms only: a gauge at 0 would claim a measurement."""
    registry = pc.REGISTRY if registry is None else registry
    key = (id(registry), name)
    with _LOCK:
        if key not in _METRICS:
            try:
                made = getattr(pc, kind)(name, doc, list(labels or []), registry=registry, **kw)
            except ValueError:  # registered by code outside this helper: use that one
                made = registry._names_to_collectors[name]
            _METRICS[key] = made
        made = _METRICS[key]
    if initial and kind == "Gauge":
        raise ValueError(f"{name}: initial label values are for counters and histograms only")
    for values in initial:
        made.labels(*((values,) if isinstance(values, str) else values))
    return made


class PhaseTimer:
    """Where a service spends its time: ``with timer.phase("working"): ...``.

    Exported as ``tether_<service>_phase_seconds_total{phase}``; ``snapshot()`` feeds the status
    heartbeat. Phases used across services: working, waiting_input, blocked_staleness,
    blocked_backpressure, syncing_weights, checkpointing, idle.
    """

    def __init__(self, service: str) -> None:
        self.service = service
        self.seconds: dict[str, float] = defaultdict(float)
        self._counter = metric(
            "Counter", f"tether_{service}_phase_seconds_total", "seconds spent per phase", ["phase"]
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
