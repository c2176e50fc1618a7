"""The scorer's own settings: what its loop reads, resolved once from the run's config by its
main (``services.scorer.main.scorer_settings``), so that below the main nothing receives the
whole config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.bus.settings import BusSettings
from common.engine import EngineSettings
from services.scorer.rewards import RewardSpec
from services.scorer.solver import SolverSettings


@dataclass(frozen=True, kw_only=True)
class ScorerSettings:
    bus: BusSettings
    mode: Literal["rule", "solver"]
    grader_workers: int  # math-verify processes
    grader_timeout_s: float  # per answer
    liveness_s: float  # /healthz fails after this long without a read or a scored batch
    rewards: RewardSpec
    solver: SolverSettings | None = None  # solver mode: how the solver asks and grades
    solver_engine_settings: EngineSettings | None = None  # solver mode: the engine it starts
