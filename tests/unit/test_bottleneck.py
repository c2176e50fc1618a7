"""Which stage the status calls the bottleneck (``tether.runs.status.bottleneck``)."""

from __future__ import annotations

from tether.runs.status import bottleneck


def test_no_bottleneck_is_named_before_any_service_has_been_busy():
    """At a run's start every busy fraction is 0: the status names no bottleneck (it used to say
    "scorer (0% busy)", the last kind in the list)."""
    idle = [{"service": "generator", "phases": {"waiting": 3.0}},
            {"service": "scorer", "phases": {}}]  # fmt: skip
    assert bottleneck(idle) is None
    busy = [*idle, {"service": "learner", "phases": {"working": 1.0, "waiting": 1.0}}]
    assert bottleneck(busy) == {"service": "learner", "busy_fraction": 0.5}
