"""SIGKILL a generator, a scorer and the learner in the middle of a real run: the launcher
restarts each, the run completes, nothing is trained twice and nothing is lost."""

from __future__ import annotations

import pytest

from tests.e2e_support import (
    assert_trained_exactly_once,
    leftover_processes,
    recovery_config,
    run_training,
)

pytestmark = pytest.mark.slow

# enough cycles that the run outlasts the kill plan (6 once ended 2 s after its first step)
CYCLES, PROMPTS, RESPONSES = 12, 4, 4


def test_kill_generator_scorer_and_learner_mid_run(redis_server, tmp_path):
    config = recovery_config(tmp_path, "recovery", cycles=CYCLES)
    r = run_training(
        config,
        redis_url=redis_server.url,
        name="recovery",
        kill_plan=[("generator-0", 1), ("scorer-0", 2), ("learner-0", 3)],
        poll_s=0.25,  # kills in quick succession: polls a second apart once fired one of three
    )
    assert r.returncode == 0, r.output[-4000:]
    assert sorted(r.killed) == ["generator-0", "learner-0", "scorer-0"]
    for name in ("generator-0", "scorer-0", "learner"):
        assert f"{name} exited with code" in r.output  # the launcher saw it die and restarted it
    # The SIGKILLed services' children (vLLM's engine core, grader workers) were killed too.
    assert leftover_processes(redis_server.url) == []

    assert_trained_exactly_once(r, cycles=CYCLES, responses=CYCLES * PROMPTS * RESPONSES)
