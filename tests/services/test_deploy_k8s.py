"""deploy/k8s/base checked offline — no cluster runs here: every manifest against the Kubernetes
schemas (``kubernetes-validate --strict``), the "restricted" Pod Security rules on every pod, and
what each manifest must say: Jobs that finish when the run does, failure policies on the
services' own exit codes (a liveness kill counted), placement (learner and generators never on
one node, a pool per role, priorities), the bounded staging wait, the Redis ACL script of compose
and the network flows by port. Overlays, parameters, components and the JobSet:
test_deploy_k8s_overlays.py.

Tools: PyPI `kubernetes-validate`, `jsonschema`; `kubectl`. A test skips only when its tool is
not installed."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest
import yaml

from common.service.exit_codes import EXIT_REFUSED, EXIT_STOPPED
from tests import deploy_tools as dt

TETHER_CONTAINERS = {"learner", "generator", "scorer"}


def _doc(kind: str, name: str, docs=None) -> dict:
    docs = dt.k8s_docs() if docs is None else [("", d) for d in docs]
    (doc,) = [d for _, d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _flag(args: list[str], flag: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    return value


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
    assert kust["transformers"] == ["../params"]  # the parameters, also run by every overlay


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


def _rule_index(rules: list[dict], rule: dict) -> int:
    assert rule in rules, (rule, rules)
    return rules.index(rule)


def _stop_and_disruption_rules(rules: list[dict], container: str) -> None:
    """Exit 75 without a disruption (the liveness probe's SIGTERM: the service stops cleanly) is
    counted; a disruption is not, and its rule comes first (rules match in order: a drained pod
    also exits 75). Exit 2 of the service or of the staging wait fails the Job."""
    fail = {"action": "FailJob", "onExitCodes": {"containerName": container, "operator": "In",
            "values": [EXIT_REFUSED]}}  # fmt: skip
    staging = {"action": "FailJob", "onExitCodes": {"containerName": "wait-for-staging",
               "operator": "In", "values": [EXIT_REFUSED]}}  # fmt: skip
    disrupted = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    stopped = {"action": "Count", "onExitCodes": {"containerName": container, "operator": "In",
               "values": [EXIT_STOPPED]}}  # fmt: skip
    _rule_index(rules, fail)
    if container != "scorer":  # the scorer has no staging wait
        _rule_index(rules, staging)
    assert _rule_index(rules, disrupted) < _rule_index(rules, stopped)
    ignored = [r for r in rules if r["action"] == "Ignore"]
    assert ignored == [disrupted], "nothing but a disruption may go uncounted"


def test_learner_is_an_indexed_job_that_stays_finished_and_stops_in_its_grace_period():
    job = _doc("Job", "tether-learner")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]  # one pod per node, all at once
    assert pod["restartPolicy"] == "Never"  # a finished rank is not restarted in place
    _stop_and_disruption_rules(spec["podFailurePolicy"]["rules"], "learner")
    (c,) = pod["containers"]
    assert c["command"] == ["python3", "-m", "tether.runs.graceful_torchrun"]
    assert 0 < int(_flag(c["args"], "--shutdown-timeout")) < pod["terminationGracePeriodSeconds"]
    env = {e["name"]: e for e in c["env"]}
    assert (
        "job-completion-index" in env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    )
    assert _flag(c["args"], "--node_rank") == "$(JOB_COMPLETION_INDEX)"
    # a short name: the pod's DNS search path resolves it in whatever namespace an overlay sets
    host = f"{job['metadata']['name']}-0.{pod['subdomain']}"
    assert _flag(c["args"], "--master_addr") == host == env["TETHER_WEIGHTS__HOST"]["value"]
    gen = _doc("Job", "tether-generator")["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in gen["env"]}["TETHER_WEIGHTS__HOST"] == host
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == int(
        env["LEARNER_NPROC_PER_NODE"]["value"]
    )


def test_run_name_is_the_namespace_unless_set():
    """Two namespaces left on defaults never share a run: run.name is the pod's namespace."""
    for name in ("tether-learner", "tether-generator", "tether-scorer"):
        (c,) = _doc("Job", name)["spec"]["template"]["spec"]["containers"]
        env = [e["name"] for e in c["env"]]
        values = {e["name"]: e for e in c["env"]}
        assert values["TETHER_RUN__NAME"]["value"] == "$(POD_NAMESPACE)", name
        ns = values["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert ns == "metadata.namespace", name
        # Kubernetes expands $(VAR) only from variables defined before it
        assert env.index("POD_NAMESPACE") < env.index("TETHER_RUN__NAME"), name


def test_placement_keeps_learner_and_generators_apart_with_a_pool_each():
    """Learner pods take a node of their own (no other learner pod, no generator: required, both
    sides), each role requires its pool's label (params.yaml), generators spread, scorers run
    the CPU image without the GPU toleration, and priorities let the learner preempt."""
    learner = _doc("Job", "tether-learner")["spec"]["template"]["spec"]
    generator = _doc("Job", "tether-generator")["spec"]["template"]["spec"]
    scorer = _doc("Job", "tether-scorer")["spec"]["template"]["spec"]
    (term,) = learner["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    exprs = {e["key"]: e["values"] for e in term["labelSelector"]["matchExpressions"]}
    assert exprs["app.kubernetes.io/component"] == ["learner", "generator"]
    anti = generator["affinity"]["podAntiAffinity"]
    (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "learner"
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"]  # spread
    for pod in (learner, generator, scorer):
        node = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        (expr,) = node["nodeSelectorTerms"][0]["matchExpressions"]  # params.yaml's pool label
        assert expr == {"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}
    (sc,) = scorer["containers"]
    assert sc["image"] == "tether-cpu" and "nvidia.com/gpu" not in sc["resources"]["limits"]
    assert "tolerations" not in scorer  # a tainted GPU node never takes a scorer
    assert learner["priorityClassName"] == "tether-learner"
    assert generator["priorityClassName"] == scorer["priorityClassName"] == "tether-rollout"
    classes = {d["metadata"]["name"]: d["value"] for _, d in dt.k8s_docs()
               if d["kind"] == "PriorityClass"}  # fmt: skip
    assert classes["tether-learner"] > classes["tether-rollout"]
    redis = _doc("StatefulSet", "tether-redis")["spec"]["template"]["spec"]
    assert redis["priorityClassName"] == "tether-learner"


@pytest.mark.parametrize("kind", ["generator", "scorer"])
def test_generators_and_scorers_are_jobs_that_end_with_the_run(kind):
    """Item 1 on Kubernetes: when the learner finishes, each exits 0 by itself (run_end), its
    index completes, the Job completes, its GPU is released. A disruption is replaced uncounted;
    a stop by the liveness probe (75) is replaced and counted; a refused configuration fails the
    Job; one id per pod."""
    job = _doc("Job", f"tether-{kind}")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert pod["restartPolicy"] == "Never" and spec["podReplacementPolicy"] == "Failed"
    assert spec["backoffLimitPerIndex"] >= 1  # a crash-looping replica fails alone
    _stop_and_disruption_rules(spec["podFailurePolicy"]["rules"], kind)
    (c,) = pod["containers"]
    assert c["args"][-2:] == ["--id", f"tether-{kind}-$(JOB_COMPLETION_INDEX)"]  # stable ids
    env = {e["name"]: e for e in c["env"]}
    assert env["TETHER_RUN__REDIS_URL"]["value"].startswith(f"redis://tether-{kind}:")
    assert env[f"REDIS_{kind.upper()}_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == kind
    if kind == "generator":
        assert env["TETHER_WEIGHTS_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "tether-weights"


def test_gpu_pods_tolerate_gpu_taints_and_wait_a_bounded_time_for_the_staged_model():
    """The init container waits at most stagingTimeoutSeconds, then exits 2 with a message that
    names the staging Job (and how to read its logs); exit 2 of the wait fails the Job, so its
    pods stop holding GPUs."""
    for name in ("tether-learner", "tether-generator"):
        pod = _doc("Job", name)["spec"]["template"]["spec"]
        assert "nodeSelector" not in pod, name  # pool labels differ: params.yaml, components/gpu-*
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
        (init,) = pod["initContainers"]
        assert init["command"][:2] == ["sh", "-c"], name
        script = init["command"][2]
        assert "python3 -m common.data.staging wait" in script
        assert '--timeout-s "$STAGING_TIMEOUT_S" && exit 0' in script
        assert "job/tether-staging" in script and script.rstrip().endswith("exit 2")
        assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
        env = {e["name"]: e.get("value") for e in init["env"]}
        assert int(env["STAGING_TIMEOUT_S"]) > 0, name  # 0 would wait forever
        assert "MODEL_ID" in env and ("DATA_SOURCE" in env) == (name == "tether-learner")


def test_the_staging_wait_gives_up_with_the_jobs_name(tmp_path):
    """The init container's script, run for real with sh against an empty models volume and a
    1 s bound: exit 2 and a message naming the tether-staging Job and the namespace."""
    init = _doc("Job", "tether-learner")["spec"]["template"]["spec"]["initContainers"][0]
    script = init["command"][2].replace("python3 -m", f"{sys.executable} -m")
    script = script.replace("--timeout-s", f"--root {tmp_path} --every-s 0.2 --timeout-s")
    env = {**os.environ, "PYTHONPATH": str(dt.ROOT), "MODEL_ID": "org/model", "MODEL_REVISION": "",
           "DATA_SOURCE": "", "STAGING_TIMEOUT_S": "1", "POD_NAMESPACE": "team-a"}  # fmt: skip
    res = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True,
                         timeout=60, cwd=dt.ROOT)  # fmt: skip
    assert res.returncode == EXIT_REFUSED, res.stdout + res.stderr
    assert "kubectl -n team-a logs job/tether-staging" in res.stderr
    assert "org/model" in res.stderr and "stagingTimeoutSeconds" in res.stderr


def test_the_staging_job_stages_model_and_data_with_the_hub_token_from_a_secret():
    job = _doc("Job", "tether-staging")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"][:4] == ["python3", "-m", "common.data.staging", "stage"]
    # a GGUF wheel is downloaded into the cache volume (the root filesystem is read-only)
    cache = c["command"][c["command"].index("--cache-dir") + 1]
    assert {"name": "cache", "mountPath": cache} in c["volumeMounts"]
    assert c["image"] == "tether-cpu"  # no GPU, no CUDA image to pull
    env = {e["name"]: e for e in c["env"]}
    token = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token == {"name": "tether-hf", "key": "token", "optional": True}
    assert {"action": "FailJob", "onExitCodes": {"containerName": "stage", "operator": "In",
            "values": [2]}} in job["spec"]["podFailurePolicy"]["rules"]  # fmt: skip
    # a failed staging Job, its pods and their logs stay until someone deletes the Job
    assert "ttlSecondsAfterFinished" not in job["spec"]
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"

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


def _ports(rule: dict) -> set:
    return {(p["port"], p.get("endPort", p["port"])) for p in rule.get("ports", [])}


def _allowed(policies: dict, src: str, dst: str) -> set:
    """(first, last) port ranges on which pods of component ``src`` may open connections to pods
    of component ``dst``: the intersection of dst's ingress and src's egress (both required)."""

    def peers(rule_peers, kind):
        return any(p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
                   == kind for p in rule_peers)  # fmt: skip

    def selects(policy, kind):
        sel = policy["podSelector"]
        labels = sel.get("matchLabels", {})
        exprs = {e["key"]: e["values"] for e in sel.get("matchExpressions", [])}
        comp = labels.get("app.kubernetes.io/component")
        return comp == kind or kind in exprs.get("app.kubernetes.io/component", [])

    ingress, egress = set(), set()
    for p in policies.values():
        if selects(p, dst) and "Ingress" in p["policyTypes"]:
            for r in p.get("ingress", []):
                if peers(r["from"], src):
                    ingress |= _ports(r)
        if selects(p, src) and "Egress" in p["policyTypes"]:
            for r in p.get("egress", []):
                if peers(r["to"], dst):
                    egress |= _ports(r)
    return ingress & egress


def test_the_network_is_default_deny_with_tethers_flows_allowed_by_port():
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
    (to_redis,) = policies["tether-services-egress"]["egress"]
    assert to_redis["ports"] == [{"port": 6379, "protocol": "TCP"}]
    # every rule between Tether's pods names its ports: nothing is open on every port
    for name, p in policies.items():
        for r in p.get("ingress", []) + p.get("egress", []):
            if any("podSelector" in x for x in r.get("from", r.get("to", []))):
                assert r.get("ports"), f"{name}: a rule open on every port"
    nccl = {(32768, 60999)}  # the pods' pinned ephemeral range (sysctl)
    rendezvous, weights = {(29500, 29500)}, {(29600, 29600)}
    assert _allowed(policies, "learner", "learner") == rendezvous | weights | nccl
    assert _allowed(policies, "generator", "learner") == weights | nccl  # not the rendezvous
    assert _allowed(policies, "learner", "generator") == nccl
    assert _allowed(policies, "generator", "generator") == nccl
    for other in ("learner", "generator", "scorer"):
        assert _allowed(policies, "scorer", other) == set(), other  # scorers reach Redis only
        assert _allowed(policies, other, "scorer") == set(), other
    for fname, doc, pod in dt.pod_templates():
        sysctls = {s["name"]: s["value"]
                   for s in pod["spec"]["securityContext"].get("sysctls", [])}  # fmt: skip
        if doc["metadata"]["name"] in ("tether-learner", "tether-generator"):
            assert sysctls == {"net.ipv4.ip_local_port_range": "32768 60999"}, fname
        else:
            assert sysctls == {}, fname
    # nothing but the staging Job leaves the cluster, and never to the metadata endpoint
    out = [n for n, p in policies.items()
           if any("ipBlock" in t for r in p.get("egress", []) for t in r["to"])]  # fmt: skip
    assert out == ["tether-staging-egress"]
    (rule,) = policies["tether-staging-egress"]["egress"]
    assert rule["to"][0]["ipBlock"]["except"] == ["169.254.0.0/16"]
