"""Nothing lost when processes die or resources run out, through real runs (`tether train`,
every real service): a generator, a scorer and the learner SIGKILLed mid-run, the learner more
times than bus.max_deliveries, with the default checkpoint cadence; the learner killed between
publish and checkpoint; Redis at maxmemory for 30 s; a disk that fills up during a checkpoint.
Each run completes with nothing dead-lettered, every step trained once (a step redone after a
restart trains the same batch) and the books balanced."""

from __future__ import annotations

import re
import shutil
import time

import pytest
import redis

from common.bus.server import EmbeddedRedis
from services.learner.loop import TEST_ONLY_STEP_DELAY_ENV
from tests.conftest import test_server_binary
from tests.e2e_support import (
    CHECKPOINT_HOOK_ENV,
    KillAtCheckpoints,
    assert_trained_exactly_once,
    books,
    dead_letters,
    leftover_processes,
    recovery_config,
    run_training,
)
from tests.fs_faults import resize, small_tmpfs

pytestmark = pytest.mark.slow

PROMPTS, RESPONSES = 4, 4  # recovery_config's cycle


def _restarts(output: str, service: str) -> int:
    return len(re.findall(rf"{service} exited with code", output))


def test_a_generator_a_scorer_and_the_learner_more_times_than_max_deliveries(
    redis_server, tmp_path
):
    # SIGKILLs mid-run: generator-0 and scorer-0 once each (the launcher restarts them and kills
    # what they left: vLLM's engine core, the grading workers), the learner four times with no
    # checkpoint before the end (the default cadence is 30 minutes; bus.max_deliveries = 3 here,
    # 5 by default). Each learner restart reads its pending groups back from the start (more
    # deliveries than max_deliveries, held longer than bus.claim_idle_s) and trains them again:
    # redelivery is not a strike, so nothing is dead-lettered. (run.crash_window_s = 5: kills
    # more than 5 s apart are not a crash loop, so the launcher restarts after 2 s instead of
    # backing off to 30 s.) Each process is killed once the harness sees it live and the learner
    # at step >= 1; the step delay (a test hook) keeps the learner there long enough: the test
    # model otherwise retrains the whole run within a second of a restart. (This run was two
    # before: six learner kills against the default max_deliveries, and a run with a checkpoint
    # every 2 steps that killed each service once; the kills between a publish and its
    # checkpoint below take the path a checkpoint adds.)
    cycles, learner_kills = 6, 4
    name = "kills"
    config = recovery_config(tmp_path, name, cycles=cycles, checkpoint_every_steps=None,
                             extra="max_deliveries = 3", run_extra="crash_window_s = 5.0")  # fmt: skip
    plan = [("generator-0", 1), ("scorer-0", 1)] + [("learner-0", 1)] * learner_kills
    r = run_training(config, redis_url=redis_server.url, name=name, kill_plan=plan,
                     timeout_s=1200, env={TEST_ONLY_STEP_DELAY_ENV: "2"})  # fmt: skip
    assert r.returncode == 0, r.output[-4000:]
    assert r.killed == [sid for sid, _ in plan], r.output[-6000:]
    assert _restarts(r.output, "learner") == learner_kills, r.output[-6000:]
    for sid in ("generator-0", "scorer-0"):  # the launcher saw it die and restarted it
        assert _restarts(r.output, sid) == 1, r.output[-6000:]
    assert max(r.killed_at_steps) < cycles, r.killed_at_steps  # every kill mid-run
    # the killed services' children (vLLM's engine core, grading workers) were killed too
    assert leftover_processes(redis_server.url) == []
    assert dead_letters(redis_server.url, name) == []
    assert_trained_exactly_once(r, cycles=cycles, responses=cycles * PROMPTS * RESPONSES)
    assert books(r)["unaccounted"] == 0  # killed held-out rounds count as evaluation groups
    assert any(e["eval_round"] == 0 for e in r.evals)  # the v0 accuracy is there


