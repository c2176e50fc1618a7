"""A named member of a consumer group: its own pending entries first (after a restart), then
entries idle too long elsewhere (claims), then new ones; undecodable or too-often-delivered
entries go to the dead-letter stream with the reason.

``Consumer(bus, stream, group, name)`` joins the group (creating it if needed). The consumer
knows the bus; the bus knows nothing of consumers (``Bus.commit`` is what ``commit`` calls)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from common.bus.dead_letters import position_fields
from common.bus.settings import decode_str, is_nogroup
from common.protocol import streams, wire

if TYPE_CHECKING:
    from common.bus.client import Bus

log = logging.getLogger(__name__)
DEAD_RAW_BYTES = 4096  # raw bytes kept in a dead-letter entry


@dataclass
class Delivery:
    """One decoded entry handed to a consumer. ``deliveries`` counts deliveries so far."""

    entry_id: str
    msg: wire.Message
    deliveries: int
    num_bytes: int = 0


@dataclass
class Consumer:
    """A named member of a consumer group: own pending first, then claims, then new entries."""

    bus: Bus
    stream: str
    group: str
    name: str
    _draining: bool = True
    _pending_cursor: str = "0"
    _claim_cursor: str = "0-0"
    _next_claim_at: float = 0.0
    dead_letters: int = field(default=0)

    def __post_init__(self) -> None:
        self.bus.ensure_group(self.stream, self.group)
        # Series at 0 from the start (dashboards show 0, not "No data"; increase() sees the first)
        m, sg = self.bus.metrics, (self.stream, self.group)
        for counter in (m.consumed, m.consumed_bytes, m.claimed):
            counter.labels(*sg)
        for reason in (*wire.ERROR_REASONS, "max_deliveries"):
            m.dead.labels(*sg, reason)

    def read(self, count: int = 16, block_ms: int | None = None) -> list[Delivery]:
        """Up to ``count`` decoded deliveries; [] after ``block_ms`` (default settings.block_ms)."""
        try:
            raw = self._read_raw(
                count, self.bus.settings.block_ms if block_ms is None else block_ms
            )
        except redis.ResponseError as e:
            if not is_nogroup(e):
                raise
            self.bus.recreate_group(self.stream, self.group, e)
            self._draining, self._pending_cursor, self._claim_cursor = True, "0", "0-0"
            return []
        return [d for d in (self._decode(*r) for r in raw) if d is not None]

    def _read_raw(self, count: int, block_ms: int) -> list[tuple[str, Any, int]]:
        if self._draining:
            entries = self._xread(self._pending_cursor, count, None)
            if entries:
                self._pending_cursor = entries[-1][0]
                return self._with_counts(entries)
            self._draining = False
        if time.monotonic() >= self._next_claim_at:
            entries = self._autoclaim(count)
            if entries:
                self.bus.metrics.claimed.labels(self.stream, self.group).inc(len(entries))
                return self._with_counts(entries)
        return [(i, f, 1) for i, f in self._xread(">", count, block_ms)]

    def _xread(self, start: str, count: int, block_ms: int | None) -> list[tuple[str, Any]]:
        key = self.bus.key(self.stream)
        reply = self.bus.call(
            lambda: self.bus.redis.xreadgroup(self.group, self.name, {key: start}, count, block_ms),
            what="XREADGROUP",
        )
        return [(decode_str(i), f) for _, entries in (reply or []) for i, f in entries]

    def _autoclaim(self, count: int) -> list[tuple[str, Any]]:
        idle = self.bus.settings.claim_idle_ms
        key = self.bus.key(self.stream)
        cursor, entries, *_ = self.bus.call(
            lambda: self.bus.redis.xautoclaim(
                key, self.group, self.name, idle, self._claim_cursor, count
            ),
            what="XAUTOCLAIM",
        )
        self._claim_cursor = decode_str(cursor)
        if self._claim_cursor == "0-0":  # scan complete: look again after a fraction of idle
            self._next_claim_at = time.monotonic() + min(idle / 4000, 10.0)
        return [(decode_str(i), f) for i, f in entries]

    def _with_counts(self, entries: list[tuple[str, Any]]) -> list[tuple[str, Any, int]]:
        key = self.bus.key(self.stream)
        lo, hi = entries[0][0], entries[-1][0]
        rows = self.bus.call(
            lambda: self.bus.redis.xpending_range(
                key, self.group, lo, hi, 4 * len(entries) + 64, self.name
            ),
            what="XPENDING",
        )
        counts = {decode_str(r["message_id"]): int(r["times_delivered"]) for r in rows}
        return [(i, f, counts.get(i, 1)) for i, f in entries]

    def _decode(self, entry_id: str, fields: Any, deliveries: int) -> Delivery | None:
        raw = (fields or {}).get(streams.PAYLOAD_FIELD)
        try:
            if deliveries > self.bus.settings.max_deliveries:
                raise _Dead(
                    "max_deliveries",
                    f"delivered {deliveries} times",
                    _decoded(raw, self.bus.settings.max_message_bytes),
                )
            if raw is None:
                raise wire.WireError("undecodable", "entry has no payload field (or was deleted)")
            msg = wire.decode(raw, max_bytes=self.bus.settings.max_message_bytes)
        except (wire.WireError, _Dead) as e:
            known = e.msg if isinstance(e, _Dead) else None
            self._dead_letter(entry_id, e.reason, e.detail, raw or b"", deliveries, msg=known)
            return None
        self.bus.metrics.consumed.labels(self.stream, self.group).inc()
        self.bus.metrics.consumed_bytes.labels(self.stream, self.group).inc(len(raw))
        return Delivery(entry_id, msg, deliveries, len(raw))

    def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        """Move a decoded entry the service cannot process (e.g. unscorable) to the dead-letter
        stream with ``reason`` and ack it, atomically. ``ref`` names the message's id."""
        raw = wire.encode(delivery.msg)
        self._dead_letter(
            delivery.entry_id, reason, detail, raw, delivery.deliveries, msg=delivery.msg
        )

    def _dead_letter(self, entry_id: str, reason: str, detail: str, raw: bytes, n: int,
                     *, msg: wire.Message | None = None) -> None:  # fmt: skip
        log.warning(
            "bus: dead-lettering %s %s (%s: %s)",
            self.bus.key(self.stream),
            entry_id,
            reason,
            detail,
        )
        fields = {
            "reason": reason, "detail": detail[:500], "stream": self.stream, "entry_id": entry_id,
            "group": self.group, "consumer": self.name, "deliveries": n,
            "service": self.bus.service, "at": time.time(), "raw": raw[:DEAD_RAW_BYTES],
            **position_fields(msg),
        }  # fmt: skip

        def tx() -> None:
            pipe = self.bus.redis.pipeline(transaction=True)
            pipe.xadd(self.bus.key(streams.DEAD), fields)
            pipe.xack(self.bus.key(self.stream), self.group, entry_id)
            pipe.execute()

        self.bus.call(tx, what="dead-letter MULTI/EXEC")
        self.dead_letters += 1
        self.bus.metrics.dead.labels(self.stream, self.group, reason).inc()

    def commit(self, deliveries: Sequence[Delivery], *,
               publish: Sequence[tuple[str, wire.Message]] = (),
               dedupe_ids: Sequence[str] | None = None,
               count_as: str | None = None) -> int:  # fmt: skip
        """Atomically: publish each message whose dedupe id is new, mark ids done, XACK all
        (and add what was published to generator ``count_as``'s run-long count).

        ``dedupe_ids[i]`` gates ``publish[i]``; with no ``publish``, ids are only marked done.
        Returns how many messages were published (the rest were duplicates).
        """
        ids = [d.entry_id for d in deliveries]
        return self.bus.commit(
            self.group, self.stream, ids, publish=publish, dedupe_ids=dedupe_ids, count_as=count_as
        )

    def ack(self, deliveries: Sequence[Delivery]) -> int:
        ids = [d.entry_id for d in deliveries]
        if not ids:
            return 0
        key = self.bus.key(self.stream)
        return int(self.bus.call(lambda: self.bus.redis.xack(key, self.group, *ids), what="XACK"))

    def is_done(self, dedupe_id: str) -> bool:
        return self.bus.is_done(self.group, dedupe_id)

    def refresh_claims(self, entry_ids: set[str], *, min_idle_ms: int) -> int:
        """Reset the idle time of entries this consumer is still working on (XCLAIM to itself),
        so that peers do not take them over. Only entries the group still lists as this
        consumer's, idle for at least ``min_idle_ms``, are touched: one a peer claimed a moment
        ago (idle ~0) is never taken back. Returns how many were refreshed."""
        key, r = self.bus.key(self.stream), self.bus.redis
        rows = self.bus.call(
            lambda: r.xpending_range(key, self.group, "-", "+", 10_000, self.name),
            what="XPENDING",
        )
        ours = [row["message_id"] for row in rows if decode_str(row["message_id"]) in entry_ids]
        if ours:
            self.bus.call(
                lambda: r.xclaim(key, self.group, self.name, min_idle_ms, ours, justid=True),
                what="XCLAIM",
            )
        return len(ours)


def _decoded(raw: bytes | None, max_bytes: int) -> wire.Message | None:
    try:
        return wire.decode(raw, max_bytes=max_bytes) if raw is not None else None
    except wire.WireError:
        return None


class _Dead(Exception):
    def __init__(self, reason: str, detail: str, msg: wire.Message | None = None) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.msg = reason, detail, msg
