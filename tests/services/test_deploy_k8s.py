"""deploy/k8s checked offline — no cluster runs here: every manifest and the output of
``kubectl kustomize`` (the base, changed parameters, and the base with each opt-in component)
against the Kubernetes schemas (``kubernetes-validate --strict``) or, for custom resources, the
CRD schemas of their projects (tests/fixtures/crds), the "restricted" Pod Security rules on every
pod, and what each manifest must say: Jobs that finish when the run does, failure policies on the
services' own exit codes, the Redis ACL script of compose, the network flows, the staging Job and
what each component changes.

Tools: PyPI `kubernetes-validate`, `jsonschema`; `kubectl`. A test skips only when its tool is
not installed."""

from __future__ import annotations

import pytest
import yaml

from common.service.exit_codes import EXIT_REFUSED, EXIT_STOPPED
from tests import deploy_tools as dt

TETHER_CONTAINERS = {"learner", "generator", "scorer"}
COMPONENTS = ("disruption", "gpu-gke", "gpu-eks", "gpu-operator", "kueue", "scorer-egress",
              "prometheus-operator")  # fmt: skip
BUILTIN_GROUPS = ("v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1",
                  "scheduling.k8s.io/v1")  # fmt: skip


def _doc(kind: str, name: str, docs=None) -> dict:
    docs = dt.k8s_docs() if docs is None else [("", d) for d in docs]
    (doc,) = [d for _, d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _flag(args: list[str], flag: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    return value


def _validate(tmp_path, text: str, docs: list[dict]) -> None:
    """Built-in kinds: kubernetes-validate --strict; custom resources: their CRD schemas."""
    builtin = [d for d in docs if d["apiVersion"] in BUILTIN_GROUPS]
    custom = [d for d in docs if d["apiVersion"] not in BUILTIN_GROUPS]
    path = tmp_path / "builtin.yaml"
    path.write_text(yaml.safe_dump_all(builtin))
    exe = dt.tool("kubernetes-validate")
    res = dt.run_tool([exe, "--strict", "--quiet", "-k", dt.K8S_VERSION, str(path)])
    assert res.returncode == 0, res.stdout + res.stderr
    problems = {d["kind"]: dt.custom_resource_problems(d) for d in custom}
    assert not any(problems.values()), problems
    for doc in docs:
        if doc["kind"] in ("StatefulSet", "Job"):
            assert dt.restricted_violations(doc["spec"]["template"]["spec"]) == [], doc["metadata"]


# ------------------------------------------------------------------------------ the base


def test_every_manifest_validates_and_kustomization_lists_them():
    exe = dt.tool("kubernetes-validate")
    files = [str(p) for p in sorted(dt.K8S.glob("*.yaml")) if p.name != "kustomization.yaml"]
    res = dt.run_tool([exe, "--strict", "--quiet", "-k", dt.K8S_VERSION, *files])
    assert res.returncode == 0, res.stdout + res.stderr
    kust = yaml.safe_load((dt.K8S / "kustomization.yaml").read_text())
    assert set(kust["resources"]) == {p.name for p in dt.K8S.glob("*.yaml")} - {
        "kustomization.yaml"
    }


def test_pods_are_restricted_probed_and_scraped():
    kinds: dict[str, list[str]] = {}
    for _fname, doc in dt.k8s_docs():
        kinds.setdefault(doc["kind"], []).append(doc["metadata"]["name"])
    for fname, doc, pod in dt.pod_templates():
        assert dt.restricted_violations(pod["spec"]) == [], fname
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True, fname
        if doc["metadata"]["name"] != "tether-staging":
            assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true", fname
        for c in pod["spec"]["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, (fname, c["name"])
            if c["name"] in TETHER_CONTAINERS:
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    # an HTTP probe of the service's own heartbeat, on every pod
                    assert c[probe]["httpGet"]["path"] in ("/healthz", "/readyz"), (fname, probe)
            if c["name"] in ("learner", "generator"):
                assert "nvidia.com/gpu" in c["resources"]["limits"], (fname, c["name"])
    assert kinds["StatefulSet"] == ["tether-redis"]
    assert sorted(kinds["Job"]) == [
        "tether-generator", "tether-learner", "tether-scorer", "tether-staging"
    ]  # fmt: skip
    assert "Deployment" not in kinds


def test_learner_is_an_indexed_job_that_stays_finished_and_stops_in_its_grace_period():
    job = _doc("Job", "tether-learner")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]  # one pod per node, all at once
    assert pod["restartPolicy"] == "Never"  # a finished rank is not restarted in place
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onExitCodes": {"containerName": "learner", "operator": "In",
            "values": [EXIT_REFUSED]}} in rules  # fmt: skip
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
    host = f"{job['metadata']['name']}-0.{pod['subdomain']}.tether.svc.cluster.local"
    assert _flag(c["args"], "--master_addr") == host == env["TETHER_WEIGHTS__HOST"]["value"]
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"  # one learner pod per node


