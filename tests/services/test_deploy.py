"""deploy/compose checked with real offline tools (check-jsonschema against the compose spec):
services, restarts, users and secrets, grace periods, and every path the code writes being a
mount on a read-only root (compose and Kubernetes). (Kubernetes: test_deploy_k8s.py; Prometheus,
the rules and the dashboards: test_deploy_prometheus.py.)

Tools: PyPI `check-jsonschema kubernetes-validate` (dev extra); `kubectl`. A test skips only
when its tool is not installed."""

from __future__ import annotations

import re

import pytest
import yaml

from common.config.load import load_config
from tests import deploy_tools as dt

COMPOSE = dt.DEPLOY / "compose" / "docker-compose.yml"
# The layers added to docker-compose.yml through COMPOSE_FILE (GPU nodes, the CPU demo, the smoke test).
COMPOSE_LAYERS = sorted((dt.DEPLOY / "compose").glob("docker-compose.*.yml"))
ENV_EXAMPLE = dt.DEPLOY / "compose" / ".env.example"
K8S = dt.K8S  # deploy/k8s/base
K8S_VERSION = "1.35.0"  # a current release whose schemas kubernetes-validate bundles
TETHER_CONTAINERS = {"learner", "generator", "scorer"}


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
    used = {"COMPOSE_PROJECT_NAME", "COMPOSE_FILE", "COMPOSE_PROFILES"}
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


def test_compose_services_wait_for_a_healthy_redis_with_aof_and_acl_users():
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    script = dt.compose_redis_script()
    assert "--appendonly yes" in script and "--appendfsync everysec" in script
    assert "--user default reset on" in script and "healthcheck" in services["redis"]
    assert "--requirepass" not in script  # the default user's password comes with its ACL rule
    tether = [n for n in services if n == "learner" or n.startswith(("generator", "scorer"))]
    assert {"learner", "generator-0", "generator-1", "scorer-0", "scorer-1"} <= set(tether)
    for name in tether:
        svc = services[name]
        kind = name.split("-")[0]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy", name
        # the keeper is the restart policy; Docker's would restart a refused service (exit 2)
        assert svc["restart"] == "no", name
        assert svc["entrypoint"][:3] == ["python3", "-m", "common.service.keeper"], name
        assert "--health-url=http://127.0.0.1:9400/healthz" in svc["entrypoint"], name
        url = svc["environment"]["TETHER_RUN__REDIS_URL"]
        assert url.startswith(f"redis://tether-{kind}:${{REDIS_{kind.upper()}_PASSWORD"), name
        assert svc["environment"]["TETHER_WEIGHTS_SECRET"].startswith("${TETHER_WEIGHTS_SECRET:?")
    exporter = services["redis-exporter"]["environment"]
    assert exporter["REDIS_USER"] == "tether-exporter"
    assert "REDIS_EXPORTER_PASSWORD" in exporter["REDIS_PASSWORD"]
    gpu = yaml.safe_load((dt.DEPLOY / "compose" / "docker-compose.gpu.yml").read_text())
    for name in ("learner", "generator-0", "generator-1"):
        devices = gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"], name


def test_compose_replica_ids_are_fixed_per_service():
    """A recreated container keeps its replica id (its pending work is its own at once)."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, svc in services.items():
        if name.startswith(("generator-", "scorer-")):
            assert svc["command"][-2:] == ["--id", name], name
            assert "deploy" not in svc or "replicas" not in svc["deploy"], name  # no --scale


@pytest.mark.parametrize(
    "toml_text",
    [
        (dt.DEPLOY / "compose" / "tether.toml").read_text(),
        yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]["tether.toml"],
    ],
    ids=["compose", "k8s-configmap"],
)
def test_deployed_tether_config_loads(toml_text, tmp_path):
    path = tmp_path / "tether.toml"
    path.write_text(toml_text)
    cfg = load_config(config_file=str(path), overrides=[], flags={}).config
    assert cfg.run.model == "/models/policy" and cfg.weights.port == 29600


def _image_write_paths() -> dict[str, str]:
    """The Dockerfile's ENV variables that name a directory the code writes to."""
    text = (dt.DEPLOY / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    env = dict(re.findall(r"\b([A-Z_]+)=(/var/lib/tether\S*|/tmp\S*)", text))
    assert {"HOME", "XDG_CACHE_HOME", "HF_HOME", "TETHER_RUN__RUN_DIR"} <= set(env), env
    return env


def _under(path: str, mounts: list[str]) -> bool:
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)


def test_every_path_the_code_writes_is_a_mount_on_a_read_only_root():
    paths = _image_write_paths()
    for fname, _, pod in dt.pod_templates():
        for c in pod["spec"]["containers"]:
            if c["name"] not in TETHER_CONTAINERS:
                continue
            mounts = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")]
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert env.get("HOME", paths["HOME"]) == paths["HOME"], (fname, c["name"])
            # only the learner writes the run directory (checkpoints, metrics, trackers)
            skip = set() if c["name"] == "learner" else {"TETHER_RUN__RUN_DIR"}
            bad = {k: v for k, v in paths.items() if k not in skip and not _under(v, mounts)}
            assert not bad, f"{fname}/{c['name']}: written but not mounted: {bad}"
    doc = yaml.safe_load(COMPOSE.read_text())
    anchor = doc["x-tether"]
    mounts = [t.split(":")[0] for t in anchor["tmpfs"]]
    mounts += [v.split(":")[1] for v in anchor["volumes"] if not v.endswith(":ro")]
    bad = {k: v for k, v in paths.items() if not _under(v, mounts)}
    assert anchor["read_only"] is True and not bad, f"compose: written but not mounted: {bad}"
