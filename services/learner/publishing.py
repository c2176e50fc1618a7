"""The policy's weights going out to the generators: rank 0 hosts the weight store and sends
every version (``common.weights.publisher``), and records it in Redis, where the generators
watch for it (``weights:publishing`` before the send, the chain epoch and the learner's version
after it).

Every rank takes part in gathering the full state dict (a collective, in ``loop.py``); rank 0
holds a ``WeightPublishing`` and sends it, the other ranks hold a ``NoPublishing``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from common.config.schema import TetherConfig
from common.ports import free_port
from common.protocol import streams
from services.learner.metrics import LearnerMetrics

if TYPE_CHECKING:
    from common.bus.client import Bus

log = logging.getLogger(__name__)


class WeightPublishing:
    def __init__(self, cfg: TetherConfig, *, bus: Bus) -> None:
        from common.weights.publisher import WeightPublisher

        w = cfg.weights
        self.bus, self.metrics = bus, LearnerMetrics()
        self.publisher = WeightPublisher(
            w.host,
            w.port or free_port(),
            backend=w.backend,  # "auto" is settled at load (gloo)
            timeout_s=w.timeout_s,
            bucket_bytes=int(w.bucket_mb * 2**20),
            fanout=w.fanout,
            chunk_bytes=int(w.chunk_mb * 2**20),
        )
        self.bus.set(streams.WEIGHTS_ADDR, f"{w.host}:{self.publisher.port}")
        log.info("weight store on %s:%d", w.host, self.publisher.port)

    def publish(self, state: dict[str, Any], version: int) -> None:
        self.bus.set(
            streams.WEIGHTS_PUBLISHING, version
        )  # generators watch this key, not the store
        report = self.publisher.publish(state.items(), version)
        self.bus.set(streams.WEIGHTS_EPOCH, report.epoch)
        self.bus.set(streams.LEARNER_VERSION, version)
        self.metrics.version.set(version)
        bad = {k: v for k, v in report.per_member.items() if v != "ok"}
        log.info(
            "published v%d (%.1f MB in %.2f s; %.1f MB out of this rank, chain epoch %d) "
            "to %d generator(s)%s",
            version,
            report.bytes / 1e6,
            report.seconds,
            report.root_bytes / 1e6,
            report.epoch,
            len(report.per_member),
            f"; failed: {bad}" if bad else "",
        )

    def close(self) -> None:
        self.publisher.close()


class NoPublishing:
    """A rank other than 0: it helped gather the state dict and sends nothing."""

    def publish(self, state: dict[str, Any], version: int) -> None:
        pass

    def close(self) -> None:
        pass
