"""deploy/k8s as users apply it: through the shipped overlays (overlays/*), and through overlays
made like them with every component and changed parameters. Each rendering (``kubectl
kustomize``) is validated offline — built-in kinds with ``kubernetes-validate --strict``, custom
resources (JobSet, LocalQueue, PodMonitor, ServiceMonitor, PrometheusRule) against their
projects' CRD schemas (tests/fixtures/crds) — and checked for what the overlay asked: its
namespace on every namespaced object (a component's too), its parameters in the manifests (an
overlay's patch of params.yaml lands: the replacements run after it), placement, and the JobSet.

Tools: PyPI `kubernetes-validate`, `jsonschema`; `kubectl`. A test skips only when its tool is
not installed."""

from __future__ import annotations

import copy
import importlib.util
import json
import re

import pytest
import yaml

from tests import deploy_tools as dt

BUILTIN_GROUPS = ("v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1",
                  "scheduling.k8s.io/v1")  # fmt: skip
CLUSTER_SCOPED = {"Namespace", "PriorityClass"}
# Every parameter changed from its default, as an overlay would patch them.
PARAMS = {
    "storageClassName": "efs-test", "modelId": "org/test-model", "modelRevision": "v2",
    "dataSource": "hf://datasets/org/math", "stagingTimeoutSeconds": "900", "runName": "try-3",
    "learnerNodes": "3", "learnerGpusPerNode": "8", "generatorReplicas": "5",
    "scorerReplicas": "7", "learnerNodeLabel": "pool", "learnerNodeValue": "big-gpu",
    "generatorNodeLabel": "pool", "generatorNodeValue": "small-gpu",
    "scorerNodeLabel": "pool", "scorerNodeValue": "cpu",
}  # fmt: skip