def test_learner_killed_between_publish_and_checkpoint(redis_server, tmp_path):
    # A checkpoint every 2 steps, a publish every step, held-out rounds every 2 steps. Each kill
    # lands inside a checkpoint save, after the version it saves was published: the restarted
    # learner resumes below the version the generators run, often mid-round. Saves 1 (v2), 3
    # (v4) and 5 (v6) are killed; 2, 4, 6 and 7 (the final v8) complete. (Six kills, as
    # before, cost CI 8 minutes for no path these three do not take.)
    cycles = 8
    name = "publish_kills"
    config = recovery_config(tmp_path, name, cycles=cycles, learner_extra="eval_every_steps = 2",
                             run_extra="crash_window_s = 5.0")  # fmt: skip
    kills = KillAtCheckpoints(tmp_path / "runs" / name, {1, 3, 5})
    r = run_training(config, redis_url=redis_server.url, name=name, during=kills,
                     env={CHECKPOINT_HOOK_ENV: "3"}, timeout_s=1200)  # fmt: skip
    assert r.returncode == 0, r.output[-4000:]
    assert kills.killed == [1, 3, 5] and _restarts(r.output, "learner") == 3
    # the scorers dead-lettered responses whose versions went backwards ([[0, v], [k, v-2]])
    assert dead_letters(redis_server.url, name) == []
    assert_trained_exactly_once(r, cycles=cycles, responses=cycles * PROMPTS * RESPONSES)
    assert books(r)["unaccounted"] == 0  # killed held-out rounds count as evaluation groups
    assert any(e["eval_round"] == 0 for e in r.evals)  # the v0 accuracy is there


def test_redis_at_maxmemory_for_30_s_slows_the_run_down_and_loses_nothing(tmp_path):
    binary = shutil.which("redis-server") or test_server_binary()  # Redis 7.0 where installed
    server = EmbeddedRedis(tmp_path / "redis", binary=binary).start()
    admin = redis.Redis.from_url(server.url)
    held: dict[str, float] = {}

    def squeeze(_docs, step: int) -> None:
        if "from" not in held and step >= 2:
            # below what Redis already uses: every write is refused until the hold ends (a few KiB
            # of headroom let a quiet CI machine finish the run inside the hold)
            admin.config_set("maxmemory", 1)
            held["from"] = time.monotonic()
        elif "from" in held and "to" not in held and time.monotonic() - held["from"] >= 30:
            admin.config_set("maxmemory", 0)
            held["to"] = time.monotonic()

    try:
        cycles = 6
        config = recovery_config(tmp_path, "oom", cycles=cycles)
        r = run_training(config, redis_url=server.url, name="oom", during=squeeze,
                         timeout_s=900)  # fmt: skip
        assert r.returncode == 0, r.output[-4000:]
        assert held.get("to"), "the run ended before the 30 s hold"
        assert "exited with code" not in r.output  # no service crashed or exited
        logs = "".join(p.read_text(errors="replace") for p in (r.run_dir / "logs").glob("*.log"))
        assert "Redis is out of memory" in logs and "accepts writes again" in logs
        assert dead_letters(server.url, "oom") == []
        assert_trained_exactly_once(r, cycles=cycles, responses=cycles * PROMPTS * RESPONSES)
        assert books(r)["unaccounted"] == 0
    finally:
        admin.config_set("maxmemory", 0)
        server.stop()


def test_a_full_disk_during_a_checkpoint_stops_the_run_which_resumes_once_freed(
    redis_server, tmp_path
):
    cycles = 6
    config = recovery_config(tmp_path, "diskfull", cycles=cycles)  # ckpt / 2 steps
    ckpts = tmp_path / "runs" / "diskfull" / "checkpoints"
    # room for one checkpoint of the CI model (~6.7 MB), not for two (keep_checkpoints = 2)
    with small_tmpfs(ckpts, 10 * 1024):
        r = run_training(config, redis_url=redis_server.url, name="diskfull", timeout_s=900)
        assert r.returncode == 2, r.output[-4000:]
        said = "learner cannot go on (exit code 2): checkpoint step-4 could not be written to"
        assert said in r.output and "No space left on device" in r.output, r.output[-4000:]
        assert _restarts(r.output, "learner") == 0  # no loop retraining into a full disk
        assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-2"]  # no tmp-*
        resize(ckpts, 64 * 1024)  # space freed
        again = run_training(config, redis_url=redis_server.url, name="diskfull", resume=True,
                             timeout_s=900)  # fmt: skip
    assert again.returncode == 0, again.output[-4000:]
    assert dead_letters(redis_server.url, "diskfull") == []
    # metrics.jsonl holds both runs: steps 3-4 twice, each time the same batch
    assert_trained_exactly_once(again, cycles=cycles, responses=cycles * PROMPTS * RESPONSES)
    assert books(again)["unaccounted"] == 0
    # the resumed learner trained its last steps from what Redis held before its generator was
    # up: the generator joined during the last held-out round and got the weights it needs
    # (before, it got none, and the learner waited 300 s for a round nobody could answer)
    assert again.evals and again.evals[-1]["eval_round"] == cycles, again.evals  # 1 step per cycle
