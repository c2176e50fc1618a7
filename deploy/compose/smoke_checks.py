"""The checks of deploy/compose/smoke.sh, on what the real stack returned (JSON files).

    python deploy/compose/smoke_checks.py accounting STATUS_JSON METRICS_JSONL [--restarted ID]
    python deploy/compose/smoke_checks.py targets TARGETS_JSON
    python deploy/compose/smoke_checks.py names NAMES_JSON [--declared METRICS_DIR]
    python deploy/compose/smoke_checks.py security INSPECT_JSON TOP_DIR LOG_DIR

Each prints what it checked and exits 1 with every failure listed, 0 when all hold. The run's
shape (cycles, prompts, responses, steps) comes from deploy/compose/cpu-demo.toml, the config the
stack ran with. Needs PyYAML and promql-parser (the dev extra) for the dashboard names.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEMO_CONFIG = HERE / "cpu-demo.toml"

# Prometheus jobs of deploy/prometheus/prometheus.yml, one per service of the stack.
JOBS = ("tether-learner", "tether-generator", "tether-scorer", "redis", "prometheus")
TETHER_SERVICES = ("prepare", "learner", "generator-0", "scorer-0")
# Paths a Tether container may write: the run and models volumes, its tmpfs mounts, /dev/shm.
TETHER_WRITABLE = {
    "/var/lib/tether/runs",
    "/models",
    "/tmp",
    "/var/lib/tether/cache",
    "/var/lib/tether/home",
    "/dev/shm",
}
# What a library prints when it meets the read-only root filesystem.
READ_ONLY_TRouble = re.compile(
    r"Read-only file system|EROFS|is not a writable directory|Permission denied|"
    r"could not create .*cache|PermissionError",
    re.IGNORECASE,
)


class Failures(list):
    def check(self, ok: bool, what: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            self.append(what)


def run_shape() -> dict[str, int]:
    run = tomllib.loads(DEMO_CONFIG.read_text())["run"]
    return {
        "cycles": run["num_cycles"],
        "steps": run["num_cycles"] * run["train_steps_per_cycle"],
        "responses": run["num_cycles"] * run["prompts_per_cycle"] * run["responses_per_prompt"],
        "n": run["responses_per_prompt"],
    }


def check_accounting(status_path: Path, metrics_path: Path, restarted: list[str]) -> Failures:
    """`tether status --json` after the learner finished, and the run's metrics.jsonl."""
    st = json.loads(status_path.read_text())
    shape, f = run_shape(), Failures()
    print(f"accounting of run {st.get('run')!r} ({st.get('source')} status):")
    f.check(
        st.get("source") == "live", f"status read live from the stack's Redis: {st.get('source')}"
    )
    f.check(
        st.get("learner_version") == shape["steps"],
        f"learner finished at policy version {st.get('learner_version')} == {shape['steps']} steps",
    )
    learner = next((s for s in st["services"] if s["service"] == "learner"), {})
    c = learner.get("books", {})
    ends = (
        c.get("trained_samples", 0)
        + c.get("dropped_stale_samples", 0)
        + c.get("filtered_samples", 0)
        + st.get("dead_letters", 0) * shape["n"]
    )
    f.check(
        ends == shape["responses"],
        f"every response trained, dropped, filtered or dead-lettered: {c.get('trained_samples')} + "
        f"{c.get('dropped_stale', 0)} + {c.get('filtered_samples', 0)} + {st.get('dead_letters')}×"
        f"{shape['n']} = {ends} == {shape['responses']}",
    )
    f.check(c.get("trained_samples", 0) > 0, "some responses were trained")
    a = st.get("accounting_trajectories") or {}
    f.check(
        a.get("in_flight") == 0 and a.get("trained") == c.get("trained_samples"),
        f"status: nothing in flight ({a.get('in_flight')}), trained {a.get('trained')}",
    )
    # `generated` is each generator id's run-long count (kept in Redis), so the books balance
    # after a generator restart too.
    f.check(a.get("unaccounted") == 0, f"status books balance: unaccounted {a.get('unaccounted')}")
    for name, q in st["streams"].items():
        f.check(
            q["lag"] == 0 and q["pending"] == 0,
            f"stream {name}: nothing left (lag {q['lag']}, pending {q['pending']})",
        )
    steps = [json.loads(x) for x in metrics_path.read_text().splitlines() if '"kind": "step"' in x]
    by_step: dict[int, set[str]] = {}
    for s in steps:
        by_step.setdefault(s["step"], set()).add(s["batch_digest"])
    f.check(
        sorted(by_step) == list(range(1, shape["steps"] + 1)),
        f"metrics.jsonl has every step 1..{shape['steps']} ({len(by_step)} distinct)",
    )
    f.check(
        len(steps) == shape["steps"] and all(len(d) == 1 for d in by_step.values()),
        f"each step trained once, on one batch ({len(steps)} step records)",
    )
    versions = st.get("generator_versions", {})
    for sid in restarted:  # it stops by itself at the run's end: its version tells, not "alive"
        f.check(
            versions.get(sid) is not None and versions.get(sid) >= shape["steps"] - 2,
            f"{sid} (restarted) rejoined the weight group: runs policy v{versions.get(sid)}",
        )
    return f


