"""A 2-rank learner under `tether train`: the launcher starts torchrun (through
``tether.runs.supervised``), rank 0 is SIGKILLed mid-run, torchrun takes the other rank down, the
launcher restarts the learner, and it resumes from its checkpoint with nothing trained twice.
Checkpoints are sharded and asynchronous (``learner.async_checkpoint``): entries are acknowledged
only once a save is on disk, whichever moment the SIGKILL lands. A few steps after the restart
`tether finish` ends the run early: both ranks leave on rank 0's word and finish."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from tests.e2e_support import (
    assert_trained_exactly_once,
    leftover_processes,
    recovery_config,
    run_training,
)
from tether.runs.supervisor import tether_command

pytestmark = pytest.mark.slow

# the kill at step 2 must land while the run goes on (the learner's step is read from its status
# heartbeat, every 2 s, polled here every 0.25 s; with 4 cycles, polled every 1 s, a fresh-clone
# run ended with nothing killed); `tether finish` ends it FINISH_AFTER steps past the restart,
# long before CYCLES
CYCLES, PROMPTS, RESPONSES = 100, 4, 4
FINISH_AFTER = 3


class FinishAfterRestart:
    """A ``run_training(during=...)`` that runs `tether finish` once the learner restarted (a
    process other than the first one seen reports) and is ``FINISH_AFTER`` steps past its
    first report."""

    def __init__(self, config: Any, redis_url: str) -> None:
        self.config, self.url = config, redis_url
        self.first_pid: int | None = None
        self.restarted_at: int | None = None
        self.output = ""

    def __call__(self, docs: list[dict[str, Any]], step: int) -> None:
        learner = next((d for d in docs if d["service"] == "learner" and d.get("pid")), None)
        if learner is None or self.output:
            return
        if self.first_pid is None:
            self.first_pid = learner["pid"]
        elif learner["pid"] != self.first_pid and self.restarted_at is None:
            self.restarted_at = step
        elif self.restarted_at is not None and step >= self.restarted_at + FINISH_AFTER:
            argv = tether_command("finish", "--config", str(self.config), "--redis-url", self.url)
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr[-2000:]
            self.output = done.stdout


def test_two_rank_learner_survives_losing_rank_0_and_finishes_early(redis_server, tmp_path):
    config = recovery_config(
        tmp_path, "ranks", cycles=CYCLES,
        learner_extra="nproc_per_node = 2\nmicro_batch_size = 4\nasync_checkpoint = true",
        # 8 responses per rank
    )  # fmt: skip
    finish = FinishAfterRestart(config, redis_server.url)
    r = run_training(config, redis_url=redis_server.url, name="ranks", kill_plan=[("learner-0", 2)],
                     poll_s=0.25, during=finish)  # fmt: skip
    assert r.returncode == 0, r.output[-4000:]
    assert r.killed == ["learner-0"]
    assert "learner exited with code" in r.output  # torchrun gave up on its group; restarted
    assert "to end early" in finish.output, finish.output
    assert leftover_processes(redis_server.url) == []
    cycles = len({s["step"] for s in r.steps})  # one optimizer step per cycle
    assert cycles < CYCLES, cycles
    assert_trained_exactly_once(r, cycles=cycles, responses=cycles * PROMPTS * RESPONSES)
