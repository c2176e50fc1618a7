"""Helpers for tests/services/test_deploy.py and test_deploy_prometheus.py: find the offline
tools, collect PromQL from the rules and dashboards, match metric names against what the services
export, run real subprocesses."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import redis
import yaml

from common.bus import acl
from common.ports import free_port

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


# ------------------------------------------------------------------------------ Redis ACL users


def compose_redis_script() -> str:
    """The shell script deploy/compose's Redis runs (users, ACL rules, persistence), with
    compose's ``$$`` escapes resolved: what ``sh -c`` executes in the container."""
    doc = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    command = doc["services"]["redis"]["command"]
    assert command[:2] == ["sh", "-c"], command
    return command[2].replace("$$", "$")


def acl_rules_in(script: str) -> dict[str, list[str]]:
    """The ``<kind>='<rules>'`` assignments of a Redis start script."""
    return {k: v.split() for k, v in re.findall(r"^\s*(\w+)='([^']*)'$", script, re.M)}


def start_redis_with_users(script: str, data_dir: Path, *, port: int, env: dict[str, str],
                           bind: str = "127.0.0.1", wrap: Callable[[list[str]], list[str]] = list,
                           extra: Sequence[str] = ()):  # fmt: skip
    """Run a deploy Redis start script with the machine's redis-server (Debian's 7.0 in CI) on
    ``bind``:``port``, its data in ``data_dir`` (the script's ``--dir /data`` pointed there);
    ``wrap`` makes the command line run elsewhere (an emulated host: ``Hosts.argv``); ``extra``:
    more of redis-server's options (``--replicaof``...)."""
    text = script.replace("--dir /data", f"--dir {data_dir}")
    args = ["sh", "-c", text, "redis-server", "--port", str(port), "--bind", bind,
            "--appendonly", "no", "--save", "", "--logfile", str(data_dir / "redis.log"),
            *extra]  # fmt: skip
    return subprocess.Popen(
        wrap(args), env={**os.environ, **env}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip


REQUIRE = os.environ.get("TETHER_TEST_REQUIRE_REDIS7") == "1"
PASSWORD_ENV = {"default": "REDIS_PASSWORD"} | {k: f"REDIS_{k.upper()}_PASSWORD" for k in acl.KINDS}


def need_system_tool(tool: str, apt: str) -> str:
    """A system tool CI installs (.ci/run): skip without it, fail under TETHER_TEST_REQUIRE_REDIS7=1."""
    found = shutil.which(tool)
    if found:
        return found
    if REQUIRE:
        pytest.fail(f"TETHER_TEST_REQUIRE_REDIS7=1 but {tool} is missing: apt-get install {apt}")
    pytest.skip(f"{tool} is not installed: apt-get install {apt}")


class UsersRedis:
    """The deploy script's Redis with a random password per user."""

    def __init__(self, data_dir, *, address: str = "127.0.0.1",
                 wrap: Callable[[list[str]], list[str]] = list,
                 passwords: dict[str, str] | None = None, extra: Sequence[str] = ()) -> None:  # fmt: skip
        """On 127.0.0.1, or on an emulated host: its ``address`` and ``wrap`` (``Hosts.argv``).
        ``passwords``: the users' (a replica's are its primary's), default new ones; ``extra``:
        more of redis-server's options."""
        need_system_tool("redis-server", "redis-server")
        self.address = address
        self.port = free_port() if address == "127.0.0.1" else 6379  # a host of its own
        self.passwords = passwords or {user: secrets.token_hex(16) for user in PASSWORD_ENV}
        env = {var: self.passwords[user] for user, var in PASSWORD_ENV.items()}
        env["REDIS_MAXMEMORY"] = "256mb"
        self.proc = start_redis_with_users(
            compose_redis_script(), data_dir, port=self.port, env=env, bind=address, wrap=wrap,
            extra=extra,
        )  # fmt: skip
        self.log = data_dir / "redis.log"
        self.admin = redis.Redis(host=address, port=self.port, password=self.passwords["default"])
        deadline = time.monotonic() + 15
        while True:
            try:
                self.admin.ping()
                break
            except redis.ConnectionError:
                assert self.proc.poll() is None, self.log.read_text()[-2000:]
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        assert self.admin.info("server")["redis_version"].startswith("7."), "not Redis 7"

    def url(self, kind: str) -> str:
        return f"redis://{acl.user_name(kind)}:{self.passwords[kind]}@{self.address}:{self.port}/0"

    def client(self, kind: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(kind), driver_info=None)

    def denied(self) -> list[str]:
        """``user: command`` of every ACL LOG entry (commands refused since the last reset)."""
        out = []
        for e in self.admin.acl_log():
            out.append(f"{e['username']}: {e['object']} ({e['reason']})")
        return out

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# ------------------------------------------------------------------------------ Kubernetes

K8S_ROOT = DEPLOY / "k8s"
K8S = K8S_ROOT / "base"  # the manifests; overlays/ and components/ build on them
OVERLAYS = sorted(p.name for p in (K8S_ROOT / "overlays").iterdir() if p.is_dir())
COMPONENTS = sorted(p.name for p in (K8S_ROOT / "components").iterdir() if p.is_dir())
K8S_VERSION = "1.35.0"  # a current release whose schemas kubernetes-validate bundles
CRDS = ROOT / "tests" / "fixtures" / "crds"


def k8s_docs() -> list[tuple[str, dict]]:
    """(file, document) of every manifest of the base (deploy/k8s/base/*.yaml)."""
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def pod_templates(docs: list[tuple[str, dict]] | None = None) -> list[tuple[str, dict, dict]]:
    """(file, workload, pod template) of every workload."""
    return [
        (fname, doc, doc["spec"]["template"])
        for fname, doc in (k8s_docs() if docs is None else docs)
        if doc["kind"] in ("StatefulSet", "Deployment", "Job")
    ]


def restricted_violations(pod_spec: dict) -> list[str]:
    """The Pod Security Standard "restricted" rules (v1.35) that a pod spec breaks. Our own
    check of the published rules: no policy linter (kube-linter, kubeconform) is packaged here."""
    bad = []
    psc = pod_spec.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(key):
            bad.append(key)
    bad += [f"hostPath volume {v['name']}" for v in pod_spec.get("volumes", []) if "hostPath" in v]
    for c in pod_spec.get("initContainers", []) + pod_spec["containers"]:
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation must be false")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            bad.append(f"{name}: capabilities must drop ALL")
        if set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: adds capabilities")
        if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            bad.append(f"{name}: runAsNonRoot")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile")
        if c.get("ports") and any(p.get("hostPort") for p in c["ports"]):
            bad.append(f"{name}: hostPort")
    return bad


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if REQUIRE:
            pytest.fail("kubectl is missing (.ci/run installs it)")
        pytest.skip("kubectl is not installed (its `kustomize` renders deploy/k8s)")
    return kubectl


def render_kustomize(
    tmp: Path,
    *,
    components: tuple[str, ...] | list[str] = (),
    params: dict | None = None,
    overlay: str | None = None,
    namespace: str | None = None,
):
    """``kubectl kustomize`` of an overlay made the way a user makes one, in a copy of deploy/k8s:
    its resource is ``overlay`` (one of overlays/) or else the base; it lists ``components``, sets
    ``namespace`` and patches params.yaml's ConfigMap with ``params``, then runs the parameters'
    replacements (``transformers: [../../params]``). Returns (rendered text, documents)."""
    kubectl = _kubectl()
    root = tmp / "k8s"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(K8S_ROOT, root, symlinks=True)
    test = root / "overlays" / "_test"
    test.mkdir()
    kust: dict = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [f"../{overlay}" if overlay else "../../base"],
        "transformers": ["../../params"],
    }
    if components:
        kust["components"] = [f"../../components/{c}" for c in components]
    if namespace:
        kust["namespace"] = namespace
    if params:
        patch = {"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": {"name": "tether-params"}, "data": dict(params)}  # fmt: skip
        (test / "params.yaml").write_text(yaml.safe_dump(patch))
        kust["patches"] = [{"path": "params.yaml"}]
    (test / "kustomization.yaml").write_text(yaml.safe_dump(kust))
    res = run_tool([kubectl, "kustomize", str(test)])
    assert res.returncode == 0, res.stderr
    return res.stdout, [d for d in yaml.safe_load_all(res.stdout) if d]