def check_targets(targets_path: Path) -> Failures:
    """/api/v1/targets: every job has a target and all of them are up."""
    doc = json.loads(targets_path.read_text())
    active = doc["data"]["activeTargets"]
    f = Failures()
    print("Prometheus targets:")
    for job in JOBS:
        mine = [t for t in active if t["labels"].get("job") == job]
        health = [f"{t['labels'].get('instance')}={t['health']}" for t in mine]
        f.check(bool(mine) and all(t["health"] == "up" for t in mine), f"{job}: {health}")
    return f


def dashboard_names() -> tuple[dict[str, str], dict[str, str]]:
    """(name -> where, regex -> where) of every selector in the Grafana dashboards."""
    sys.path.insert(0, str(ROOT))
    from tests import deploy_tools as dt  # noqa: PLC0415 - from the clone, once it is on the path

    names: dict[str, str] = {}
    regexes: dict[str, str] = {}
    for path in dt.DASHBOARDS:
        for where, expr in dt.dashboard_expressions(path):
            plain, res = dt.selectors(expr)
            names.update({n: where for n in plain})
            regexes.update({r: where for r in res})
    return names, regexes


def declared_names(metrics_dir: Path | None) -> set[str]:
    """Metric families the services declare on /metrics (TYPE lines), samples or not."""
    out: set[str] = set()
    for path in sorted(metrics_dir.glob("*.txt")) if metrics_dir else []:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("# TYPE "):
                out.add(line.split()[2])
    return out


# Dashboard metrics from exporters the compose stack does not run: each prefix and where its
# series come from. They are listed as not checked, never counted as present.
NOT_IN_COMPOSE = {
    "DCGM_": "NVIDIA's DCGM exporter, on GPU nodes only: the CPU compose stack runs none",
}


def check_names(names_path: Path, metrics_dir: Path | None = None) -> Failures:
    """/api/v1/label/__name__/values: every metric the dashboards query has samples in
    Prometheus (a recording rule: all its inputs do). The services start their labelled counters
    at 0 (``metric(..., initial=...)``), so no panel is "No data" for want of a first event;
    ``metrics_dir`` (the services' /metrics) only names what a missing metric's service declared."""
    sys.path.insert(0, str(ROOT))
    from tests import deploy_tools as dt  # noqa: PLC0415 - from the clone, once it is on the path

    have = set(json.loads(names_path.read_text())["data"])
    declared = declared_names(metrics_dir)
    import yaml  # noqa: PLC0415 - only the names check reads YAML

    rules: dict[str, set[str]] = {}
    for g in yaml.safe_load(dt.RULES.read_text())["groups"]:
        for r in g["rules"]:
            if "record" in r:
                rules[r["record"]] = dt.selectors(str(r["expr"]))[0]

    def known(n: str) -> bool:
        if n in rules:
            return all(known(m) for m in rules[n])
        return n in have

    names, regexes = dashboard_names()
    f = Failures()
    print(f"dashboard metrics in Prometheus ({len(names)} names, {len(regexes)} regexes):")
    for n, where in sorted(names.items()):
        outside = next((why for p, why in NOT_IN_COMPOSE.items() if n.startswith(p)), None)
        if outside and n not in have:
            print(f"  skip {n} ({where}): {outside}")
        elif n in have:
            f.check(True, f"{n} ({where})")
        else:
            said = (
                "declared on a service's /metrics"
                if (dt.family(n) in declared or n in declared)
                else "declared by no service"
            )
            f.check(known(n), f"{n} ({where}): samples in Prometheus (else: {said})")
    for r, where in sorted(regexes.items()):
        f.check(any(re.fullmatch(r, n) for n in have), f"some name matches {r!r} ({where})")
    return f


