"""What ``/metrics`` serves: every series of the process, labelled with the service's identity.

Each Tether process exports its own identity on every series it serves: ``run`` (``run.name``),
``kind`` (learner, generator, scorer) and ``replica`` (the replica id: ``generator-0``,
``tether-scorer-1``, ``learner-0`` for the learner's rank 0). So two runs scraped by one Prometheus
never mix, and the alerts (deploy/prometheus/rules.yml) key on labels the services emit
themselves, whatever the scrape jobs are called (compose's DNS jobs, a PodMonitor, a plain
``kubernetes_sd`` job). ``tether_service_info`` (always 1) is the one series every process has:
presence alerts count it.

The labels are added when the text is served, not to the metrics themselves: code and tests keep
reading the registry with the labels they declared. The label names are not used by any Tether
metric, and the usual target labels of a scrape (``job``, ``instance``, ``namespace``, ``pod``,
``container``, ``service``, ``endpoint``) are not among them, so nothing is renamed to
``exported_*`` by a scrape without ``honor_labels``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.metrics_core import Metric

from common.telemetry.metrics import metric

IDENTITY_LABELS = ("run", "kind", "replica")
INFO_METRIC = "tether_service_info"


class Identified:
    """A view of a prometheus_client registry whose every sample also carries ``identity``
    (a label the metric declares itself wins, so nothing is overwritten)."""

    def __init__(self, registry: Any, identity: Mapping[str, str]) -> None:
        unknown = set(identity) - set(IDENTITY_LABELS)
        if unknown:
            raise ValueError(f"identity labels are {IDENTITY_LABELS}, got {sorted(unknown)}")
        self.registry, self.identity = registry, dict(identity)

    def collect(self) -> Iterator[Any]:
        for family in self.registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                labels = {**self.identity, **s.labels}
                out.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
            yield out


def identity(*, run: str, kind: str, replica: str) -> dict[str, str]:
    """The identity labels of one service process; starts its ``tether_service_info`` series."""
    metric(
        "Gauge",
        INFO_METRIC,
        "1 while this Tether process serves metrics; labelled run, kind, replica",
    ).set(1)
    return {"run": run, "kind": kind, "replica": replica}
