"""The policy's weights going out to the generators: rank 0 hosts the weight store and sends
every version (``common.weights.publisher``), and records it in Redis, where the generators
watch for it (``weights:publishing`` before the send, the chain epoch and the learner's version
after it).

A publish is streamed: every rank gathers the units it asks for (a collective,
``gather.stream_publish``) and rank 0 sends each while the next is gathered, so rank 0 never
holds the model. Rank 0 holds a ``WeightPublishing``, the other ranks a ``NoPublishing`` (no
session: they only gather)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from common.config.shared import WeightsConfig
from common.ports import free_port
from common.protocol import streams
from common.weights.handshake import secret_from_env
from common.weights.publisher import WeightPublisher
from services.learner.metrics import LearnerMetrics

if TYPE_CHECKING:
    from common.bus.client import Bus

log = logging.getLogger(__name__)


class WeightPublishing:
    def __init__(self, w: WeightsConfig, *, bus: Bus) -> None:
        self.bus, self.metrics = bus, LearnerMetrics()
        self.publisher = WeightPublisher(
            w.host,
            w.port or free_port(),
            backend=w.backend,  # "auto" is settled at load (gloo)
            timeout_s=w.timeout_s,
            min_gb_per_s=w.min_gb_per_s,
            bucket_bytes=int(w.bucket_mb * 2**20),
            fanout=w.fanout,
            slow_link_fraction=w.slow_link_fraction,
            chunk_bytes=int(w.chunk_mb * 2**20),
            secret=secret_from_env(),  # only holders of the run's secret join (handshake.py)
        )
        self.bus.set(streams.WEIGHTS_ADDR, f"{w.host}:{self.publisher.port}")
        log.info("weight store on %s:%d", w.host, self.publisher.port)

    def begin(self, specs: list, version: int, *, catch_up: bool = False) -> Any:
        """Start the streamed publish of ``version`` (``specs``: each tensor's name, dtype and
        shape); with ``catch_up``, of the latest version again to the generators that joined
        since (``None`` when none needs it)."""
        if catch_up:
            return self.publisher.begin_catch_up()
        self.bus.set(streams.WEIGHTS_PUBLISHING, version)  # generators watch this key
        return self.publisher.begin(specs, version)

    def publish_whole(self, state: dict[str, Any], version: int) -> None:
        """A small update held whole in memory (a LoRA adapter), kept by the publisher so that
        it serves the generators that join later itself (``WeightPublisher.publish``)."""
        self.bus.set(streams.WEIGHTS_PUBLISHING, version)
        report = self.publisher.publish(state.items(), version)
        self._recorded(report, version, "published")

    def catch_up_due(self) -> bool:
        """A generator joined since the last publish and waits for the current weights."""
        return bool(self.publisher.behind())

    def joined(self) -> int:
        """Generators in the weight sync now."""
        return len(self.publisher.members())

    def finish(self, session: Any, version: int, *, catch_up: bool = False) -> None:
        if session is None:
            return
        self._recorded(session.close(), version, "caught up" if catch_up else "published")

    def _recorded(self, report: Any, version: int, what: str) -> None:
        if what == "published":
            self.bus.set(streams.WEIGHTS_EPOCH, report.epoch)
            self.bus.set(streams.LEARNER_VERSION, version)
            self.metrics.version.set(version)
        bad = {k: v for k, v in report.per_member.items() if v != "ok"}
        log.info(
            "%s v%d (%.1f MB in %.2f s; %.1f MB out of this rank, chain epoch %d) "
            "to %d generator(s)%s%s",
            what,
            version,
            report.bytes / 1e6,
            report.seconds,
            report.root_bytes / 1e6,
            report.epoch,
            len(report.per_member),
            f"; failed: {bad}" if bad else "",
            f"; behind a slow link, sent it in the background: {report.slow}"
            if report.slow
            else "",
        )

    def close(self) -> None:
        self.publisher.close()


class NoPublishing:
    """A rank other than 0: it gathers what rank 0's publish asks for and sends nothing."""

    def begin(self, specs: list, version: int, *, catch_up: bool = False) -> None:
        return None

    def publish_whole(self, state: dict[str, Any], version: int) -> None:
        pass

    def catch_up_due(self) -> bool:
        return False

    def joined(self) -> int:
        return 0

    def finish(self, session: Any, version: int, *, catch_up: bool = False) -> None:
        pass

    def close(self) -> None:
        pass
