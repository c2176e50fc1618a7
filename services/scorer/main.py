"""Entry of `tether scorer`: batched math-verify / solver rewards from the bus (see loop.py)."""

from __future__ import annotations

from common.config.schema import TetherConfig
from common.service.serve import serve_async, service_id


def main(cfg: TetherConfig, args) -> int:
    from common.service.preflight import check_server, preflight

    preflight(cfg, "scorer")  # solver model (solver mode), Redis: exit 2 before workers start
    from services.scorer.loop import ScorerService

    sid = service_id("scorer", getattr(args, "service_id", None))
    svc = ScorerService(cfg, sid=sid)
    check_server(svc.bus)  # an evicting maxmemory-policy: exit 2 before workers start
    return serve_async(svc, "scorer", sid, cfg.scorer.metrics_port, num_cycles=cfg.run.num_cycles)
