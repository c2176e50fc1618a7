"""Helpers for tests/services/test_deploy.py and test_deploy_prometheus.py: find the offline
tools, collect PromQL from the rules and dashboards, match metric names against what the services
export, run real subprocesses."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "rules.yml"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))

# Suffixes a client library adds to a metric family's name in /metrics samples.
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")
# Grafana's interval variables, replaced by a fixed range so the expression parses.
_GRAFANA_VARS = re.compile(
    r"\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|__interval|__range)\}"
)


def tool(name: str, *, apt: str | None = None) -> str:
    """Path of a command-line tool: the venv's bin first (PyPI tools), then PATH. Skips the test
    with the install instruction when it is genuinely not installed."""
    venv_bin = Path(sys.executable).parent / name
    if venv_bin.exists():
        return str(venv_bin)
    found = shutil.which(name)
    if found:
        return found
    how = f"apt-get install -y {apt}" if apt else f"pip install {name} (the dev extra)"
    pytest.skip(f"{name} is not installed: {how}")


def run_tool(argv: list[str], *, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)


# ------------------------------------------------------------------------------ PromQL


def rule_expressions(path: Path = RULES) -> list[tuple[str, str]]:
    """(where, expr) of every recording and alerting rule."""
    doc = yaml.safe_load(path.read_text())
    out = []
    for group in doc["groups"]:
        for rule in group["rules"]:
            name = rule.get("record") or rule.get("alert")
            out.append((f"{path.name}: {group['name']}/{name}", str(rule["expr"])))
    return out


def recorded_names(path: Path = RULES) -> set[str]:
    doc = yaml.safe_load(path.read_text())
    return {r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r}


def _panels(panels: list[dict]) -> Iterator[dict]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def dashboard_expressions(path: Path) -> list[tuple[str, str]]:
    """(where, expr) of every Prometheus target in a Grafana dashboard, with Grafana's interval
    variables replaced by 5m."""
    doc = json.loads(path.read_text())
    out = []
    for panel in _panels(doc.get("panels", [])):
        for t in panel.get("targets", []):
            if t.get("expr"):
                expr = _GRAFANA_VARS.sub("5m", t["expr"])
                out.append((f"{path.name}: {panel.get('title')!r} {t.get('refId')}", expr))
    return out


def all_expressions() -> list[tuple[str, str]]:
    exprs = rule_expressions()
    for d in DASHBOARDS:
        exprs += dashboard_expressions(d)
    return exprs


def selectors(expr: str) -> tuple[set[str], set[str]]:
    """Metric names an expression selects: (plain names, ``__name__`` regexes). Raises
    ValueError when the expression does not parse."""
    import promql_parser

    names: set[str] = set()
    regexes: set[str] = set()

    def visit(node) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for m in node.matchers.matchers:
                if m.name == "__name__" and m.op == promql_parser.MatchOp.Re:
                    regexes.add(m.value)
                elif m.name == "__name__" and m.op == promql_parser.MatchOp.Equal:
                    names.add(m.value)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names, regexes


def family(name: str) -> str:
    """The family name behind a sample or family name: tether_x_seconds_bucket -> tether_x_seconds."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def is_exported(name: str, exported: set[str]) -> bool:
    families = {family(n) for n in exported} | exported
    return name in exported or family(name) in families


# ------------------------------------------------------------------------------ processes


def wait_http(url: str, *, timeout_s: float, proc: subprocess.Popen | None = None) -> bytes:
    """GET ``url`` until it answers 200; fails early when ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"process exited with code {proc.returncode} before {url} answered"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.read()
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer within {timeout_s} s: {last}")


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL a process this test started, and reap it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
