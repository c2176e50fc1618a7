"""A 2-node learner (two torchrun agents on this host, one rank each: the shape of two pods of
the Kubernetes Indexed Job) under ``tether.runs.graceful_torchrun``, against a real Redis:

- rank 0 waits for input (no generators) for longer than the process-group timeout
  (``learner.collective_timeout_s``), and rank 1 survives it on rank 0's keepalives;
- rank 1's ``/healthz`` (its node's first rank) is a real heartbeat: 200 while it hears rank 0;
- SIGTERM to both agents while a checkpoint takes longer than torchrun's default 30 s shutdown
  timeout (``TETHER_TEST_ONLY_CHECKPOINT_DELAY_S``, a test hook): the final checkpoint lands and
  both exit 75 (stopped before the run's end, resumable: what the Job's podFailurePolicy
  ignores), not 0 (which would complete the Job mid-run) and not torchrun's 1.

On the old code rank 1 died in its broadcast after the timeout, and plain torchrun SIGKILLed the
ranks 30 s into the checkpoint and exited 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.ports import free_port
from common.service.exit_codes import EXIT_STOPPED
from services.learner.checkpoint import TEST_ONLY_DELAY_ENV
from tests.procs.httpget import http_get
from tether.demo.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

# The timeout also bounds start-up asymmetry (rank 0 alone connects to Redis and loads the
# data before its first collective): 30 s leaves room for a loaded test machine.
PG_TIMEOUT_S, KEEPALIVE_S, CHECKPOINT_DELAY_S = 30, 1, 35


def _config(tmp_path: Path, model: Path, redis_url: str) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"{i} + {i} =", "answer": str(2 * i)}) + "\n" for i in range(8)
        )
    )
    path = tmp_path / "learner.toml"
    path.write_text(f"""
[run]
name = "shutdown"
run_dir = "{tmp_path / "runs"}"
model = "{model}"
redis_url = "{redis_url}"
prompts_per_cycle = 2
responses_per_prompt = 2
num_cycles = 3
max_prompt_tokens = 32
max_response_tokens = 8

[data]
train_path = "{data}"

[learner]
nnodes = 2
collective_timeout_s = {PG_TIMEOUT_S}
keepalive_s = {KEEPALIVE_S}
liveness_s = 8
trackers = []

[bus]
block_ms = 200
""")
    return path


def _agent(node: int, master_port: int, metrics_port: int, config: Path, log: Path):
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        TEST_ONLY_DELAY_ENV: str(CHECKPOINT_DELAY_S),
        "TETHER_LEARNER__METRICS_PORT": str(metrics_port),
        "OMP_NUM_THREADS": "1",
    }
    argv = [sys.executable, "-m", "tether.runs.graceful_torchrun",
            f"--shutdown-timeout={CHECKPOINT_DELAY_S + 60}", "--nnodes=2", "--nproc_per_node=1",
            f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={master_port}",
            "-m", "tether.cli", "learner", "--config", str(config)]  # fmt: skip
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip


def _wait(pred, timeout_s: float, what: str, procs, logs) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        for p, log in zip(procs, logs, strict=True):
            assert p.poll() is None, (
                f"exited {p.returncode} while {what}:\n{log.read_text()[-3000:]}"
            )
        time.sleep(0.3)
    tails = "\n".join(log.read_text()[-2000:] for log in logs)
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


def _code(port: int, path: str) -> int:
    try:
        return http_get(port, path)[0]
    except OSError:
        return 0


def test_idle_past_the_collective_timeout_then_sigterm_lands_a_slow_checkpoint(
    redis_server, tmp_path
):
    model = build_tiny_model(tmp_path / "tiny", seed=1)
    config = _config(tmp_path, model, redis_server.url)
    ports = [free_port(), free_port()]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    master = free_port()
    procs = [_agent(i, master, ports[i], config, logs[i]) for i in (0, 1)]
    try:
        _wait(lambda: _code(ports[0], "/readyz") == 200, 300, "rank 0 ready", procs, logs)
        _wait(lambda: _code(ports[1], "/healthz") == 200, 60, "rank 1 alive", procs, logs)
        idle_from = time.monotonic()
        # rank 0 waits for input (nothing scores anything) longer than the collective timeout
        while time.monotonic() - idle_from < PG_TIMEOUT_S + 10:
            for p, log in zip(procs, logs, strict=True):
                assert p.poll() is None, (
                    f"a rank died while rank 0 idled:\n{log.read_text()[-3000:]}"
                )
            assert _code(ports[1], "/healthz") == 200, "rank 1 stopped hearing rank 0"
            time.sleep(1.0)
        assert _code(ports[0], "/healthz") == 200
        t0 = time.monotonic()
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)  # what the kubelet does to each pod (PID 1 only
            # there; here the agent's group, which is just the wrapper: torchrun has its own)
        codes = [p.wait(timeout=CHECKPOINT_DELAY_S + 90) for p in procs]
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
    out = "\n".join(f"--- node {i}\n{log.read_text()[-3000:]}" for i, log in enumerate(logs))
    assert codes == [EXIT_STOPPED, EXIT_STOPPED], out
    assert took >= CHECKPOINT_DELAY_S, f"stopped in {took:.0f} s: the checkpoint hook did not run"
    ckpts = tmp_path / "runs" / "shutdown" / "checkpoints"
    assert (ckpts / "latest").exists(), out
    step = (ckpts / "latest").read_text().strip()
    assert (ckpts / step).is_dir(), out
