"""When the learner checkpoints: every ``learner.checkpoint_every_steps`` optimizer steps, and at
the first cycle end ``learner.checkpoint_every_minutes`` (default 30) after the last checkpoint,
whichever comes first; and always at the end.

Why a time default. The learner acknowledges a scored group only once a checkpoint holds its
training, so the cadence bounds three things at once: the training a restart repeats, the scored
groups Redis keeps pending (memory: the groups trained in one interval, `tether plan` prints the
figure), and how often a learner restart reads them again. Time bounds the first two the same
way for a tiny model (a cycle a second) and a large one (a cycle a minute or more), where a step
count suits only one of them; 30 minutes keeps the cost of writing a checkpoint of a multi-billion
parameter model (tens of GB at ~1 GB/s: under a minute) to a few percent of the run. The old
default, "only at the end", let pending groups and Redis memory grow with the run's length
(~6 GB after 1,000 cycles of the seed 001 shape) and made every restart retrain from step 0.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from services.learner.dist import broadcast_int

if TYPE_CHECKING:
    import torch

    from common.config.learner import LearnerConfig


class CheckpointCadence:
    def __init__(self, ln: LearnerConfig) -> None:
        self.every_steps, self.every_minutes = (
            ln.checkpoint_every_steps,
            ln.checkpoint_every_minutes,
        )
        self.last = time.monotonic()

    def saved(self) -> None:
        self.last = time.monotonic()

    def due(self, *, version: int, before: int, device: torch.device) -> bool:
        """After a cycle that took the policy from version ``before`` to ``version``; rank 0's
        clock decides for every rank (a collective when the time rule is on)."""
        every = self.every_steps
        due = bool(every) and version // every > before // every
        if self.every_minutes:
            late = time.monotonic() - self.last >= self.every_minutes * 60
            due = bool(broadcast_int(int(due or late), device))
        return due
