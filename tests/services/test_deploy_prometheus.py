"""deploy/prometheus and the dashboards: promtool checks the config, the rules and their unit
tests; every PromQL expression parses (promql-parser) and uses recorded or exported names; the
metric names they use are matched against a real run's /metrics; and a real Prometheus server
scrapes a real scorer. (The compose and Kubernetes files: test_deploy.py.)

Tools: PyPI `promql-parser` (dev extra); Debian `prometheus` (promtool and the server). A test
skips only when its tool is not installed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.parse

import pytest
import yaml

from common.ports import free_port
from tests import deploy_tools as dt

# ------------------------------------------------------------------------------ Prometheus


def test_promtool_check_config_and_rules():
    exe = dt.tool("promtool", apt="prometheus")
    res = dt.run_tool([exe, "check", "config", str(dt.DEPLOY / "prometheus" / "prometheus.yml")])
    assert res.returncode == 0, res.stdout + res.stderr
    res = dt.run_tool([exe, "check", "rules", str(dt.RULES)])
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_unit_tests_cover_every_alert():
    exe = dt.tool("promtool", apt="prometheus")
    tests = sorted((dt.DEPLOY / "prometheus" / "tests").glob("*.yml"))
    res = dt.run_tool([exe, "test", "rules", *map(str, tests)])
    assert res.returncode == 0, res.stdout + res.stderr
    alerts = {
        r["alert"]
        for g in yaml.safe_load(dt.RULES.read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    tested = {
        t["alertname"]
        for f in tests
        for case in yaml.safe_load(f.read_text())["tests"]
        for t in case.get("alert_rule_test", [])
        if t.get("exp_alerts")  # a case where the alert fires
    }
    assert alerts <= tested, f"alerts without a firing unit test: {sorted(alerts - tested)}"


def test_every_promql_expression_parses_and_uses_recorded_names():
    pytest.importorskip("promql_parser", reason="pip install promql-parser (the dev extra)")
    recorded = dt.recorded_names()
    exprs = dt.all_expressions()
    assert len(exprs) > 50
    bad = []
    for where, expr in exprs:
        try:
            names, _ = dt.selectors(expr)
        except ValueError as exc:
            bad.append(f"{where}: {exc}: {expr}")
            continue
        bad += [
            f"{where}: {n} is not a recording rule"
            for n in names
            if n.startswith("tether:") and n not in recorded
        ]
    assert not bad, "\n".join(bad)
    for name in ("overview", "pipeline", "operations"):
        doc = json.loads((dt.DEPLOY / "grafana" / "dashboards" / f"{name}.json").read_text())
        assert doc["uid"] == f"tether-{name}" and doc["panels"]


@pytest.mark.slow
def test_every_tether_metric_used_is_exported_by_a_real_run(short_run):
    pytest.importorskip("promql_parser", reason="pip install promql-parser (the dev extra)")
    exported = set(short_run.metric_names)
    assert any(n.startswith("tether_learner_") for n in exported), (
        "the run exported no learner metrics"
    )
    missing = []
    for where, expr in dt.all_expressions():
        names, regexes = dt.selectors(expr)
        missing += [
            f"{where}: {n}"
            for n in names
            if n.startswith("tether_") and not dt.is_exported(n, exported)
        ]
        missing += [
            f"{where}: no exported name matches {r!r}"
            for r in regexes
            if not any(re.fullmatch(r, n) for n in exported)
        ]
    assert not missing, "metrics used but not exported by the services:\n" + "\n".join(
        sorted(set(missing))
    )


@pytest.mark.slow
def test_real_prometheus_scrapes_a_real_scorer(redis_server, tmp_path):
    prometheus = dt.tool("prometheus", apt="prometheus")
    metrics_port, prom_port = free_port(), free_port()
    scorer = subprocess.Popen(
        [sys.executable, "-m", "tether.cli", "scorer", "--id", "scorer-deploy-test",
         "--set", f"run.redis_url={redis_server.url}", "--set", f"scorer.metrics_port={metrics_port}",
         "--set", "run.name=deploy-prom-test", "--set", "scorer.grader_workers=1"],
        stdout=(tmp_path / "scorer.log").open("wb"), stderr=subprocess.STDOUT, cwd=dt.ROOT,
    )  # fmt: skip
    prom = None
    try:
        dt.wait_http(f"http://127.0.0.1:{metrics_port}/metrics", timeout_s=60, proc=scorer)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {
                    "job_name": "tether-scorer",
                    "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
                }
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom = subprocess.Popen(
            [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=(tmp_path / "prometheus.log").open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        base = f"http://127.0.0.1:{prom_port}"
        dt.wait_http(f"{base}/-/ready", timeout_s=60, proc=prom)
        query = urllib.parse.quote('tether_scorer_groups_total{job="tether-scorer"}')
        deadline, result = time.monotonic() + 60, []
        while not result and time.monotonic() < deadline:
            body = json.loads(
                dt.wait_http(f"{base}/api/v1/query?query={query}", timeout_s=10, proc=prom)
            )
            assert body["status"] == "success", body
            result = body["data"]["result"]
            time.sleep(0.5)
        assert result, (
            "Prometheus never returned the scorer's tether_scorer_groups_total; see prometheus.log"
        )
        (sample,) = result
        assert sample["metric"]["instance"] == f"127.0.0.1:{metrics_port}"
        assert float(sample["value"][1]) == 0.0  # no groups were sent to this scorer
    finally:
        for p in (prom, scorer):
            if p is not None:
                dt.kill(p)