def _find(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _learner(docs: list[dict]) -> tuple[dict, dict]:
    """(the learner's Job spec, or its JobSet's child Job spec; the learner workload)."""
    found = [d for d in docs if d["kind"] in ("Job", "JobSet")
             and d["metadata"]["name"] == "tether-learner"]  # fmt: skip
    (doc,) = found
    if doc["kind"] == "JobSet":
        (rjob,) = doc["spec"]["replicatedJobs"]
        return rjob["template"]["spec"], doc
    return doc["spec"], doc


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _pool(pod: dict) -> tuple[str, str]:
    node = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    expr = node["nodeSelectorTerms"][0]["matchExpressions"][0]
    return expr["key"], expr["values"][0]


def _validate(tmp_path, batches: list[list[dict]]) -> None:
    """Every rendering in one kubernetes-validate run (built-in kinds); custom resources against
    their CRD schemas; every pod template against the restricted Pod Security rules."""
    unique = {json.dumps(d, sort_keys=True): d for docs in batches for d in docs}  # each once
    builtin = [d for d in unique.values() if d["apiVersion"] in BUILTIN_GROUPS]
    path = tmp_path / "builtin.yaml"
    path.write_text(yaml.safe_dump_all(builtin))
    exe = dt.tool("kubernetes-validate")
    res = dt.run_tool([exe, "--strict", "--quiet", "-k", dt.K8S_VERSION, str(path)], timeout_s=600)
    assert res.returncode == 0, res.stdout + res.stderr
    for d in unique.values():
        if d["apiVersion"] not in BUILTIN_GROUPS:
            assert dt.custom_resource_problems(d) == [], (d["kind"], d["metadata"]["name"])
        pods = []
        if d["kind"] in ("StatefulSet", "Job"):
            pods = [d["spec"]["template"]["spec"]]
        elif d["kind"] == "JobSet":
            pods = [r["template"]["spec"]["template"]["spec"] for r in d["spec"]["replicatedJobs"]]
        for pod in pods:
            assert dt.restricted_violations(pod) == [], d["metadata"]["name"]


def _check_namespaced(docs: list[dict], namespace: str) -> None:
    """Every namespaced object — a component's PDBs, LocalQueue, monitors and policies too — is
    in the overlay's namespace; the Namespace object is that namespace."""
    for d in docs:
        if d["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in d["metadata"], d["metadata"]["name"]
        else:
            assert d["metadata"].get("namespace") == namespace, (d["kind"], d["metadata"]["name"])
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"] == [namespace]
    assert not [d for d in docs if d["metadata"]["name"] == "tether-params"]  # local-config


def _check_params(docs: list[dict], params: dict) -> None:
    """Each parameter is in every field it names (params/replacements.yaml)."""
    p = {**yaml.safe_load((dt.K8S / "params.yaml").read_text())["data"], **params}
    claims = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert len(claims) == 2 and all(c["spec"]["storageClassName"] == p["storageClassName"]
                                    for c in claims)  # fmt: skip
    staging = _find(docs, "Job", "tether-staging")["spec"]["template"]["spec"]["containers"][0]
    assert _env(staging)["MODEL_ID"] == p["modelId"]
    assert _env(staging)["MODEL_REVISION"] == p["modelRevision"]
    assert _env(staging)["DATA_SOURCE"] == p["dataSource"]
    job, _ = _learner(docs)
    lpod = job["template"]["spec"]
    gen = _find(docs, "Job", "tether-generator")
    sco = _find(docs, "Job", "tether-scorer")
    for pod in (lpod, gen["spec"]["template"]["spec"]):
        init = _env(pod["initContainers"][0])
        assert init["MODEL_ID"] == p["modelId"] and init["MODEL_REVISION"] == p["modelRevision"]
        assert init["STAGING_TIMEOUT_S"] == p["stagingTimeoutSeconds"]
    assert _env(lpod["initContainers"][0])["DATA_SOURCE"] == p["dataSource"]
    (lc,) = lpod["containers"]
    assert job["completions"] == job["parallelism"] == int(p["learnerNodes"])
    assert _env(lc)["LEARNER_NNODES"] == p["learnerNodes"]
    assert _env(lc)["LEARNER_NPROC_PER_NODE"] == p["learnerGpusPerNode"]
    assert int(lc["resources"]["limits"]["nvidia.com/gpu"]) == int(p["learnerGpusPerNode"])
    assert _env(lc)["TETHER_GENERATOR__REPLICAS"] == p["generatorReplicas"]  # the alert's figure
    assert gen["spec"]["completions"] == gen["spec"]["parallelism"] == int(p["generatorReplicas"])
    assert sco["spec"]["completions"] == sco["spec"]["parallelism"] == int(p["scorerReplicas"])
    for kind, pod in (("learner", lpod), ("generator", gen["spec"]["template"]["spec"]),
                      ("scorer", sco["spec"]["template"]["spec"])):  # fmt: skip
        assert _pool(pod) == (p[f"{kind}NodeLabel"], p[f"{kind}NodeValue"]), kind
        assert _env(pod["containers"][0])["TETHER_RUN__NAME"] == p["runName"], kind
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"
               and d["metadata"]["name"] == "tether-learner"]  # fmt: skip
    for b in budgets:  # components/disruption: every learner pod
        assert b["spec"]["minAvailable"] == int(p["learnerNodes"])


def _check_component(component: str, docs: list[dict], added: set) -> None:
    """What each component changes, in a rendering that has it (``added``: the objects it has
    beyond the rendering it was added to; only the kinds this component adds are compared)."""
    adds = {"disruption": {"PodDisruptionBudget"}, "kueue": {"LocalQueue"}, "jobset": {"JobSet"},
            "scorer-egress": {"NetworkPolicy"},
            "prometheus-operator": {"PodMonitor", "ServiceMonitor", "PrometheusRule"}}  # fmt: skip
    added = {a for a in added if a[0] in adds.get(component, set())}
    job, learner = _learner(docs)
    lpod = job["template"]["spec"]
    gpod = _find(docs, "Job", "tether-generator")["spec"]["template"]["spec"]
    if component == "disruption":
        ann = job["template"]["metadata"]["annotations"]
        assert ann["karpenter.sh/do-not-disrupt"] == "true"
        assert ann["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
        redis = _find(docs, "StatefulSet", "tether-redis")["spec"]["template"]["metadata"]
        assert redis["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
        assert {k for k, _ in added} == {"PodDisruptionBudget"}
    elif component.startswith("gpu-"):
        for pod in (lpod, gpod):
            if component == "gpu-operator":
                assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            else:
                node = pod["affinity"]["nodeAffinity"][
                    "requiredDuringSchedulingIgnoredDuringExecution"
                ]
                (term,) = node["nodeSelectorTerms"]
                keys = [e["key"] for e in term["matchExpressions"]]
                want = {"gpu-gke": "cloud.google.com/gke-accelerator",
                        "gpu-eks": "node.kubernetes.io/instance-type"}[component]  # fmt: skip
                assert want in keys[1:]  # beside the pool label of params.yaml (ANDed)
            assert "podAntiAffinity" in pod["affinity"]  # kept beside the node affinity
    elif component == "kueue":
        for w in (
            learner,
            _find(docs, "Job", "tether-generator"),
            _find(docs, "Job", "tether-scorer"),
        ):
            assert w["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "tether"
            assert w["spec"]["suspend"] is True  # Kueue admits (unsuspends) the whole workload
        assert added == {("LocalQueue", "tether")}
    elif component == "jobset":
        assert learner["kind"] == "JobSet" and added == {("JobSet", "tether-learner")}
        assert not [
            d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "tether-learner"
        ]
        host = "tether-learner-learner-0-0.tether-learner"  # <jobset>-<job>-<job i>-<pod i>.<subdomain>
        assert _env(gpod["containers"][0])["TETHER_WEIGHTS__HOST"] == host
    elif component == "one-node":
        (term,) = lpod["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        exprs = {e["key"]: e["values"] for e in term["labelSelector"]["matchExpressions"]}
        assert exprs["app.kubernetes.io/component"] == ["learner"]  # one learner pod per node still
        assert (
            "requiredDuringSchedulingIgnoredDuringExecution"
            not in gpod["affinity"]["podAntiAffinity"]
        )
    elif component == "scorer-egress":
        assert added == {("NetworkPolicy", "tether-scorer-egress")}
    elif component == "prometheus-operator":
        assert added == {("PodMonitor", "tether"), ("ServiceMonitor", "tether-redis"),
                         ("PrometheusRule", "tether")}  # fmt: skip
    else:
        raise AssertionError(f"no check for components/{component}: add one")


def _overlay_doc(name: str) -> dict:
    return yaml.safe_load((dt.K8S_ROOT / "overlays" / name / "kustomization.yaml").read_text())


def _overlay_components(name: str) -> list[str]:
    return [c.rsplit("/", 1)[1] for c in _overlay_doc(name).get("components", [])]


def _overlay_params(name: str) -> dict:
    return yaml.safe_load((dt.K8S_ROOT / "overlays" / name / "params.yaml").read_text())["data"]


# ------------------------------------------------------------------------------ the overlays


def test_the_shipped_overlays_and_components():
    assert {"one-node", "two-node", "multi-node"} <= set(dt.OVERLAYS)
    assert set(dt.COMPONENTS) == {"disruption", "gpu-gke", "gpu-eks", "gpu-operator", "jobset",
                                  "kueue", "one-node", "prometheus-operator", "scorer-egress"}  # fmt: skip
    for name in dt.OVERLAYS:
        kust = _overlay_doc(name)
        assert kust["resources"] == ["../../base"], name
        assert kust["transformers"] == ["../../params"], name  # after the overlay's patches
        assert kust["namespace"].startswith("tether-"), name
        comps = _overlay_components(name)
        if "jobset" in comps:  # the components after it patch the JobSet
            assert comps[0] == "jobset", name


@pytest.mark.parametrize("name", dt.OVERLAYS)
def test_each_overlay_renders_valid_in_its_namespace_with_its_parameters(tmp_path, name):
    _, docs = dt.render_dir(dt.K8S_ROOT / "overlays" / name)
    _validate(tmp_path, [docs])
    _check_namespaced(docs, _overlay_doc(name)["namespace"])
    _check_params(docs, _overlay_params(name))
    base = {(d["kind"], d["metadata"]["name"]) for d in dt.render_dir(dt.K8S)[1]}
    here = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for component in _overlay_components(name):
        _check_component(component, docs, here - base)


def test_a_parameter_patched_from_an_overlay_lands(tmp_path):
    """The layout's promise: an overlay patches params.yaml's ConfigMap and every value reaches
    its fields (the replacements run after the overlay's patch, not before it in the base)."""
    _, docs = dt.render_kustomize(tmp_path, params=PARAMS, namespace="team-a")
    _check_params(docs, PARAMS)
    _check_namespaced(docs, "team-a")
    # and on top of a shipped overlay: the last patch wins
    _, docs = dt.render_kustomize(tmp_path, overlay="two-node", params={"generatorReplicas": "3"})
    _check_params(docs, {**_overlay_params("two-node"), "generatorReplicas": "3"})


def test_every_component_through_every_overlay(tmp_path):
    """Each component listed by an overlay (on top of each shipped overlay that lacks it) lands
    in the overlay's namespace and does what it says; all of them together, in another namespace
    with every parameter changed, too. Every rendering is validated."""
    batches = []
    for name in dt.OVERLAYS:
        base = {(d["kind"], d["metadata"]["name"])
                for d in dt.render_kustomize(tmp_path, overlay=name)[1]}  # fmt: skip
        for component in dt.COMPONENTS:
            if component in _overlay_components(name) or (
                component == "one-node" and "jobset" in _overlay_components(name)
            ):
                continue  # listed twice would add its resources twice; one-node is for the Job
            _, docs = dt.render_kustomize(tmp_path, overlay=name, components=(component,))
            _check_namespaced(docs, _overlay_doc(name)["namespace"])
            added = {(d["kind"], d["metadata"]["name"]) for d in docs} - base
            _check_component(component, docs, added)
            batches.append(docs)
    every = ["jobset", *[c for c in dt.COMPONENTS if c not in ("jobset", "one-node")]]
    _, docs = dt.render_kustomize(tmp_path, components=every, params=PARAMS, namespace="team-b")
    _check_namespaced(docs, "team-b")
    _check_params(docs, PARAMS)
    base = {(d["kind"], d["metadata"]["name"]) for d in dt.render_dir(dt.K8S)[1]}
    for component in every:
        _check_component(component, docs, {(d["kind"], d["metadata"]["name"]) for d in docs} - base)
    batches.append(docs)
    _validate(tmp_path, batches)


# ------------------------------------------------------------------------------ the JobSet

JOBSET = dt.K8S_ROOT / "components" / "jobset" / "jobset.yaml"


def test_the_jobsets_pods_are_the_learner_jobs_pods():
    """components/jobset/jobset.yaml's pod template is learner.yaml's, but for the host names of
    the JobSet's pod 0 and the subdomain JobSet sets itself: the two cannot drift apart."""
    (job,) = [d for d in yaml.safe_load_all((dt.K8S / "learner.yaml").read_text())
              if d and d["kind"] == "Job"]  # fmt: skip
    js = yaml.safe_load(JOBSET.read_text())
    (rjob,) = js["spec"]["replicatedJobs"]
    want = copy.deepcopy(job["spec"]["template"])
    subdomain = want["spec"].pop("subdomain")
    host = f"tether-learner-learner-0-0.{subdomain}"
    (c,) = want["spec"]["containers"]
    c["args"] = [
        f"--master_addr={host}" if a.startswith("--master_addr=") else a for a in c["args"]
    ]
    for e in c["env"]:
        if e["name"] == "TETHER_WEIGHTS__HOST":
            e["value"] = host
    assert rjob["template"]["spec"]["template"] == want
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": subdomain,
                                     "publishNotReadyAddresses": True}  # fmt: skip
    assert js["metadata"]["name"] == job["metadata"]["name"] and rjob["name"] == "learner"


# The Job controller's failure messages (kubernetes pkg/controller/job/pod_failure_policy.go).
FAILED_EXIT = (
    "Container {c} for pod ns/{p} failed with exit code {code} matching FailJob rule at index {i}"
)
FAILED_COND = "Pod ns/{p} has condition {cond} matching FailJob rule at index {i}"


def _jobset_action(js: dict, reason: str, message: str) -> str:
    """The action JobSet takes for a child Job that failed with ``reason`` and ``message``: the
    first rule whose reasons and message patterns match (empty lists match anything), else
    RestartJobSet (JobSet's documented default)."""
    for rule in js["spec"]["failurePolicy"]["rules"]:
        reasons, patterns = (
            rule.get("onJobFailureReasons", []),
            rule.get("onJobFailureMessagePatterns", []),
        )
        if (not reasons or reason in reasons) and (
            not patterns or any(re.search(p, message) for p in patterns)
        ):
            return rule["action"]
    return "RestartJobSet"


def test_the_jobset_restarts_the_learner_as_a_group_without_hand_tuned_backoff():
    """The first failed pod fails the child Job (backoffLimit 0), and JobSet's policy decides:
    refused (2) fails the run; a disruption restarts the group uncounted; a crash, a liveness kill
    (75) or the ranks left when a node vanished restart it, counted against maxRestarts."""
    js = yaml.safe_load(JOBSET.read_text())
    (rjob,) = js["spec"]["replicatedJobs"]
    child = rjob["template"]["spec"]
    assert rjob["replicas"] == 1 and child["completionMode"] == "Indexed"
    assert child["backoffLimit"] == 0  # nothing to raise with the node count
    assert "backoffLimitPerIndex" not in child
    rules = child["podFailurePolicy"]["rules"]
    assert [r["action"] for r in rules] == ["FailJob", "FailJob", "FailJob"]
    policy = js["spec"]["failurePolicy"]
    assert policy["restartStrategy"] == "Recreate" and 0 < policy["maxRestarts"] <= 10
    cases = {  # what reaches JobSet for each way a learner pod ends -> the action it must take
        ("PodFailurePolicy", FAILED_EXIT.format(c="learner", p="l-0", code=2, i=0)): "FailJobSet",
        ("PodFailurePolicy", FAILED_EXIT.format(c="wait-for-staging", p="l-1", code=2, i=1)): "FailJobSet",
        ("PodFailurePolicy", FAILED_COND.format(p="l-0", cond="DisruptionTarget", i=2)):
            "RestartJobSetAndIgnoreMaxRestarts",
        ("BackoffLimitExceeded", "Job has reached the specified backoff limit"): "RestartJobSet",
    }  # fmt: skip
    for (reason, message), action in cases.items():
        assert _jobset_action(js, reason, message) == action, message
    # and which pod endings produce which message: 2 -> rule 0/1; a disruption -> rule 2; 75 and
    # crashes match no rule (counted: backoffLimit 0 -> BackoffLimitExceeded)
    assert rules[0]["onExitCodes"]["values"] == [2] and rules[1]["onExitCodes"]["values"] == [2]
    assert rules[2]["onPodConditions"] == [{"type": "DisruptionTarget"}]
    assert (
        _jobset_action(
            js, "PodFailurePolicy", FAILED_EXIT.format(c="learner", p="l-0", code=25, i=0)
        )
        == "RestartJobSet"
    )  # only exit code 2 is refused


def test_a_crd_schema_check_can_fail():
    """The offline check of custom resources refuses what the API server would."""
    bad = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
           "metadata": {"name": "x"},
           "spec": {"podMetricsEndpoints": [{"port": "metrics", "intervall": "15s"}],
                    "selector": {"matchLabels": {"a": 1}}}}  # fmt: skip
    problems = dt.custom_resource_problems(bad)
    assert any("intervall: unknown field" in p for p in problems), problems
    assert any("is not of type 'string'" in p for p in problems), problems
    js = yaml.safe_load(JOBSET.read_text())
    assert dt.custom_resource_problems(js) == []
    js["spec"]["failurePolicy"]["rules"][0]["action"] = "RestartEverything"
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["backofLimit"] = 0
    problems = dt.custom_resource_problems(js)
    assert any("RestartEverything" in p for p in problems), problems
    assert any("backofLimit: unknown field" in p for p in problems), problems


def test_the_prometheusrule_is_rules_yml():
    spec = importlib.util.spec_from_file_location(
        "prometheusrule", dt.DEPLOY / "prometheus" / "prometheusrule.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = dt.K8S_ROOT / "components" / "prometheus-operator" / "prometheusrule.yaml"
    assert committed.read_text() == module.render(dt.RULES.read_text()), (
        "regenerate: python deploy/prometheus/prometheusrule.py > " + str(committed)
    )