def render_dir(path: Path):
    """``kubectl kustomize`` of a shipped directory (the base, an overlay), unchanged."""
    res = run_tool([_kubectl(), "kustomize", str(path)])
    assert res.returncode == 0, res.stderr
    return res.stdout, [d for d in yaml.safe_load_all(res.stdout) if d]


def custom_resource_problems(doc: dict) -> list[str]:
    """A custom resource checked against its CRD's schema (tests/fixtures/crds): the schema's
    types and required fields (jsonschema), and, like ``kubectl --validate=strict``, no field
    the schema does not declare."""
    import jsonschema

    group, version = doc["apiVersion"].split("/")
    found = [json.loads(p.read_text()) for p in CRDS.glob(f"{group}_*.json")]
    (crd,) = [c for c in found if c["kind"] == doc["kind"] and c["version"] == version] or [None]
    if crd is None:
        return [f"no schema for {doc['apiVersion']} {doc['kind']} in {CRDS}"]
    schema = crd["schema"]
    problems = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft4Validator(schema).iter_errors(doc)
    ]

    def unknown(node, sch, path):
        if isinstance(node, dict) and sch.get("type") == "object" and "properties" in sch:
            for k, v in node.items():
                if k in sch["properties"]:
                    unknown(v, sch["properties"][k], f"{path}.{k}")
                elif path and not sch.get("x-kubernetes-preserve-unknown-fields"):
                    problems.append(f"{path}.{k}: unknown field")
        elif isinstance(node, list) and "items" in sch:
            for i, v in enumerate(node):
                unknown(v, sch["items"], f"{path}[{i}]")

    unknown({k: v for k, v in doc.items() if k != "metadata"}, schema, "")
    return problems
