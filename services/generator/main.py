"""Entry of `tether generator`: one vLLM engine serving prompts from the bus (see loop.py)."""

from __future__ import annotations

from common.config.schema import TetherConfig
from common.service.serve import serve_async, service_id


def main(cfg: TetherConfig, args) -> int:
    from common.service.preflight import check_server, preflight

    preflight(cfg, "generator")  # model, tokenizer, Redis: exit 2 before the engine starts
    from services.generator.loop import GeneratorService

    sid = service_id("generator", getattr(args, "service_id", None))
    svc = GeneratorService(cfg, sid=sid)
    check_server(svc.bus)  # an evicting maxmemory-policy: exit 2 before the engine starts

    def cleanup() -> None:
        engine = getattr(svc, "engine", None)
        if engine is not None:
            engine.shutdown()

    return serve_async(
        svc,
        "generator",
        sid,
        cfg.generator.metrics_port,
        num_cycles=cfg.run.num_cycles,
        cleanup=cleanup,
    )
