"""Health semantics: /healthz is the main loop's heartbeat (503 before the first beat and after
``stall_s`` of silence), /readyz is readiness and liveness together. A real HTTP server on a
free port; the clock is a test's own counter (named so: ``FakeClock``)."""

from __future__ import annotations

import prometheus_client as pc
import pytest

from common.telemetry.exposition import Identified, identity
from common.telemetry.health import HealthServer, Liveness
from common.telemetry.metrics import metric
from services.generator.loop import _Metrics as GeneratorMetrics
from services.scorer.loop import _Metrics as ScorerMetrics
from tests.procs.httpget import http_get
from tests.procs.metrics_text import metric_value, samples


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_liveness_needs_a_first_beat_and_every_part_recent():
    clock = FakeClock()
    live = Liveness(10.0, clock=clock)
    assert live.check() == (False, "starting: the main loop has not run yet")
    live.beat()
    live.beat("engine")
    clock.now += 10.0
    assert live.check() == (True, "ok")  # exactly the limit is still alive
    live.beat("loop")
    clock.now += 0.5
    ok, why = live.check()
    assert not ok and why.startswith("engine made no progress for 10 s")
    live.beat("engine")
    assert live.check()[0]
    with pytest.raises(ValueError, match="stall_s"):
        Liveness(0)


def test_health_server_turns_503_when_the_loop_stalls_and_back():
    clock = FakeClock()
    live = Liveness(5.0, clock=clock)
    ready = {"v": True}
    srv = HealthServer(0, ready=lambda: ready["v"], live=live, host="127.0.0.1").start()
    try:
        assert http_get(srv.port, "/healthz")[0] == 503  # loading: not alive, not ready
        assert http_get(srv.port, "/readyz") == (503, "not ready\n")
        live.beat()
        assert http_get(srv.port, "/healthz") == (200, "ok: ok\n")
        assert http_get(srv.port, "/readyz") == (200, "ready\n")
        clock.now += 6.0  # the loop wedged
        code, body = http_get(srv.port, "/healthz")
        assert code == 503 and "loop made no progress for 6 s" in body
        assert http_get(srv.port, "/readyz")[0] == 503  # readiness follows liveness back down
        live.beat()
        ready["v"] = False  # alive but e.g. reloading
        assert http_get(srv.port, "/healthz")[0] == 200
        assert http_get(srv.port, "/readyz")[0] == 503
    finally:
        srv.stop()


def test_initial_label_values_exist_at_zero_before_any_event():
    reg = pc.CollectorRegistry()
    c = metric("Counter", "tether_test_things_total", "things", ["split"], registry=reg,
               initial=("train", "eval"))  # fmt: skip
    assert reg.get_sample_value("tether_test_things_total", {"split": "train"}) == 0.0
    assert reg.get_sample_value("tether_test_things_total", {"split": "eval"}) == 0.0
    c.labels("train").inc()
    assert reg.get_sample_value("tether_test_things_total", {"split": "train"}) == 1.0
    with pytest.raises(ValueError, match="counters and histograms only"):
        metric("Gauge", "tether_test_level", "level", ["k"], registry=reg, initial=("a",))


def test_services_labelled_counters_have_series_from_the_start():
    ScorerMetrics()
    GeneratorMetrics()
    get = pc.REGISTRY.get_sample_value
    for name, labels in [
        ("tether_scorer_items_total", {"reason": "timeout"}),
        ("tether_scorer_items_total", {"reason": "correct"}),
        ("tether_scorer_unscorable_groups_total", {"reason": "missing_ground_truth"}),
        ("tether_generator_groups_total", {"split": "train"}),
        ("tether_generator_groups_total", {"split": "eval"}),
    ]:
        assert get(name, labels) is not None, (name, labels)


def test_metrics_served_carry_the_services_identity_on_every_series():
    c = metric("Counter", "tether_test_identified_total", "things", ["split"], initial=("train",))
    c.labels("train").inc(3)
    metric("Gauge", "tether_test_own_run", "a metric with its own run label", ["run"]).labels(
        "mine"
    ).set(1)
    labels = identity(run="r1", kind="scorer", replica="scorer-2")
    srv = HealthServer(0, ready=lambda: True, host="127.0.0.1", identity=labels).start()
    try:
        code, text = http_get(srv.port, "/metrics")
    finally:
        srv.stop()
    assert code == 200
    got = samples(text)
    assert got and all(labels.items() <= have.items() for name, have, _ in got
                       if name != "tether_test_own_run")  # fmt: skip
    assert metric_value(text, "tether_test_identified_total", 'split="train",kind="scorer"') == 3
    assert metric_value(text, "tether_test_own_run", 'run="mine"') == 1  # its own label wins
    assert metric_value(text, "tether_service_info", 'run="r1"') == 1
    assert any(name.startswith("process_") or name.startswith("python_") for name, _, _ in got)
    with pytest.raises(ValueError, match="identity labels"):
        Identified(pc.REGISTRY, {"service": "x"})
