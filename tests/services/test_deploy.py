"""deploy/: compose, Kubernetes, Prometheus and Grafana files checked with real offline tools
(check-jsonschema, kubernetes-validate, promtool, promql-parser), the metric names they use
matched against a real run's /metrics, and a real Prometheus server scraping a real scorer.

Tools: PyPI `check-jsonschema kubernetes-validate promql-parser` (dev extra); Debian
`prometheus` (promtool and the server). A test skips only when its tool is not installed."""

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

COMPOSE = dt.DEPLOY / "compose" / "docker-compose.yml"
# The layers added to docker-compose.yml through COMPOSE_FILE (GPU nodes, the CPU demo, the smoke test).
COMPOSE_LAYERS = sorted((dt.DEPLOY / "compose").glob("docker-compose.*.yml"))
ENV_EXAMPLE = dt.DEPLOY / "compose" / ".env.example"
K8S = dt.DEPLOY / "k8s"
K8S_VERSION = "1.35.0"  # a current release whose schemas kubernetes-validate bundles
TETHER_CONTAINERS = {"learner", "generator", "scorer"}


def _k8s_docs() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


# ------------------------------------------------------------------------------ compose


def test_compose_validates_against_the_compose_spec():
    exe = dt.tool("check-jsonschema")
    assert {p.name for p in COMPOSE_LAYERS} >= {
        "docker-compose.gpu.yml",
        "docker-compose.cpu-demo.yml",
    }
    files = [str(COMPOSE), *map(str, COMPOSE_LAYERS)]
    res = dt.run_tool([exe, "--builtin-schema", "vendor.compose-spec", *files])
    assert res.returncode == 0, res.stdout + res.stderr


def test_compose_env_example_documents_every_variable():
    # COMPOSE_* variables are read by the compose command itself (project name, file list).
    used = {"COMPOSE_PROJECT_NAME", "COMPOSE_FILE"}
    for path in (COMPOSE, *COMPOSE_LAYERS):
        used |= set(re.findall(r"\$\{([A-Z0-9_]+)", path.read_text()))
    lines = ENV_EXAMPLE.read_text().splitlines()
    documented = {}
    for i, line in enumerate(lines):
        if m := re.match(r"^([A-Z0-9_]+)=", line):
            documented[m.group(1)] = i > 0 and lines[i - 1].startswith("#")
    missing = used - set(documented)
    assert not missing, f"compose uses variables .env.example does not list: {sorted(missing)}"
    undocumented = [k for k, ok in documented.items() if not ok]
    assert not undocumented, f".env.example variables without a comment line above: {undocumented}"
    unused = set(documented) - used
    assert not unused, f".env.example lists variables compose never uses: {sorted(unused)}"


def test_compose_services_wait_for_a_healthy_redis_with_aof_and_password():
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    redis_cmd = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis_cmd and "--appendfsync everysec" in redis_cmd
    assert "--requirepass" in redis_cmd and "healthcheck" in services["redis"]
    tether = [n for n in services if n == "learner" or n.startswith(("generator", "scorer"))]
    assert {"learner", "generator-0", "scorer"} <= set(tether)
    for name in tether:
        svc = services[name]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert svc.get("restart"), f"{name} has no restart policy"
        assert "REDIS_PASSWORD" in svc["environment"]["TETHER_RUN__REDIS_URL"], name
    gpu = yaml.safe_load((dt.DEPLOY / "compose" / "docker-compose.gpu.yml").read_text())
    for name in ("learner", "generator-0", "generator-1"):
        devices = gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"], name
    assert services["learner"]["restart"] == "on-failure"  # a finished run must stay finished


@pytest.mark.parametrize(
    "toml_text",
    [
        (dt.DEPLOY / "compose" / "tether.toml").read_text(),
        yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]["tether.toml"],
    ],
    ids=["compose", "k8s-configmap"],
)
def test_deployed_tether_config_loads(toml_text, tmp_path):
    from common.config.load import load_config

    path = tmp_path / "tether.toml"
    path.write_text(toml_text)
    cfg = load_config(config_file=str(path), overrides=[], flags={}).config
    assert cfg.run.model == "/models/policy" and cfg.weights.port == 29600


# ------------------------------------------------------------------------------ Kubernetes


def test_k8s_manifests_validate_strict():
    exe = dt.tool("kubernetes-validate")
    files = [str(p) for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"]
    res = dt.run_tool([exe, "--strict", "--quiet", "-k", K8S_VERSION, *files])
    assert res.returncode == 0, res.stdout + res.stderr


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files


def test_k8s_pods_are_restricted_probed_and_scraped():
    kinds = {}
    for fname, doc in _k8s_docs():
        kinds.setdefault(doc["kind"], []).append(doc["metadata"]["name"])
        if doc["kind"] not in ("StatefulSet", "Deployment"):
            continue
        pod = doc["spec"]["template"]
        psc = pod["spec"]["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["seccompProfile"]["type"] == "RuntimeDefault", (
            fname
        )
        assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true", fname
        for c in pod["spec"]["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (fname, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (fname, c["name"])
            if c["name"] in TETHER_CONTAINERS:
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert probe in c, (fname, c["name"], probe)
            if c["name"] in ("learner", "generator"):
                assert "nvidia.com/gpu" in c["resources"]["limits"], (fname, c["name"])
    assert kinds["StatefulSet"] == ["tether-generator", "tether-learner", "tether-redis"]
    assert kinds["Deployment"] == ["tether-scorer"]
    assert "Namespace" in kinds and "ConfigMap" in kinds and "NetworkPolicy" in kinds


def test_k8s_network_policy_admits_only_tether_pods_to_redis():
    (redis_policy,) = [
        d
        for _, d in _k8s_docs()
        if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "tether-redis"
    ]
    assert (
        redis_policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "redis"
    )
    to_6379 = [
        r for r in redis_policy["spec"]["ingress"] if any(p["port"] == 6379 for p in r["ports"])
    ]
    assert len(to_6379) == 1
    (peer,) = to_6379[0]["from"]
    assert set(peer) == {"podSelector"}, "Redis must admit pods, not namespaces or IP blocks"
    exprs = {e["key"]: e["values"] for e in peer["podSelector"]["matchExpressions"]}
    assert exprs["app.kubernetes.io/component"] == ["learner", "generator", "scorer"]


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
        [sys.executable, "-m", "common.cli", "scorer", "--id", "scorer-deploy-test",
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
