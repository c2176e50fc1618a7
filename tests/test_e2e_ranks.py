"""A 2-rank learner under `tether train`: the launcher starts torchrun (through
``common.supervised``), rank 0 is SIGKILLed mid-run, torchrun takes the other rank down, the
launcher restarts the learner, and it resumes from its checkpoint with nothing trained twice."""

from __future__ import annotations

import pytest

from tests.e2e_support import leftover_processes, run_training, write_config

pytestmark = pytest.mark.slow

CYCLES, PROMPTS, RESPONSES = 4, 4, 4


def test_two_rank_learner_survives_losing_rank_0(redis_server, tmp_path):
    from common.demo import prepare_assets

    assets = prepare_assets(tmp_path.parent / "e2e-assets-ranks", preset="ci")
    config = write_config(
        tmp_path / "ranks.toml",
        name="ranks",
        model=str(assets.model_dir),
        data_dir=assets.data_dir,
        run_dir=tmp_path / "runs",
        cycles=CYCLES,
        learner_extra="nproc_per_node = 2\nmicro_batch_size = 4",  # 8 responses per rank
    )
    r = run_training(config, redis_url=redis_server.url, name="ranks", kill_plan=[("learner-0", 2)])
    assert r.returncode == 0, r.output[-4000:]
    assert r.killed == ["learner-0"]
    assert "learner exited with code" in r.output  # torchrun gave up on its group; restarted
    assert leftover_processes(redis_server.url) == []

    by_step: dict[int, set[str]] = {}
    for s in r.steps:
        by_step.setdefault(s["step"], set()).add(s["batch_digest"])
    assert sorted(by_step) == list(range(1, CYCLES + 1))
    assert all(len(d) == 1 for d in by_step.values()), by_step  # a redone step: the same batch
    learner = next(d for d in r.status.values() if d["service"] == "learner")
    assert learner["version"] == CYCLES
    c = learner["counters"]
    assert (
        c["trained_samples"] + c.get("dropped_stale", 0) + c.get("filtered_samples", 0)
        == CYCLES * PROMPTS * RESPONSES
    )
