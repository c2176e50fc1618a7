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
from common.service import run_end
from tests import deploy_tools as dt
from tests.procs.scorer_proc import test_bus

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


def test_dashboards_pick_the_datasource_and_the_run():
    """No pinned datasource uid: a `datasource` variable; and a `run` variable that every query
    of a Tether series filters on, so two runs in one Prometheus never mix on a panel."""
    promql_parser = pytest.importorskip("promql_parser", reason="pip install promql-parser")
    for path in dt.DASHBOARDS:
        doc = json.loads(path.read_text())
        variables = {v["name"]: v for v in doc["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource", path.name
        assert variables["datasource"]["query"] == "prometheus", path.name
        assert variables["run"]["query"]["query"] == "label_values(tether_service_info, run)"
        ns = variables["namespace"]  # all of them by default: compose has none
        assert ns["query"]["query"] == 'label_values(tether_service_info{run="$run"}, namespace)'
        assert ns["includeAll"] is True and ns["allValue"] == ".*"
        assert "tether-prometheus" not in path.read_text(), f"{path.name} pins a datasource uid"
        unfiltered = []
        for where, expr in dt.dashboard_expressions(path):

            def visit(node, where=where, unfiltered=unfiltered) -> bool:
                if isinstance(node, promql_parser.VectorSelector):
                    names = {m.name: m.value for m in node.matchers.matchers}
                    name = node.name or names.get("__name__", "")
                    if name.startswith(("tether", "process_")) and (
                        names.get("run") != "$run" or names.get("namespace") != "$namespace"
                    ):
                        unfiltered.append(f"{where}: {name}")
                    if name.startswith("DCGM_") and names.get("namespace") != "$namespace":
                        unfiltered.append(f"{where}: {name}")  # GPUs of this deployment only
                return True

            promql_parser.walk(promql_parser.parse(expr), visit)
        assert not unfiltered, "\n".join(unfiltered)


def _aggregations(expr: str) -> list[tuple[str, list[str]]]:
    """(kind, labels) of every aggregation and vector matching in ``expr``: ("by", [...]),
    ("without", [...]), ("none", []) for an aggregation without a clause, ("on", [...]),
    ("ignoring", [...])."""
    import promql_parser

    found: list[tuple[str, list[str]]] = []

    def visit(node) -> bool:
        if isinstance(node, promql_parser.AggregateExpr):
            mod = node.modifier
            if mod is None:
                found.append(("none", []))
            else:
                kind = "by" if mod.type == promql_parser.AggModifierType.By else "without"
                found.append((kind, list(mod.labels)))
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            matching = node.modifier.matching
            if matching is not None:
                text = str(matching)
                found.append((text.split(" ", 1)[0], list(matching.labels)))
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def test_every_alert_is_scoped_to_namespace_and_run_and_has_a_runbook():
    """No aggregate drops `namespace` or `run` (two deployments whose runs share a name never
    mix); the exceptions are named: a target's (job, instance) and Redis's per-namespace figures
    before they are joined to the runs of that namespace. Every alert's runbook_url is a section
    of deploy/README.md, and the README's alert table lists every alert."""
    pytest.importorskip("promql_parser", reason="pip install promql-parser (the dev extra)")
    doc = yaml.safe_load(dt.RULES.read_text())
    readme = (dt.DEPLOY / "README.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", readme, re.M)
    }
    bad = []
    for group in doc["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule.get("record")
            for kind, labels in _aggregations(str(rule["expr"])):
                if kind == "none" or kind in ("without", "ignoring"):
                    bad.append(f"{name}: an aggregation or match without `by`/`on`")
                elif labels in (["job", "instance"], ["namespace"]):
                    continue  # a scrape target; a namespace's Redis, joined to its runs
                elif not {"namespace", "run"} <= set(labels):
                    bad.append(f"{name}: {kind} ({', '.join(labels)}) drops namespace or run")
            if "alert" in rule:
                url = rule["annotations"].get("runbook_url", "")
                if not url.startswith("deploy/README.md#") or url.split("#")[1] not in anchors:
                    bad.append(f"{name}: runbook_url {url!r} is not a section of deploy/README.md")
                if f"| {name} |" not in readme:
                    bad.append(f"{name}: missing from deploy/README.md's alert table")
    assert not bad, "\n".join(bad)


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
def test_real_prometheus_scrapes_a_real_scorer_and_keys_alerts_on_its_labels(
    redis_server, tmp_path
):
    """A real Prometheus with rules.yml scrapes a real scorer: its series carry the run, kind and
    replica the scorer emits; with no learner for that run, TetherLearnerAbsent goes pending for
    it (it would fire after 10 minutes); when the run finishes the scorer exits 0 and the
    pending alert is gone (not a learner absent mid-run)."""
    prometheus = dt.tool("prometheus", apt="prometheus")
    metrics_port, prom_port = free_port(), free_port()
    run, sid = "deploy-prom-test", "scorer-deploy-test"
    scorer = subprocess.Popen(
        [sys.executable, "-m", "tether.cli", "scorer", "--id", sid,
         "--set", f"run.redis_url={redis_server.url}", "--set", f"scorer.metrics_port={metrics_port}",
         "--set", f"run.name={run}", "--set", "scorer.grader_workers=1", "--set", "run.num_cycles=5"],
        stdout=(tmp_path / "scorer.log").open("wb"), stderr=subprocess.STDOUT, cwd=dt.ROOT,
    )  # fmt: skip
    prom = None
    try:
        dt.wait_http(f"http://127.0.0.1:{metrics_port}/metrics", timeout_s=60, proc=scorer)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(dt.RULES)],
            "scrape_configs": [
                {
                    "job_name": "any-job-name",  # the rules never read job names
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

        def get(path: str) -> dict:
            body = json.loads(dt.wait_http(f"{base}{path}", timeout_s=10, proc=prom))
            assert body["status"] == "success", body
            return body["data"]

        def absent_alerts() -> list[dict]:
            return [a for a in get("/api/v1/alerts")["alerts"]
                    if a["labels"]["alertname"] == "TetherLearnerAbsent"]  # fmt: skip

        query = urllib.parse.quote(
            f'tether_scorer_groups_total{{run="{run}", kind="scorer", replica="{sid}"}}'
        )
        deadline, result = time.monotonic() + 60, []
        while not result and time.monotonic() < deadline:
            result = get(f"/api/v1/query?query={query}")["result"]
            time.sleep(0.5)
        assert result, "Prometheus never returned the scorer's series; see prometheus.log"
        (sample,) = result
        assert sample["metric"]["instance"] == f"127.0.0.1:{metrics_port}"
        assert float(sample["value"][1]) == 0.0  # no groups were sent to this scorer
        deadline, pending = time.monotonic() + 60, []
        while not pending and time.monotonic() < deadline:
            pending = absent_alerts()
            time.sleep(0.5)
        assert [(a["state"], a["labels"]["run"]) for a in pending] == [("pending", run)]
        run_end.mark_finished(test_bus(redis_server.url, run), num_cycles=5, version=10)
        assert scorer.wait(30) == 0
        deadline = time.monotonic() + 30
        while absent_alerts() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert absent_alerts() == [], "a finished run's scorer left the alert pending"
    finally:
        for p in (prom, scorer):
            if p is not None:
                dt.kill(p)


@pytest.mark.slow
def test_kubernetes_scrape_job_keeps_running_tether_pods_on_their_metrics_port(tmp_path):
    """deploy/prometheus/kubernetes.yml's relabelling, run by a real Prometheus. Debian's build
    has no kubernetes_sd (promtool refuses the file), so the job's kubernetes_sd_configs are
    swapped for a file_sd list of the targets kubernetes_sd would produce for a namespace
    (pods x container ports, with their __meta_kubernetes_* labels); the relabel rules run
    unchanged. Kept: the running scorer's and Redis exporter's `metrics` ports. Dropped: other
    ports, a completed generator (the run finished: not a target that is down), another app."""
    prometheus = dt.tool("prometheus", apt="prometheus")
    config = yaml.safe_load((dt.DEPLOY / "prometheus" / "kubernetes.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": ["tether"]}}]

    def pod(ip, name, part_of, phase, container, port_name, port):
        return {
            "targets": [f"{ip}:{port}"],
            "labels": {
                "__meta_kubernetes_namespace": "tether",
                "__meta_kubernetes_pod_name": name,
                "__meta_kubernetes_pod_phase": phase,
                "__meta_kubernetes_pod_label_app_kubernetes_io_part_of": part_of,
                "__meta_kubernetes_pod_container_name": container,
                "__meta_kubernetes_pod_container_port_name": port_name,
            },
        }

    groups = [
        pod("10.1.0.1", "tether-scorer-0-x", "tether", "Running", "scorer", "metrics", 9400),
        pod("10.1.0.2", "tether-redis-0", "tether", "Running", "redis", "redis", 6379),
        pod("10.1.0.2", "tether-redis-0", "tether", "Running", "redis-exporter", "metrics", 9121),
        pod(
            "10.1.0.3", "tether-generator-0-y", "tether", "Succeeded", "generator", "metrics", 9400
        ),
        pod("10.1.0.4", "other-app", "other", "Running", "app", "metrics", 8080),
    ]
    (tmp_path / "pods.json").write_text(json.dumps(groups))
    del job["kubernetes_sd_configs"]
    job["file_sd_configs"] = [{"files": [str(tmp_path / "pods.json")]}]
    config["rule_files"] = [str(dt.RULES)]
    config["global"]["scrape_interval"] = "1h"  # discovery is what is tested, not the scrapes
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    prom = subprocess.Popen(
        [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=(tmp_path / "prometheus.log").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        dt.wait_http(f"{base}/-/ready", timeout_s=60, proc=prom)
        deadline, active = time.monotonic() + 30, []
        while len(active) < 2 and time.monotonic() < deadline:
            body = json.loads(dt.wait_http(f"{base}/api/v1/targets", timeout_s=10, proc=prom))
            active = body["data"]["activeTargets"]
            time.sleep(0.5)
        kept = {(t["labels"]["pod"], t["labels"]["container"], t["scrapeUrl"]) for t in active}
        assert kept == {
            ("tether-scorer-0-x", "scorer", "http://10.1.0.1:9400/metrics"),
            ("tether-redis-0", "redis-exporter", "http://10.1.0.2:9121/metrics"),
        }
        assert all(t["labels"]["namespace"] == "tether" for t in active)
        assert len(body["data"]["droppedTargets"]) == 3
    finally:
        dt.kill(prom)
