"""A 2-rank learner under `tether train`: the launcher starts torchrun (through
``tether.runs.supervised``), rank 0 is SIGKILLed mid-run, torchrun takes the other rank down, the
launcher restarts the learner, and it resumes from its checkpoint with nothing trained twice.
Checkpoints are sharded and asynchronous (``learner.async_checkpoint``): entries are acknowledged
only once a save is on disk, whichever moment the SIGKILL lands."""

from __future__ import annotations

import pytest

from tests.e2e_support import (
    assert_trained_exactly_once,
    leftover_processes,
    recovery_config,
    run_training,
)

pytestmark = pytest.mark.slow

# 8 cycles: the kill at step 2 must land while the run goes on. The learner's step is read from
# its status heartbeat (every 2 s), polled here every 0.25 s; with 4 cycles (polled every 1 s) a
# fresh-clone run ended with nothing killed
CYCLES, PROMPTS, RESPONSES = 8, 4, 4


def test_two_rank_learner_survives_losing_rank_0(redis_server, tmp_path):
    config = recovery_config(
        tmp_path, "ranks", cycles=CYCLES,
        learner_extra="nproc_per_node = 2\nmicro_batch_size = 4\nasync_checkpoint = true",
        # 8 responses per rank
    )  # fmt: skip
    r = run_training(config, redis_url=redis_server.url, name="ranks", kill_plan=[("learner-0", 2)],
                     poll_s=0.25)  # fmt: skip
    assert r.returncode == 0, r.output[-4000:]
    assert r.killed == ["learner-0"]
    assert "learner exited with code" in r.output  # torchrun gave up on its group; restarted
    assert leftover_processes(redis_server.url) == []
    assert_trained_exactly_once(r, cycles=CYCLES, responses=CYCLES * PROMPTS * RESPONSES)
