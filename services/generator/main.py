"""Entry of `tether generator`: one vLLM engine serving prompts from the bus (see loop.py)."""

from __future__ import annotations

from common import runtime
from common.config import TetherConfig


def main(cfg: TetherConfig, args) -> int:
    from common.model_paths import policy_paths
    from services.generator.loop import GeneratorService

    policy_paths(cfg)  # config errors before the engine starts
    sid = runtime.service_id("generator", getattr(args, "service_id", None))
    svc = GeneratorService(cfg, sid=sid)

    def cleanup() -> None:
        engine = getattr(svc, "engine", None)
        if engine is not None:
            engine.shutdown()

    return runtime.serve_async(svc, "generator", sid, cfg.generator.metrics_port, cleanup=cleanup)
