"""A named member of a consumer group: its own pending entries first (after a restart), then
entries idle too long elsewhere (claims), then new ones; undecodable entries, and entries that
made their consumer fail ``bus.max_deliveries`` times (``strikes.py``: redelivery alone is not
poison), go to the dead-letter stream with the reason.

``Consumer(bus, stream, group, name)`` joins the group (creating it if needed). The consumer
knows the bus; the bus knows nothing of consumers (``Bus.commit`` is what ``commit`` calls)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from common.bus.dead_letters import dead_letter_fields
from common.bus.settings import decode_str, is_nogroup
from common.bus.strikes import SUSPECT_AT, Strikes
from common.protocol import streams, wire

if TYPE_CHECKING:
    from common.bus.client import Bus

log = logging.getLogger(__name__)
Raw = tuple[str, Any, int, int]  # entry id, fields, Redis deliveries, strikes


@dataclass
class Delivery:
    """One decoded entry handed to a consumer. ``deliveries`` counts Redis's deliveries so far,
    ``strikes`` the times a consumer failed while holding it (``strikes.py``)."""

    entry_id: str
    msg: wire.Message
    deliveries: int
    num_bytes: int = 0
    strikes: int = 0


@dataclass
class Consumer:
    """A named member of a consumer group: own pending first, then claims, then new entries.

    ``claims``: take over peers' entries idle for ``bus.claim_idle_s`` (off for a group with one
    consumer that holds entries on purpose: it would "claim" its own). ``track_strikes``: mark
    what it works on, so that a failure while holding an entry counts against the entry (off for
    such a holder too: its restarts must never count against its data). ``lapsing``: set while
    the holder lets the claims on what it holds lapse on purpose (a generator cut off from the
    weights: ``services.generator.claims``); it then takes no idle entries at all, since its own
    XAUTOCLAIM would claim back the very entries it lets lapse, before a peer could."""

    bus: Bus
    stream: str
    group: str
    name: str
    claims: bool = True
    track_strikes: bool = True
    lapsing: bool = False
    _draining: bool = True
    _pending_cursor: str = "0"
    _claim_cursor: str = "0-0"
    _next_claim_at: float = 0.0
    dead_letters: int = field(default=0)
    _in_hand: set[str] = field(default_factory=set)  # taken, not yet committed/acked/let go
    _suspects: deque[Raw] = field(default_factory=deque)  # taken alone, one at a time
    _alone: str | None = None  # the suspect in hand, if any
    _losses_seen: int = 0  # the bus's connection losses when its own pending was last read

    def __post_init__(self) -> None:
        self.bus.ensure_group(self.stream, self.group)
        # Series at 0 from the start (dashboards show 0, not "No data"; increase() sees the first)
        m, sg = self.bus.metrics, (self.stream, self.group)
        for counter in (m.consumed, m.consumed_bytes, m.claimed, m.strikes):
            counter.labels(*sg)
        for reason in (*wire.ERROR_REASONS, "max_deliveries"):
            m.dead.labels(*sg, reason)
        self._marks = Strikes(self.bus, self.stream, self.group) if self.track_strikes else None
        self._losses_seen = self.bus.connection_losses

    def read(self, count: int = 16, block_ms: int | None = None) -> list[Delivery]:
        """Up to ``count`` decoded deliveries; [] after ``block_ms`` (default settings.block_ms).
        While a suspect is queued or in hand, nothing else is taken (``strikes.py``)."""
        block = self.bus.settings.block_ms if block_ms is None else block_ms
        if self._alone in self._in_hand or (self._suspects and self._in_hand):
            time.sleep(min(block, 100) / 1000)  # finish what is in hand first
            return []
        try:
            raw = [self._take_suspect()] if self._suspects else self._read_raw(count, block)
        except redis.ResponseError as e:
            if not is_nogroup(e):
                raise
            self.bus.recreate_group(self.stream, self.group, e)
            self._draining, self._pending_cursor, self._claim_cursor = True, "0", "0-0"
            return []
        return [d for d in (self._decode(*r) for r in raw) if d is not None]

    def _read_raw(self, count: int, block_ms: int) -> list[Raw]:
        losses = self.bus.connection_losses
        if losses != self._losses_seen and not self.lapsing:
            self._losses_seen = losses
            if not self._draining:
                log.info(
                    "bus: connection to Redis lost and back; reading %s's own pending entries of "
                    "%s again (a read whose reply was lost leaves them delivered but unseen)",
                    self.name, self.bus.key(self.stream),
                )  # fmt: skip
                self._draining, self._pending_cursor = True, "0"
        if self._draining:
            entries = self._xread(self._pending_cursor, count, None)
            if entries:
                self._pending_cursor = entries[-1][0]
                fresh = [e for e in entries if e[0] not in self._in_hand]  # not taken twice
                return self._struck(self._with_counts(fresh)) if fresh else []
            self._draining = False
        if self.claims and not self.lapsing and time.monotonic() >= self._next_claim_at:
            # its own entries idle that long are in hand here (a slow batch): not taken twice
            entries = [e for e in self._autoclaim(count) if e[0] not in self._in_hand]
            if entries:
                self.bus.metrics.claimed.labels(self.stream, self.group).inc(len(entries))
                return self._struck(self._with_counts(entries))
        return self._struck([(i, f, 1) for i, f in self._xread(">", count, block_ms)])

    def _struck(self, entries: list[tuple[str, Any, int]]) -> list[Raw]:
        """Take ``entries`` in hand, counting a strike for each that still was (its holder
        failed); suspects are queued to be taken alone, entries struck out go on to be
        dead-lettered."""
        if self._marks is None:
            return [(i, f, n, 0) for i, f, n in entries]
        struck = self._marks.take(self.name, [i for i, _, _ in entries])
        out: list[Raw] = []
        limit = self.bus.settings.max_deliveries
        for (i, f, n), k in zip(entries, struck, strict=True):
            if k > 0:
                self.bus.metrics.strikes.labels(self.stream, self.group).inc()
            if SUSPECT_AT <= k < limit:
                self._suspects.append((i, f, n, k))
            else:
                out.append((i, f, n, k))
        if self._suspects:
            log.warning(
                "bus: %d entr(ies) of %s were in hand at %d or more failures of their consumer; "
                "taking each alone (the others in that batch go on)",
                len(self._suspects), self.bus.key(self.stream), SUSPECT_AT,
            )  # fmt: skip
        return out

    def _take_suspect(self) -> Raw:
        raw = self._suspects.popleft()
        assert self._marks is not None
        self._marks.mark(self.name, raw[0])
        self._alone = raw[0]
        return raw

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

    def _decode(self, entry_id: str, fields: Any, deliveries: int, strikes: int) -> Delivery | None:
        raw = (fields or {}).get(streams.PAYLOAD_FIELD)
        try:
            if strikes >= self.bus.settings.max_deliveries:
                raise _Dead(
                    "max_deliveries",
                    f"its consumer failed {strikes} times while holding it (crashed, was killed "
                    f"or held it past bus.claim_idle_s); delivered {deliveries} times",
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
        self._in_hand.add(entry_id)
        return Delivery(entry_id, msg, deliveries, len(raw), strikes)

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
        fields = dead_letter_fields(
            reason=reason, detail=detail, stream=self.stream, entry_id=entry_id,
            group=self.group, consumer=self.name, deliveries=n, service=self.bus.service,
            raw=raw, msg=msg, max_bytes=self.bus.settings.max_message_bytes,
        )  # fmt: skip

        def tx() -> None:
            pipe = self.bus.redis.pipeline(transaction=True)
            pipe.xadd(self.bus.key(streams.DEAD), fields)
            pipe.xack(self.bus.key(self.stream), self.group, entry_id)
            self._unmark(pipe, [entry_id])
            pipe.execute()

        self.bus.call(tx, what="dead-letter MULTI/EXEC")
        self._done([entry_id])
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
        n = self.bus.commit(
            self.group, self.stream, ids, publish=publish, dedupe_ids=dedupe_ids, count_as=count_as
        )
        self._done(ids)
        return n

    def ack(self, deliveries: Sequence[Delivery]) -> int:
        ids = [d.entry_id for d in deliveries]
        if not ids:
            return 0
        key = self.bus.key(self.stream)

        def tx() -> Any:
            pipe = self.bus.redis.pipeline(transaction=True)
            pipe.xack(key, self.group, *ids)
            self._unmark(pipe, ids)
            return pipe.execute()[0]

        acked = int(self.bus.call(tx, what="XACK"))
        self._done(ids)
        return acked

    def let_go(self) -> int:
        """Stopping on purpose (SIGTERM): unmark what this consumer holds, so that it comes back
        (to this consumer after a restart, or to a peer after ``bus.claim_idle_s``) without a
        strike. Returns how many entries were let go."""
        held = sorted(self._in_hand)
        if self._marks is not None and held:
            self._marks.let_go(held)
        self._done(held)
        return len(held)

    def _unmark(self, pipe: Any, ids: Sequence[str]) -> None:
        if self._marks is not None:
            pipe.hdel(self._marks.in_hand_key, *ids)
            pipe.hdel(self._marks.strikes_key, *ids)

    def _done(self, ids: Sequence[str]) -> None:
        self._in_hand.difference_update(ids)
        if self._alone in ids:
            self._alone = None

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


def let_go(consumer: Consumer) -> None:
    """``consumer.let_go()`` for a service that is stopping: logged, never raised (Redis may be
    gone; its entries then come back with a strike, which is only a count)."""
    try:
        n = consumer.let_go()
    except Exception as exc:  # noqa: BLE001 - stopping anyway
        log.warning("bus: could not let go of the entries in hand (%s)", exc)
        return
    if n:
        log.info("bus: stopping; let go of %d entr(ies) in hand (no strike)", n)


def _decoded(raw: bytes | None, max_bytes: int) -> wire.Message | None:
    try:
        return wire.decode(raw, max_bytes=max_bytes) if raw is not None else None
    except wire.WireError:
        return None


class _Dead(Exception):
    def __init__(self, reason: str, detail: str, msg: wire.Message | None = None) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.msg = reason, detail, msg
