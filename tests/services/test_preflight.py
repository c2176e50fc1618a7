"""Bad input fails at the front door: `tether train` and each service, run as a user runs them,
exit 2 within seconds with one paragraph naming the setting or the row and the fix, having
started nothing (no run directory, no embedded Redis, no service, no process left behind).

Before the preflight, `tether train` with a bad row started every service and exited 1 after
~40 s with the reason only in learner.log; with an unreachable --redis-url it retried for ever.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from common.bus.server import EmbeddedRedis
from common.config.load import load_config
from common.ports import free_port
from tests.paths import REPO
from tether.demo.tiny_model import build_tiny_model
from tether.runs.supervisor import RunFailed, Supervisor

# On-disk checks and one PING take ~2 s on the 2-core machine; the bound leaves room for a busy
# one. Checks that load the tokenizer (transformers imports torch) took 5-12 s there.
FAST_S = 10.0
TOKENIZER_S = 30.0


@dataclass
class Result:
    code: int | None
    err: str
    seconds: float
    leftovers: list[int]  # pids of processes started by the command still running after it


def _marked(marker: str) -> list[int]:
    """Pids of live processes whose environment carries ``marker`` (the command's children)."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in env.read_bytes():
                found.append(int(env.parent.name))
        except OSError:
            continue
    return found


def tether(
    cwd: Path, *args: str, timeout_s: float = 60.0, extra_env: dict[str, str] | None = None
) -> Result:
    """`python -m tether.cli ARGS` in ``cwd``; on a timeout, its whole session is killed."""
    marker = uuid.uuid4().hex  # inherited by everything the command starts
    env = dict(os.environ, PYTHONPATH=str(REPO), TETHER_PREFLIGHT_TEST_MARKER=marker)
    for name in [k for k in env if k.startswith("TETHER_") and "__" in k]:
        del env[name]  # only the arguments configure the command
    env.update(extra_env or {})
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether.cli", *args], cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=timeout_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        code = None
    seconds = time.monotonic() - started
    leftovers = _marked(marker)
    for pid in leftovers:  # clean up what the command left running
        os.kill(pid, signal.SIGKILL)
    return Result(code, err, seconds, leftovers)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("pf") / "tiny", seed=0)


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = [{"prompt": "What is 1+1?", "answer": "2"}, {"prompt": "What is 2+2?", "answer": "4"}]
BAD_ROW = [GOOD[0], {"prompt": 5, "answer": "3"}]


def refused(r: Result, cwd: Path, *needles: str, within_s: float = FAST_S) -> str:
    """Exit 2, one stderr line holding every needle, in time, nothing started or left."""
    assert r.code == 2, f"exit {r.code} after {r.seconds:.1f} s; stderr:\n{r.err[-3000:]}"
    lines = [ln for ln in r.err.splitlines() if "cannot start" in ln]
    assert len(lines) == 1, r.err[-3000:]
    assert "Traceback" not in r.err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert r.seconds < within_s, f"took {r.seconds:.1f} s"
    assert not (cwd / "runs").exists(), "a run directory was created"
    assert r.leftovers == [], f"processes left running: {r.leftovers}"
    return lines[0]


def test_train_bad_row_names_file_line_and_fix(tmp_path, model):
    data = write_rows(tmp_path / "train.jsonl", BAD_ROW)
    r = tether(tmp_path, "train", "--model", str(model), "--set", f"data.train_path={json.dumps(str(data))}")  # fmt: skip
    refused(r, tmp_path, str(data), "row 1 (0-based; line 2)", "is a int",
            'data.overlong_prompt_policy = "drop"')  # fmt: skip


def test_train_overlong_prompt_is_found_with_the_learners_tokenizer(tmp_path, model):
    data = write_rows(tmp_path / "train.jsonl", GOOD)
    r = tether(tmp_path, "train", "--model", str(model), "--set", "run.max_prompt_tokens=8",
               "--set", f"data.train_path={json.dumps(str(data))}")  # fmt: skip
    refused(r, tmp_path, "row 0 (0-based; line 1)", "over run.max_prompt_tokens = 8",
            within_s=TOKENIZER_S)  # fmt: skip


def test_train_unreachable_redis_url_fails_in_seconds(tmp_path, model):
    data = write_rows(tmp_path / "train.jsonl", GOOD)
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"  # nothing listens there
    r = tether(tmp_path, "train", "--model", str(model), "--redis-url", url,
               "--set", f"data.train_path={json.dumps(str(data))}")  # fmt: skip
    line = refused(r, tmp_path, "run.redis_url", "PING", url.split("@")[1].rsplit("/", 1)[0],
                   "leave run.redis_url empty")  # fmt: skip
    assert "secret" not in line


def test_train_unreachable_redis_and_bad_row_are_reported_together(tmp_path, model):
    data = write_rows(tmp_path / "train.jsonl", BAD_ROW)
    r = tether(tmp_path, "train", "--model", str(model), "--redis-url", f"redis://127.0.0.1:{free_port()}/0",
               "--set", f"data.train_path={json.dumps(str(data))}")  # fmt: skip
    refused(r, tmp_path, "2 problems", "line 2", "PING")


def test_train_empty_train_path_is_refused_with_the_fix(tmp_path, model):
    r = tether(tmp_path, "train", "--model", str(model))
    refused(r, tmp_path, "data.train_path is empty", "--set data.train_path=", "tether demo")