def check_security(inspect_path: Path, top_dir: Path, log_dir: Path) -> Failures:
    """`docker inspect` of every container of the stack, `docker top` of the running ones and
    every container's log: non-root, read-only root, no capabilities, writes only where mounted."""
    f = Failures()
    print("containers:")
    for c in json.loads(inspect_path.read_text()):
        labels = c["Config"]["Labels"]
        svc = labels.get("com.docker.compose.service", c["Name"])
        hc = c["HostConfig"]
        user = c["Config"]["User"]
        f.check(
            user not in ("", "0", "root") and not user.startswith("0:"), f"{svc}: user {user!r}"
        )
        f.check(hc.get("ReadonlyRootfs") is True, f"{svc}: read-only root filesystem")
        f.check(
            "ALL" in (hc.get("CapDrop") or []) and not hc.get("CapAdd"),
            f"{svc}: capabilities {hc.get('CapDrop')} dropped, none added",
        )
        f.check(
            any(o.startswith("no-new-privileges") for o in hc.get("SecurityOpt") or []),
            f"{svc}: no-new-privileges",
        )
        f.check(not hc.get("Privileged"), f"{svc}: not privileged")
        if svc in TETHER_SERVICES:
            f.check(user == "10001:10001", f"{svc}: runs as 10001:10001")
            writable = {m["Destination"] for m in c["Mounts"] if m.get("RW")}
            writable |= set(hc.get("Tmpfs") or {}) | {"/dev/shm"}
            f.check(
                writable <= TETHER_WRITABLE,
                f"{svc}: writable paths {sorted(writable)} are volumes or tmpfs",
            )
        top = top_dir / f"{c['Id']}.json"
        if top.exists():
            rows = json.loads(top.read_text())["Processes"] or []
            uids = sorted({r[0] for r in rows})
            f.check(
                bool(rows) and "0" not in uids and "root" not in uids, f"{svc}: process uids {uids}"
            )
        log = log_dir / f"{svc}.log"
        if log.exists():
            bad = [
                ln
                for ln in log.read_text(errors="replace").splitlines()
                if READ_ONLY_TRouble.search(ln)
            ]
            f.check(
                not bad, f"{svc}: no write refused in its log" + (f": {bad[:3]}" if bad else "")
            )
    return f


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("accounting")
    a.add_argument("status", type=Path)
    a.add_argument("metrics", type=Path)
    a.add_argument("--restarted", action="append", default=[])
    sub.add_parser("targets").add_argument("targets", type=Path)
    nm = sub.add_parser("names")
    nm.add_argument("names", type=Path)
    nm.add_argument(
        "--declared", type=Path, default=None, help="folder of the services' /metrics texts"
    )
    s = sub.add_parser("security")
    s.add_argument("inspect", type=Path)
    s.add_argument("top_dir", type=Path)
    s.add_argument("log_dir", type=Path)
    args = p.parse_args()
    if args.what == "accounting":
        failed = check_accounting(args.status, args.metrics, args.restarted)
    elif args.what == "targets":
        failed = check_targets(args.targets)
    elif args.what == "names":
        failed = check_names(args.names, args.declared)
    else:
        failed = check_security(args.inspect, args.top_dir, args.log_dir)
    if failed:
        print(f"{len(failed)} check(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
