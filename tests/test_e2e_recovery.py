"""SIGKILL a generator, a scorer and the learner in the middle of a real run: the launcher
restarts each, the run completes, nothing is trained twice and nothing is lost."""

from __future__ import annotations

import pytest

from tests.e2e_support import leftover_processes, run_training, write_config

pytestmark = pytest.mark.slow

CYCLES, PROMPTS, RESPONSES = 6, 4, 4


def test_kill_generator_scorer_and_learner_mid_run(redis_server, tmp_path):
    from common.demo import prepare_assets

    assets = prepare_assets(tmp_path.parent / "e2e-assets-recovery", preset="ci")
    config = write_config(
        tmp_path / "r.toml",
        name="recovery",
        model=str(assets.model_dir),
        data_dir=assets.data_dir,
        run_dir=tmp_path / "runs",
        cycles=CYCLES,
    )
    r = run_training(
        config,
        redis_url=redis_server.url,
        name="recovery",
        kill_plan=[("generator-0", 1), ("scorer-0", 2), ("learner-0", 3)],
    )
    assert r.returncode == 0, r.output[-4000:]
    assert sorted(r.killed) == ["generator-0", "learner-0", "scorer-0"]
    for name in ("generator-0", "scorer-0", "learner"):
        assert f"{name} exited with code" in r.output  # the launcher saw it die and restarted it
    # The SIGKILLed services' children (vLLM's engine core, grader workers) were killed too.
    assert leftover_processes(redis_server.url) == []

    # Every step ran; a step redone after the learner's restart trained the same batch.
    by_step: dict[int, set[str]] = {}
    for s in r.steps:
        by_step.setdefault(s["step"], set()).add(s["batch_digest"])
    assert sorted(by_step) == list(range(1, CYCLES + 1))
    assert all(len(d) == 1 for d in by_step.values()), by_step

    # Exactly once: the restored counters plus what ran after the restart cover every response.
    learner = next(d for d in r.status.values() if d["service"] == "learner")
    assert learner["version"] == CYCLES
    c = learner["counters"]
    assert (
        c["trained_samples"] + c.get("dropped_stale", 0) + c.get("filtered_samples", 0)
        == CYCLES * PROMPTS * RESPONSES
    )