def test_train_missing_train_path(tmp_path, model):
    r = tether(tmp_path, "train", "--model", str(model), "--set", 'data.train_path="nope.jsonl"')
    refused(r, tmp_path, "data.train_path = 'nope.jsonl' does not exist")


def test_learner_alone_without_staged_data_names_the_staging_fix(tmp_path, model, redis_server):
    """The Kubernetes learner Job before its data is staged: exit 2 at once (the Job's
    podFailurePolicy fails it) with the fix, not a crash loop."""
    r = tether(tmp_path, "learner", "--model", str(model), "--redis-url", redis_server.url,
               "--set", 'data.train_path="/models/data/train.jsonl"')  # fmt: skip
    refused(r, tmp_path, "data.train_path = '/models/data/train.jsonl' does not exist",
            "dataSource in deploy/k8s/params.yaml", "tether-staging")  # fmt: skip


@pytest.mark.parametrize("which", ["missing", "no_weights"])
def test_train_missing_model_dir(tmp_path, which):
    data = write_rows(tmp_path / "train.jsonl", GOOD)
    model = tmp_path / "model"
    if which == "no_weights":
        model.mkdir()
        (model / "config.json").write_text("{}")
    r = tether(tmp_path, "train", "--model", str(model), "--set", f"data.train_path={json.dumps(str(data))}")  # fmt: skip
    why = "does not exist" if which == "missing" else "has no weights"
    refused(r, tmp_path, f"run.model = '{model}' {why}")


def test_learner_alone_bad_row(tmp_path, model, redis_server):
    data = write_rows(tmp_path / "train.jsonl", BAD_ROW)
    r = tether(tmp_path, "learner", "--model", str(model), "--redis-url", redis_server.url,
               "--set", f"data.train_path={json.dumps(str(data))}")  # fmt: skip
    refused(r, tmp_path, "tether learner", "row 1 (0-based; line 2)")


def test_generator_alone_unreachable_redis(tmp_path, model):
    r = tether(tmp_path, "generator", "--model", str(model),
               "--redis-url", f"redis://127.0.0.1:{free_port()}/0")  # fmt: skip
    refused(r, tmp_path, "tether generator", "PING", "start the server or correct the URL")


def test_scorer_alone_bad_redis_url_scheme_without_showing_the_password(tmp_path):
    r = tether(tmp_path, "scorer", "--redis-url", "http://user:hunter2@example:6379/0")
    line = refused(r, tmp_path, "tether scorer", "scheme must be redis://", "run.redis_url")
    assert "hunter2" not in line


def test_scorer_alone_redis_url_naming_a_replica(tmp_path, redis_server):
    """A URL that names a replica (a failover moved the primary, and the URL names a server, not
    a name that follows the primary) is refused at once, not after bus.reconnect_max_s of
    refused writes."""
    with EmbeddedRedis(tmp_path / "replica") as replica:
        admin = redis.Redis.from_url(replica.url)
        admin.replicaof("127.0.0.1", redis_server.port)
        r = tether(tmp_path, "scorer", "--redis-url", replica.url)
        admin.replicaof("NO", "ONE")
        admin.close()
    refused(r, tmp_path, "tether scorer", "is a replica of", "point the URL at the primary")


def test_generator_alone_tokenizer_without_chat_template(tmp_path, model, redis_server):
    base = tmp_path / "base-tok"
    base.mkdir()
    for f in model.glob("tokenizer*"):
        doc = f.read_text()
        if f.name == "tokenizer_config.json":
            doc = json.dumps({k: v for k, v in json.loads(doc).items() if k != "chat_template"})
        (base / f.name).write_text(doc)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    r = tether(tmp_path, "generator", "--model", str(model), "--redis-url", redis_server.url,
               "--set", f"run.tokenizer={json.dumps(str(base))}")  # fmt: skip
    refused(r, tmp_path, "no chat template", "data.apply_chat_template = false",
            within_s=TOKENIZER_S)  # fmt: skip


def test_scorer_alone_missing_solver_model(tmp_path, redis_server):
    r = tether(tmp_path, "scorer", "--redis-url", redis_server.url, "--set", 'scorer.mode="solver"',
               "--set", 'scorer.solver_model="/nonexistent/solver"')  # fmt: skip
    refused(r, tmp_path, "scorer.solver_model = '/nonexistent/solver' does not exist")


def test_a_service_that_refuses_later_stops_the_run_with_exit_2_and_its_reason(tmp_path):
    """Past the preflight, a service exiting 2 still ends `tether train` with code 2 and the
    service's own one-line reason, not only a pointer to its log."""
    cfg = load_config(env={}).config
    sup = Supervisor(cfg, tmp_path, redis_url="redis://127.0.0.1:1/0", config_path=tmp_path / "c")
    sup.learner.log_path.parent.mkdir(parents=True)
    sup.learner.log_path.write_text(
        "12:00:00 INFO x: starting\ntether learner: cannot start: data.train_path = 'x' ...\n"
    )
    with pytest.raises(RunFailed) as err:
        sup._on_exit(sup.learner, 2)
    assert err.value.exit_code == 2
    assert "tether learner: cannot start: data.train_path = 'x'" in str(err.value)
