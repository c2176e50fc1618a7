"""deploy/compose and deploy/k8s checked with real offline tools (check-jsonschema against the
compose spec, kubernetes-validate --strict, kubectl kustomize): restricted pods, probes, grace
periods, placement, storage, network policy, and every path the code writes being a mount on a
read-only root. (Prometheus, the rules and the dashboards: test_deploy_prometheus.py.)

Tools: PyPI `check-jsonschema kubernetes-validate` (dev extra); `kubectl`. A test skips only
when its tool is not installed."""

from __future__ import annotations

import re

import pytest
import yaml

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


def _pod_templates() -> list[tuple[str, dict, dict]]:
    """(file, workload, pod template) of every workload."""
    return [
        (fname, doc, doc["spec"]["template"])
        for fname, doc in _k8s_docs()
        if doc["kind"] in ("StatefulSet", "Deployment", "Job")
    ]


def _restricted_violations(pod_spec: dict) -> list[str]:
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


def test_k8s_pods_are_restricted_probed_and_scraped():
    kinds: dict[str, list[str]] = {}
    for _fname, doc in _k8s_docs():
        kinds.setdefault(doc["kind"], []).append(doc["metadata"]["name"])
    for fname, doc, pod in _pod_templates():
        assert _restricted_violations(pod["spec"]) == [], fname
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True, fname
        if doc["metadata"]["name"] != "tether-model-staging":
            assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true", fname
        for c in pod["spec"]["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, (fname, c["name"])
            if c["name"] in TETHER_CONTAINERS:
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    # an HTTP probe of the service's own heartbeat, on every pod (no exec probe
                    # that passes on ranks other than 0)
                    assert c[probe]["httpGet"]["path"] in ("/healthz", "/readyz"), (fname, probe)
            if c["name"] in ("learner", "generator"):
                assert "nvidia.com/gpu" in c["resources"]["limits"], (fname, c["name"])
    assert kinds["StatefulSet"] == ["tether-generator", "tether-redis", "tether-scorer"]
    assert kinds["Job"] == ["tether-learner", "tether-model-staging"]
    assert "Deployment" not in kinds
    assert "Namespace" in kinds and "ConfigMap" in kinds and "NetworkPolicy" in kinds


def _doc(kind: str, name: str) -> dict:
    (doc,) = [d for _, d in _k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _flag(args: list[str], flag: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    return value


def test_learner_is_an_indexed_job_that_stays_finished_and_stops_in_its_grace_period():
    job = _doc("Job", "tether-learner")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]  # one pod per node, all at once
    assert pod["restartPolicy"] == "Never"  # a finished rank is not restarted in place
    rules = spec["podFailurePolicy"]["rules"]
    from common.service.exit_codes import EXIT_REFUSED, EXIT_STOPPED

    assert {"action": "FailJob", "onExitCodes": {"containerName": "learner", "operator": "In",
            "values": [EXIT_REFUSED]}} in rules  # fmt: skip
    # a drained pod's learner stops cleanly (75): replaced, never counted as complete
    assert {"action": "Ignore", "onExitCodes": {"containerName": "learner", "operator": "In",
            "values": [EXIT_STOPPED]}} in rules  # fmt: skip
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules
    (c,) = pod["containers"]
    assert c["command"] == ["python3", "-m", "tether.runs.graceful_torchrun"]
    assert 0 < int(_flag(c["args"], "--shutdown-timeout")) < pod["terminationGracePeriodSeconds"]
    env = {e["name"]: e for e in c["env"]}
    assert (
        "job-completion-index" in env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    )
    assert _flag(c["args"], "--node_rank") == "$(JOB_COMPLETION_INDEX)"
    # index 0's DNS name (Job hostname + subdomain) is the rendezvous and the weight store
    host = f"{job['metadata']['name']}-0.{pod['subdomain']}.tether.svc.cluster.local"
    assert _flag(c["args"], "--master_addr") == host == env["TETHER_WEIGHTS__HOST"]["value"]
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"  # one learner pod per node


def test_compose_learner_stops_within_its_grace_period():
    doc = yaml.safe_load(COMPOSE.read_text())
    learner = doc["services"]["learner"]
    entry = learner["entrypoint"]
    assert entry[:3] == ["python3", "-m", "tether.runs.graceful_torchrun"]
    grace = int(str(learner.get("stop_grace_period", doc["x-tether"]["stop_grace_period"]))[:-1])
    assert 0 < int(_flag(entry, "--shutdown-timeout")) < grace


def test_gpu_pods_are_placed_and_wait_for_the_model():
    for kind, name in (("Job", "tether-learner"), ("StatefulSet", "tether-generator")):
        pod = _doc(kind, name)["spec"]["template"]["spec"]
        assert pod["nodeSelector"], name
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"]), name
        assert "podAntiAffinity" in pod["affinity"], name
        (init,) = pod["initContainers"]
        assert "/models/policy/config.json" in " ".join(init["command"]), name
    staging = _doc("Job", "tether-model-staging")["spec"]["template"]["spec"]
    assert "os.rename(tmp, dst)" in staging["containers"][0]["command"][-1]  # config.json last


def test_scorers_have_stable_ids():
    sts = _doc("StatefulSet", "tether-scorer")
    assert sts["spec"]["serviceName"] == "tether-scorer"
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert c["args"][-2:] == ["--id", "$(POD_NAME)"]


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
    for fname, _, pod in _pod_templates():
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


def test_kustomize_parameters_reach_the_manifests(tmp_path):
    import shutil

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (its `kustomize` renders deploy/k8s)")
    base = tmp_path / "k8s"
    shutil.copytree(K8S, base)
    params = base / "params.yaml"
    text = params.read_text()
    params.write_text(
        text.replace("storageClassName: nfs-rwx", "storageClassName: efs-test").replace(
            "modelId: Qwen/Qwen2.5-1.5B-Instruct", "modelId: org/test-model"
        )
    )
    res = dt.run_tool([kubectl, "kustomize", str(base)])
    assert res.returncode == 0, res.stderr
    docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    claims = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert len(claims) == 2 and all(c["spec"]["storageClassName"] == "efs-test" for c in claims)
    (staging,) = [d for d in docs if d["metadata"]["name"] == "tether-model-staging"]
    env = {
        e["name"]: e["value"] for e in staging["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["MODEL_ID"] == "org/test-model"
    assert not [d for d in docs if d["metadata"]["name"] == "tether-params"]  # local-config
    exe = dt.tool("kubernetes-validate")
    (tmp_path / "rendered.yaml").write_text(res.stdout)
    res = dt.run_tool(
        [exe, "--strict", "--quiet", "-k", K8S_VERSION, str(tmp_path / "rendered.yaml")]
    )
    assert res.returncode == 0, res.stdout + res.stderr


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
