"""Static checks of the compose stack that `make compose-test` (deploy/compose/smoke.sh) runs for
real: the security settings every container must keep, the CPU demo layer's wiring to the code it
calls, and the smoke checks themselves (each must be able to fail)."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common.config.load import load_config
from tests import deploy_tools as dt
from tether.demo import run as demo

COMPOSE_DIR = dt.DEPLOY / "compose"
BASE = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())
DEMO = yaml.safe_load((COMPOSE_DIR / "docker-compose.cpu-demo.yml").read_text())
TETHER = ("learner", "generator-0", "generator-1", "scorer-0", "scorer-1")
CHECKS = COMPOSE_DIR / "smoke_checks.py"


def test_every_container_is_non_root_read_only_without_capabilities():
    services = {**BASE["services"], "prepare": DEMO["services"]["prepare"]}
    for name, svc in services.items():
        if name == "grafana":  # the upstream image's own user (472); its data dir is written
            assert svc["cap_drop"] == ["ALL"]
            continue
        assert svc.get("read_only") is True, name
        assert svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"], name
        assert str(svc["user"]).split(":")[0] not in ("0", "root"), name
    for name in (*TETHER, "prepare"):
        svc = services[name]
        assert svc["user"] == "10001:10001", name
        assert svc["tmpfs"] == [
            "/tmp",
            "/var/lib/tether/cache:uid=10001,gid=10001,mode=0700,exec",
            "/var/lib/tether/home:uid=10001,gid=10001,mode=0700",  # $HOME
        ], name


def test_cpu_demo_layer_mounts_its_config_and_the_models_volume():
    for name in TETHER:
        svc = DEMO["services"][name]
        assert "./cpu-demo.toml:/etc/tether/tether.toml:ro" in svc["volumes"], name
        assert "models:/models:ro" in svc["volumes"], name
        assert svc["depends_on"]["prepare"]["condition"] == "service_completed_successfully"
    assert "models:/models" in DEMO["services"]["prepare"]["volumes"]  # the only writer


def test_cpu_demo_prepare_calls_the_demo_asset_builder(tmp_path):
    """The `prepare` service runs a Python snippet against tether.demo: it must still compile and
    name a function that takes (root, preset=, seed=) with a known preset, and its outputs must be
    what cpu-demo.toml points at."""
    snippet = DEMO["services"]["prepare"]["entrypoint"][2]
    compile(snippet, "prepare", "exec")
    assert "from tether.demo.run import prepare_assets" in snippet
    params = inspect.signature(demo.prepare_assets).parameters
    assert {"root", "preset", "seed"} <= set(params)
    assert 'preset="demo"' in snippet and "demo" in demo.PRESETS
    cfg = load_config(config_file=str(COMPOSE_DIR / "cpu-demo.toml"), overrides=[], flags={}).config
    assets = Path("/models/demo")
    assert cfg.run.model == str(assets / "model")
    assert cfg.data.train_path == str(assets / "data" / "train.jsonl")
    assert cfg.data.eval_path == str(assets / "data" / "eval.jsonl")


def test_smoke_script_parses():
    res = subprocess.run(
        ["bash", "-n", str(COMPOSE_DIR / "smoke.sh")], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr


def _checks(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECKS), *args], capture_output=True, text=True, cwd=dt.ROOT
    )


def _status(**acc) -> dict:
    counts = {"trained_samples": 5120, "dropped_stale_samples": 0, "filtered_samples": 0}
    counts.update(acc.pop("books", {}))
    books = {"generated": 5120, "trained": 5120, "dropped_stale": 0, "filtered": 0,
             "dead_lettered": 0, "in_flight": 0, "unaccounted": 0}  # fmt: skip
    books.update(acc)
    return {
        "run": "demo",
        "source": "live",
        "learner_version": 80,
        "services": [{"service": "learner", "id": "learner-0", "books": counts}],
        "streams": {"prompts": {"lag": 0, "pending": 0}},
        "dead_letters": 0,
        "generator_versions": {},
        "accounting_trajectories": books,
    }


def _metrics(steps) -> str:
    return "\n".join(
        json.dumps({"kind": "step", "step": s, "batch_digest": f"d{s}"}) for s in steps
    )


def test_smoke_accounting_check_passes_a_balanced_run_and_fails_an_unbalanced_one(tmp_path):
    status, metrics = tmp_path / "status.json", tmp_path / "metrics.jsonl"
    metrics.write_text(_metrics(range(1, 81)))
    status.write_text(json.dumps(_status()))
    assert _checks("accounting", str(status), str(metrics)).returncode == 0
    status.write_text(json.dumps(_status(unaccounted=8)))
    assert _checks("accounting", str(status), str(metrics)).returncode == 1
    status.write_text(json.dumps(_status(books={"trained_samples": 5112})))
    assert _checks("accounting", str(status), str(metrics)).returncode == 1
    status.write_text(json.dumps(_status()))
    metrics.write_text(_metrics([*range(1, 81), 40]))  # a step trained twice
    assert _checks("accounting", str(status), str(metrics)).returncode == 1


def test_smoke_targets_check_fails_on_a_down_or_missing_job(tmp_path):
    jobs = ["tether-learner", "tether-generator", "tether-scorer", "redis", "prometheus"]
    targets = [{"labels": {"job": j, "instance": f"{j}:1"}, "health": "up"} for j in jobs]
    path = tmp_path / "targets.json"
    path.write_text(json.dumps({"data": {"activeTargets": targets}}))
    assert _checks("targets", str(path)).returncode == 0
    targets[1]["health"] = "down"
    path.write_text(json.dumps({"data": {"activeTargets": targets}}))
    assert _checks("targets", str(path)).returncode == 1
    path.write_text(json.dumps({"data": {"activeTargets": targets[2:]}}))
    assert _checks("targets", str(path)).returncode == 1


def test_smoke_names_check_fails_when_a_dashboard_metric_is_absent(tmp_path):

    pytest.importorskip("promql_parser", reason="pip install promql-parser (the dev extra)")

    def example(regex: str) -> str:  # one name a simple selector regex matches: `(a|b)_x.*` -> a_xx
        name = re.sub(r"\(([^|()]*)(\|[^()]*)?\)", r"\1", regex)
        return name.replace(".*", "x").replace(".+", "x").replace("\\", "")

    names: set[str] = set()
    for d in dt.DASHBOARDS:
        for _, expr in dt.dashboard_expressions(d):
            plain, regexes = dt.selectors(expr)
            names |= plain | {example(r) for r in regexes}
    path = tmp_path / "names.json"
    path.write_text(json.dumps({"data": sorted(names)}))
    res = _checks("names", str(path))
    assert res.returncode == 0, res.stdout
    # the GPU exporter's series are absent from the CPU stack: listed as not checked
    gpu = {n for n in names if n.startswith("DCGM_")}
    assert gpu, "the operations dashboard's GPU panels"
    path.write_text(json.dumps({"data": sorted(names - gpu)}))
    res = _checks("names", str(path))
    assert res.returncode == 0 and res.stdout.count("  skip DCGM_") == len(gpu), res.stdout
    # any of Tether's own missing fails
    for missing in sorted(n for n in names if n.startswith("tether_"))[:3]:
        path.write_text(json.dumps({"data": sorted(names - {missing})}))
        assert _checks("names", str(path)).returncode == 1, missing
