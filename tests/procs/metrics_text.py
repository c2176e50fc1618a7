"""Reading a service's ``/metrics`` text in tests: samples with their labels (every series a
service serves also carries its identity labels run, kind and replica)."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of every sample in Prometheus text format."""
    return [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def metric_value(text: str, name: str, labels: str = "") -> float | None:
    """The value of the sample ``name`` whose labels include ``labels`` (``'reason="correct"'``,
    comma-separated pairs); None when there is none."""
    want = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    for sample, have, value in samples(text):
        if sample == name and want.items() <= have.items():
            return value
    return None
