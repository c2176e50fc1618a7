"""Entry of `tether scorer`: batched math-verify / solver rewards from the bus (see loop.py)."""

from __future__ import annotations

from common.config.schema import TetherConfig
from common.service.preflight import check_server, preflight
from common.service.serve import serve_async, service_id
from common.service.settings import bus_settings_for, solver_engine_settings
from services.scorer.loop import ScorerService
from services.scorer.rewards import RewardSpec
from services.scorer.settings import ScorerSettings
from services.scorer.solver import SolverSettings


def scorer_settings(cfg: TetherConfig, *, redis_url: str | None = None) -> ScorerSettings:
    """The scorer's settings from the run's config (the cycle rules already applied): the bus,
    the graders, the reward, and in solver mode the solver and its engine (its model directory
    checked on disk)."""
    s, run = cfg.scorer, cfg.run
    rewards = RewardSpec(
        correct_weight=s.correct_weight,
        format_weight=s.format_weight,
        overlong_penalty=s.overlong_penalty if s.overlong_buffer_tokens > 0 else 0.0,
        overlong_buffer_tokens=s.overlong_buffer_tokens,
        max_response_tokens=run.max_response_tokens,
        tool_error_penalty=s.tool_error_penalty,
        custom=s.custom_reward or None,
        fallbacks=tuple(s.answer_fallbacks),
        answer_form=s.answer_form,
    )
    solver = engine = None
    if s.mode == "solver":
        engine = solver_engine_settings(cfg)
        solver = SolverSettings(
            model=engine.model,
            template=s.solver_template,
            samples=s.solver_samples,
            aggregation=s.solver_aggregation,
            temperature=s.solver_temperature,
            max_tokens=s.solver_max_tokens,
            max_model_len=engine.max_model_len,
            answer_form=s.answer_form,
        )
    return ScorerSettings(
        bus=bus_settings_for(cfg, redis_url=redis_url),
        mode=s.mode,
        grader_workers=s.grader_workers,
        grader_timeout_s=s.grader_timeout_s,
        liveness_s=s.liveness_s,
        rewards=rewards,
        solver=solver,
        solver_engine_settings=engine,
    )


def main(cfg: TetherConfig, args) -> int:
    preflight(cfg, "scorer")  # solver model (solver mode), Redis: exit 2 before workers start

    sid = service_id("scorer", getattr(args, "service_id", None))
    svc = ScorerService(scorer_settings(cfg), sid=sid)
    check_server(svc.bus)  # an evicting maxmemory-policy: exit 2 before workers start
    return serve_async(svc, "scorer", sid, cfg.scorer.metrics_port, num_cycles=cfg.run.num_cycles)
