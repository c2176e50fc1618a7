"""A whole run with every service under its own Redis ACL user (``common.bus.acl``) on Debian's
Redis 7.0, started by deploy/compose's own Redis script: the learner, a vLLM generator and a
scorer as separate processes, as compose and Kubernetes run them (no launcher), each with its
user's URL and the run's weights secret. The run trains every cycle, the generator and the scorer
stop by themselves (exit 0) when the learner finishes, `tether status` and `tether bus inspect`
work with the learner's user, and the server's ACL LOG stays empty: no command any service sent
was outside its set."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path

import pytest

from common.weights.handshake import SECRET_ENV
from tests.deploy_tools import UsersRedis
from tests.e2e_support import recovery_config
from tether.runs.supervisor import tether_command

pytestmark = pytest.mark.slow

CYCLES, PROMPTS, RESPONSES = 3, 4, 4
RUN = "acl"


def _start(kind: str, config: Path, url: str, log_dir: Path, env: dict[str, str], *args: str):
    log = (log_dir / f"{kind}.log").open("wb")
    full = {**os.environ, **env, "TETHER_RUN__REDIS_URL": url, "PYTHONUNBUFFERED": "1"}
    cmd = tether_command(kind, "--config", str(config), *args)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full)


def test_a_run_trains_with_each_service_under_its_own_user(tmp_path):
    (tmp_path / "redis-data").mkdir()
    server = UsersRedis(tmp_path / "redis-data")
    config = recovery_config(tmp_path, RUN, cycles=CYCLES)
    env = {SECRET_ENV: secrets.token_hex(16), "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = {}
    try:
        procs["learner"] = _start("learner", config, server.url("learner"), logs, env)
        procs["generator"] = _start("generator", config, server.url("generator"), logs, env,
                                    "--id", "generator-0")  # fmt: skip
        procs["scorer"] = _start("scorer", config, server.url("scorer"), logs, env,
                                 "--id", "scorer-0")  # fmt: skip
        deadline = time.monotonic() + 900
        while procs["learner"].poll() is None and time.monotonic() < deadline:
            for kind in ("generator", "scorer"):  # 0 once the learner wrote the run's end
                assert procs[kind].poll() in (None, 0), (logs / f"{kind}.log").read_text()[-3000:]
            time.sleep(1)
        assert procs["learner"].wait(5) == 0, (logs / "learner.log").read_text()[-3000:]
        ended = time.monotonic()
        for kind in ("generator", "scorer"):  # the run-finished record, under their users
            assert procs[kind].wait(90) == 0, (logs / f"{kind}.log").read_text()[-3000:]
            assert "the run is finished" in (logs / f"{kind}.log").read_text()
        assert time.monotonic() - ended < 90
        status = subprocess.run(
            tether_command("status", "--json", "--config", str(config), "--redis-url",
                           server.url("learner")),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr[-2000:]
        inspect = subprocess.run(
            tether_command("bus", "inspect", "--json", "--config", str(config), "--redis-url",
                           server.url("learner")),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert inspect.returncode == 0, inspect.stderr[-2000:]
        assert server.denied() == []
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)
        server.stop()
    steps = [
        json.loads(line)
        for line in (tmp_path / "runs" / RUN / "metrics.jsonl").read_text().splitlines()
        if '"kind": "step"' in line
    ]
    assert [s["step"] for s in steps] == list(range(1, CYCLES + 1))
    doc = json.loads(status.stdout)
    learner = next(d for d in doc["services"] if d["service"] == "learner")
    books = learner["books"]
    trained = books["trained_samples"] + books["filtered_samples"]
    assert trained + books["dropped_stale_samples"] == CYCLES * PROMPTS * RESPONSES
    assert {s["stream"] for s in json.loads(inspect.stdout)["streams"]} >= {"prompts", "groups"}
