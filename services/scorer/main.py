"""Entry of `tether scorer`: batched math-verify / solver rewards from the bus (see loop.py)."""

from __future__ import annotations

from common import runtime
from common.config import TetherConfig


def main(cfg: TetherConfig, args) -> int:
    from services.scorer.loop import ScorerService

    if cfg.scorer.mode == "solver" and not cfg.scorer.solver_model:
        from common.model_paths import policy_paths

        policy_paths(cfg)  # the solver defaults to the policy's initial weights
    sid = runtime.service_id("scorer", getattr(args, "service_id", None))
    svc = ScorerService(cfg, sid=sid)
    return runtime.serve_async(svc, "scorer", sid, cfg.scorer.metrics_port)