@pytest.mark.parametrize("kind", ["generator", "scorer"])
def test_generators_and_scorers_are_jobs_that_end_with_the_run(kind):
    """Item 1 on Kubernetes: when the learner finishes, each exits 0 by itself (run_end), its
    index completes, the Job completes, its GPU is released. A stop before the end (75) or a
    disruption is replaced; a refused configuration fails the Job; one id per pod."""
    job = _doc("Job", f"tether-{kind}")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert pod["restartPolicy"] == "Never" and spec["podReplacementPolicy"] == "Failed"
    assert spec["backoffLimitPerIndex"] >= 1  # a crash-looping replica fails alone
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onExitCodes": {"containerName": kind, "operator": "In",
            "values": [EXIT_REFUSED]}} in rules  # fmt: skip
    assert {"action": "Ignore", "onExitCodes": {"containerName": kind, "operator": "In",
            "values": [EXIT_STOPPED]}} in rules  # fmt: skip
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules
    (c,) = pod["containers"]
    assert c["args"][-2:] == ["--id", f"tether-{kind}-$(JOB_COMPLETION_INDEX)"]  # stable ids
    env = {e["name"]: e for e in c["env"]}
    assert env["TETHER_RUN__REDIS_URL"]["value"].startswith(f"redis://tether-{kind}:")
    assert env[f"REDIS_{kind.upper()}_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == kind
    if kind == "generator":
        assert env["TETHER_WEIGHTS_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "tether-weights"


def test_gpu_pods_tolerate_gpu_taints_and_wait_for_the_staged_model():
    for name in ("tether-learner", "tether-generator"):
        pod = _doc("Job", name)["spec"]["template"]["spec"]
        assert "nodeSelector" not in pod, name  # pool labels differ: components/gpu-*
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
        (init,) = pod["initContainers"]
        assert init["command"][:4] == ["python3", "-m", "common.data.staging", "wait"], name
        assert "$(MODEL_ID)" in init["command"]
    learner_init = _doc("Job", "tether-learner")["spec"]["template"]["spec"]["initContainers"][0]
    assert "$(DATA_SOURCE)" in learner_init["command"]


def test_the_staging_job_stages_model_and_data_with_the_hub_token_from_a_secret():
    job = _doc("Job", "tether-staging")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"][:4] == ["python3", "-m", "common.data.staging", "stage"]
    env = {e["name"]: e for e in c["env"]}
    token = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token == {"name": "tether-hf", "key": "token", "optional": True}
    assert {"action": "FailJob", "onExitCodes": {"containerName": "stage", "operator": "In",
            "values": [2]}} in job["spec"]["podFailurePolicy"]["rules"]  # fmt: skip
    assert job["spec"]["ttlSecondsAfterFinished"] <= 3600  # a changed modelId can be applied
    import tomllib

    cm = tomllib.loads(_doc("ConfigMap", "tether-config")["data"]["tether.toml"])
    assert cm["data"]["train_path"].startswith("/models/data/")


def test_redis_runs_composes_acl_script_and_the_exporter_its_user():
    sts = _doc("StatefulSet", "tether-redis")
    redis, exporter = sts["spec"]["template"]["spec"]["containers"]
    assert redis["command"][:2] == ["sh", "-c"]
    # Kubernetes reduces $$ to $, as compose does: the shell runs the very same script
    assert redis["command"][2].replace("$$", "$") == dt.compose_redis_script()
    env = {e["name"]: e for e in redis["env"]}
    for kind in ("learner", "generator", "scorer", "exporter"):
        assert env[f"REDIS_{kind.upper()}_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == kind
    exporter_env = {e["name"]: e for e in exporter["env"]}
    assert exporter_env["REDIS_USER"]["value"] == "tether-exporter"


def test_parameters_reach_the_manifests(tmp_path):
    text, docs = dt.render_kustomize(tmp_path, params={
        "storageClassName": "efs-test", "modelId": "org/test-model", "modelRevision": "v2",
        "dataSource": "hf://datasets/org/math", "generatorReplicas": "5", "scorerReplicas": "3",
    })  # fmt: skip
    claims = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert len(claims) == 2 and all(c["spec"]["storageClassName"] == "efs-test" for c in claims)

    def env(doc, container):
        return {e["name"]: e.get("value") for e in container["env"]}

    staging = _doc("Job", "tether-staging", docs)["spec"]["template"]["spec"]["containers"][0]
    assert env(None, staging)["MODEL_ID"] == "org/test-model"
    assert env(None, staging)["DATA_SOURCE"] == "hf://datasets/org/math"
    for name in ("tether-learner", "tether-generator"):
        init = _doc("Job", name, docs)["spec"]["template"]["spec"]["initContainers"][0]
        assert env(None, init)["MODEL_ID"] == "org/test-model", name
        assert env(None, init)["MODEL_REVISION"] == "v2", name
    gen, sco = _doc("Job", "tether-generator", docs), _doc("Job", "tether-scorer", docs)
    assert gen["spec"]["completions"] == gen["spec"]["parallelism"] == 5
    assert sco["spec"]["completions"] == sco["spec"]["parallelism"] == 3
    learner = _doc("Job", "tether-learner", docs)["spec"]["template"]["spec"]["containers"][0]
    assert env(None, learner)["TETHER_GENERATOR__REPLICAS"] == "5"  # the alert's expectation
    assert not [d for d in docs if d["metadata"]["name"] == "tether-params"]  # local-config
    _validate(tmp_path, text, docs)


def test_the_network_is_default_deny_with_tethers_flows_allowed():
    policies = {d["metadata"]["name"]: d["spec"] for _, d in dt.k8s_docs()
                if d["kind"] == "NetworkPolicy"}  # fmt: skip
    deny = policies["tether-default-deny"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    assert policies["tether-dns"]["egress"][0]["ports"] == [
        {"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}
    ]  # fmt: skip
    redis = policies["tether-redis"]
    to_6379 = [r for r in redis["ingress"] if any(p["port"] == 6379 for p in r["ports"])]
    (peer,) = to_6379[0]["from"]
    assert set(peer) == {"podSelector"}, "Redis must admit pods, not namespaces or IP blocks"
    exprs = {e["key"]: e["values"] for e in peer["podSelector"]["matchExpressions"]}
    assert exprs["app.kubernetes.io/component"] == ["learner", "generator", "scorer"]
    # services reach Redis; only learner and generators reach each other (the weights)
    (to_redis,) = policies["tether-services-egress"]["egress"]
    assert to_redis["ports"] == [{"port": 6379, "protocol": "TCP"}]
    weights = policies["tether-weights-egress"]
    kinds = {e["key"]: e["values"] for e in weights["podSelector"]["matchExpressions"]}
    assert kinds["app.kubernetes.io/component"] == ["learner", "generator"]  # not the scorers
    # nothing but the staging Job leaves the cluster, and never to the metadata endpoint
    out = [n for n, p in policies.items()
           if any("ipBlock" in t for r in p.get("egress", []) for t in r["to"])]  # fmt: skip
    assert out == ["tether-staging-egress"]
    (rule,) = policies["tether-staging-egress"]["egress"]
    assert rule["to"][0]["ipBlock"]["except"] == ["169.254.0.0/16"]


# ------------------------------------------------------------------------------ components


@pytest.mark.parametrize("component", COMPONENTS)
def test_each_component_renders_valid_restricted_manifests(tmp_path, component):
    text, docs = dt.render_kustomize(tmp_path, components=(component,))
    _validate(tmp_path, text, docs)
    base = {(d["kind"], d["metadata"]["name"]) for d in dt.render_kustomize(tmp_path)[1]}
    added = {(d["kind"], d["metadata"]["name"]) for d in docs} - base
    learner = _doc("Job", "tether-learner", docs)["spec"]["template"]
    generator = _doc("Job", "tether-generator", docs)["spec"]["template"]
    if component == "disruption":
        assert learner["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
        assert (
            learner["metadata"]["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"]
            == "false"
        )
        assert learner["spec"]["priorityClassName"] == "tether-learner"
        assert generator["spec"]["priorityClassName"] == "tether-rollout"
        budget = _doc("PodDisruptionBudget", "tether-learner", docs)
        assert (
            budget["spec"]["minAvailable"]
            == _doc("Job", "tether-learner", docs)["spec"]["parallelism"]
        )  # every learner pod
        assert {k for k, _ in added} == {"PodDisruptionBudget", "PriorityClass"}
        assert all("namespace" not in d["metadata"] for d in docs if d["kind"] == "PriorityClass")
    elif component.startswith("gpu-"):
        for tpl in (learner, generator):
            spec = tpl["spec"]
            if component == "gpu-operator":
                assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            else:
                terms = spec["affinity"]["nodeAffinity"][
                    "requiredDuringSchedulingIgnoredDuringExecution"
                ]
                keys = {e["key"] for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]}
                want = {"gpu-gke": {"cloud.google.com/gke-accelerator"},
                        "gpu-eks": {"node.kubernetes.io/instance-type",
                                    "karpenter.k8s.aws/instance-gpu-manufacturer"}}[component]  # fmt: skip
                assert keys == want
            assert "podAntiAffinity" in spec["affinity"]  # kept beside the node affinity
    elif component == "kueue":
        for name in ("tether-learner", "tether-generator", "tether-scorer"):
            job = _doc("Job", name, docs)
            assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "tether"
            assert job["spec"]["suspend"] is True  # Kueue admits (unsuspends) the whole Job
        assert added == {("LocalQueue", "tether")}
    elif component == "scorer-egress":
        assert added == {("NetworkPolicy", "tether-scorer-egress")}
    elif component == "prometheus-operator":
        assert added == {("PodMonitor", "tether"), ("ServiceMonitor", "tether-redis"),
                         ("PrometheusRule", "tether")}  # fmt: skip


def test_the_prometheusrule_is_rules_yml():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "prometheusrule", dt.DEPLOY / "prometheus" / "prometheusrule.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = dt.K8S / "components" / "prometheus-operator" / "prometheusrule.yaml"
    assert committed.read_text() == module.render(dt.RULES.read_text()), (
        "regenerate: python deploy/prometheus/prometheusrule.py > " + str(committed)
    )


def test_a_crd_schema_check_can_fail():
    """The offline check of custom resources refuses what the Operator's API server would."""
    bad = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
           "metadata": {"name": "x"},
           "spec": {"podMetricsEndpoints": [{"port": "metrics", "intervall": "15s"}],
                    "selector": {"matchLabels": {"a": 1}}}}  # fmt: skip
    problems = dt.custom_resource_problems(bad)
    assert any("intervall: unknown field" in p for p in problems), problems
    assert any("is not of type 'string'" in p for p in problems), problems
