"""The trajectory bus: durable, acknowledged Redis Streams carrying ``common.protocol.wire`` messages.

Delivery is at-least-once through consumer groups (XREADGROUP ... XACK); effects are made
exactly-once by ``Consumer.commit``, which in one Lua script publishes downstream messages only
for ids not yet in the group's done-set and then acks the upstream entries. Poison entries go to
``<run>:dead``. Back-pressure is measured (lag + pending per group), never MAXLEN; only the
prefix acknowledged by every group is trimmed. Only Redis 7.0 commands are used.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar
from urllib.parse import urlparse

import redis

from common.protocol import wire

log = logging.getLogger(__name__)
T = TypeVar("T")
PAYLOAD_FIELD = b"m"
DEAD_RAW_BYTES = 4096  # raw bytes kept in a dead-letter entry


@dataclass
class BusSettings:
    """Connection and delivery settings shared by every service's bus client."""

    url: str = "redis://127.0.0.1:6379/0"  # redis:// or rediss:// (TLS), user:password@ allowed
    run: str = "tether"  # namespace: streams are "<run>:<name>"
    block_ms: int = 2_000  # XREADGROUP BLOCK time per read call
    claim_idle_ms: int = 300_000  # take over entries idle this long (> slowest honest work)
    max_deliveries: int = 5  # an entry delivered more often than this is dead-lettered
    max_message_bytes: int = 64 * 1024 * 1024  # larger payloads are refused / dead-lettered
    max_backlog: int = 1_024  # producers wait while a group's lag + pending reaches this
    socket_timeout_s: float = 30.0  # must exceed block_ms, or blocking reads time out
    connect_timeout_s: float = 5.0
    reconnect_max_s: float = 120.0  # give up (raise) after Redis is unreachable this long

    def __post_init__(self) -> None:
        scheme = urlparse(self.url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"bus url {self.url!r}: scheme must be redis://, rediss:// or unix://")
        if not self.run or any(c in self.run for c in ":*?[] "):
            raise ValueError(
                f"bus run {self.run!r}: use a non-empty name without : * ? [ ] or spaces"
            )
        for name in (
            "block_ms",
            "claim_idle_ms",
            "max_deliveries",
            "max_message_bytes",
            "max_backlog",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"bus {name}={getattr(self, name)} must be positive")
        if self.socket_timeout_s * 1000 <= self.block_ms + 1000:
            raise ValueError(
                f"bus socket_timeout_s={self.socket_timeout_s} must exceed block_ms={self.block_ms} "
                "by at least 1 s, or blocking reads time out; raise socket_timeout_s"
            )
        if self.reconnect_max_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("bus reconnect_max_s and connect_timeout_s must be positive")


class BusUnavailable(ConnectionError):
    """Redis stayed unreachable for longer than ``reconnect_max_s``."""


def is_nogroup(e: Exception) -> bool:
    return isinstance(e, redis.ResponseError) and str(e).startswith("NOGROUP")


def make_client(url: str, *, socket_timeout_s: float, connect_timeout_s: float) -> Any:
    """A redis-py client with explicit timeouts and no built-in retries (``Bus.call`` retries)."""
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        socket_keepalive=True,
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
    )


def ping_once(url: str, *, timeout_s: float) -> None:
    """One PING, ``timeout_s`` to connect and to answer, no retry; redis-py's error if it fails."""
    client = make_client(url, socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)
    try:
        client.ping()
    finally:
        client.close()


def safe_url(url: str) -> str:
    """``url`` without its user and password, for messages."""
    u = urlparse(url)
    return f"{u.scheme}://{u.hostname}:{u.port}" if u.hostname else u.scheme + "://"


class Bus:
    """One service's handle on the bus. Stream arguments are short names ("groups")."""

    def __init__(self, settings: BusSettings, *, service: str) -> None:
        self.settings, self.service = settings, service
        self.metrics = bus_metrics()
        self.redis: Any = make_client(
            settings.url,
            socket_timeout_s=settings.socket_timeout_s,
            connect_timeout_s=settings.connect_timeout_s,
        )
        self._commit_script = self.redis.register_script(_COMMIT_LUA)

    # ------------------------------------------------------------------ plumbing
    def key(self, name: str) -> str:
        return f"{self.settings.run}:{name}"

    def call(self, fn: Callable[[], T], *, what: str) -> T:
        """Run ``fn`` with bounded exponential back-off and reconnect on connection loss."""
        deadline = time.monotonic() + self.settings.reconnect_max_s
        delay = 0.05
        while True:
            try:
                return fn()
            except redis.AuthenticationError as e:  # a ConnectionError subclass: do not retry
                raise ValueError(
                    f"Redis at {self._safe_url()} refused our credentials ({e}); check the "
                    "user:password in the bus url"
                ) from e
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if time.monotonic() + delay > deadline:
                    raise BusUnavailable(
                        f"Redis at {self._safe_url()} unreachable for {self.settings.reconnect_max_s}"
                        f" s during {what}: {e}. Is the server up? (bus reconnect_max_s)"
                    ) from e
                log.warning("bus: %s failed (%s); reconnecting in %.2f s", what, e, delay)
                self.metrics.reconnects.inc()
                self.redis.connection_pool.disconnect()
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _safe_url(self) -> str:
        return safe_url(self.settings.url)

    def ping(self) -> bool:
        return bool(self.call(self.redis.ping, what="PING"))

    def close(self) -> None:
        self.redis.close()

    # ------------------------------------------------------------------ producing
    def ensure_group(self, stream: str, group: str) -> bool:
        """Create ``group`` on ``stream`` at id 0 (MKSTREAM). Returns True if it was created."""
        try:
            self.call(lambda: self.redis.xgroup_create(self.key(stream), group, "0", mkstream=True),
                      what="XGROUP CREATE")  # fmt: skip
            return True
        except redis.ResponseError as e:
            if "BUSYGROUP" in str(e):
                return False
            raise

    def recreate_group(self, stream: str, group: str, cause: Exception) -> None:
        log.error(
            "bus: consumer group %r on %r is gone (%s) - Redis restarted without persistence or "
            "the stream was deleted; recreating it. Entries published before that are lost.",
            group, self.key(stream), cause,
        )  # fmt: skip
        self.metrics.recreated.labels(stream, group).inc()
        self.ensure_group(stream, group)

    def publish(self, stream: str, msg: wire.Message, *, wait_for: Sequence[str] = ()) -> str:
        """XADD ``msg``; first wait until each group in ``wait_for`` has room (back-pressure)."""
        data = wire.encode(msg)
        if len(data) > self.settings.max_message_bytes:
            raise ValueError(
                f"{type(msg).__name__} is {len(data)} bytes, over bus max_message_bytes="
                f"{self.settings.max_message_bytes}; raise it or send smaller groups"
            )
        for group in wait_for:
            self.wait_for_capacity(stream, group)
        entry_id = self.call(lambda: self.redis.xadd(self.key(stream), {PAYLOAD_FIELD: data}),
                             what="XADD")  # fmt: skip
        self.metrics.published.labels(stream).inc()
        self.metrics.published_bytes.labels(stream).inc(len(data))
        return entry_id.decode()

    def publish_raw(self, stream: str, fields: dict[bytes, bytes]) -> str:
        """XADD arbitrary fields, unchecked (tests and tools only: poison injection)."""
        return self.call(lambda: self.redis.xadd(self.key(stream), fields), what="XADD").decode()

    # ------------------------------------------------------------------ back-pressure, trimming
    def backlog(self, stream: str, group: str) -> tuple[int, int]:
        """(lag, pending) of ``group``: entries not yet delivered, and delivered but not acked."""
        infos = self.call(lambda: self.groups_info(stream), what="XINFO GROUPS")
        info = next((g for g in infos if g["name"] == group), None)
        if info is None:
            self.recreate_group(stream, group, RuntimeError("group missing in XINFO GROUPS"))
            return self.backlog(stream, group)
        lag = info.get("lag")
        if lag is None:  # Redis cannot tell after deletions: count (bounded) entries after it
            last = info["last-delivered-id"]
            bound = self.settings.max_backlog + 1
            lag = len(self.call(lambda: self.redis.xrange(self.key(stream), f"({last}", "+", bound),
                                what="XRANGE"))  # fmt: skip
        pending = int(info["pending"])
        self.metrics.lag.labels(stream, group).set(lag)
        self.metrics.pending.labels(stream, group).set(pending)
        return int(lag), pending

    def groups_info(self, stream: str) -> list[dict[str, Any]]:
        try:
            groups = self.redis.xinfo_groups(self.key(stream))
        except redis.ResponseError as e:
            if "no such key" in str(e).lower():
                return []
            raise
        return [{_s(k): _s(v) for k, v in g.items()} for g in groups]

    def wait_for_capacity(
        self, stream: str, group: str, *, timeout_s: float | None = None,
        count_pending: bool = True,
    ) -> float:  # fmt: skip
        """Block while ``group``'s lag (+ pending) >= max_backlog. Returns seconds waited.

        ``count_pending=False`` for a consumer that holds entries pending on purpose (the
        learner acks only after a checkpoint): its undelivered lag alone measures how far
        behind it is."""
        start = time.monotonic()
        delay = 0.01

        def backlog() -> int:
            lag, pending = self.backlog(stream, group)
            return lag + pending if count_pending else lag

        while backlog() >= self.settings.max_backlog:
            waited = time.monotonic() - start
            if timeout_s is not None and waited >= timeout_s:
                raise TimeoutError(
                    f"{self.key(stream)}: group {group!r} still full after {waited:.1f} s"
                )
            time.sleep(delay)
            self.metrics.backpressure_seconds.labels(stream, group).inc(delay)
            delay = min(delay * 2, 0.5)
        return time.monotonic() - start

    def trim_acked(self, stream: str) -> int:
        """XTRIM MINID to the oldest entry not acked by every group. Returns entries deleted."""
        bounds = []
        for g in self.call(lambda: self.groups_info(stream), what="XINFO GROUPS"):
            if int(g["pending"]) > 0:
                name = g["name"]
                summary = self.call(
                    partial(self.redis.xpending, self.key(stream), name), what="XPENDING"
                )
                first = summary["min"]
                bounds.append(_parse_id(_s(first)))
            else:
                ms, seq = _parse_id(g["last-delivered-id"])
                bounds.append((ms, seq + 1))
        if not bounds:  # nobody consumes this stream yet: everything is unacknowledged
            return 0
        ms, seq = min(bounds)
        return int(self.call(lambda: self.redis.xtrim(self.key(stream), minid=f"{ms}-{seq}", approximate=False),
                             what="XTRIM"))  # fmt: skip

    # ------------------------------------------------------------------ consuming
    def consumer(self, stream: str, group: str, name: str) -> Consumer:
        self.ensure_group(stream, group)
        return Consumer(self, stream, group, name)

    def commit(self, group: str, stream: str, entry_ids: Sequence[str], *,
               publish: Sequence[tuple[str, wire.Message]] = (),
               dedupe_ids: Sequence[str] | None = None) -> int:  # fmt: skip
        """Atomically publish (deduplicated) downstream messages and XACK upstream entries."""
        if dedupe_ids is not None and publish and len(dedupe_ids) != len(publish):
            raise ValueError(
                "commit: dedupe_ids needs one id per published message (or no publish)"
            )
        payloads = [(s, wire.encode(m)) for s, m in publish]
        ids = list(dedupe_ids) if dedupe_ids is not None else []
        gated = 1 if dedupe_ids is not None else 0
        keys = [self.key(f"done:{group}"), self.key(stream)] + [self.key(s) for s, _ in payloads]
        args: list[Any] = [group, gated, len(ids), *ids, len(entry_ids), *entry_ids, time.time()]
        args += [p for _, p in payloads]
        flags = self.call(lambda: self._commit_script(keys=keys, args=args), what="commit")
        for (s, p), flag in zip(payloads, flags, strict=True):
            if flag:
                self.metrics.published.labels(s).inc()
                self.metrics.published_bytes.labels(s).inc(len(p))
        self.metrics.duplicates.labels(stream, group).inc(len(flags) - sum(flags))
        return int(sum(flags))

    def prune_done(self, group: str, older_than_s: float) -> int:
        """Forget dedupe ids committed more than ``older_than_s`` ago (the done-set's score is the
        commit time). Returns how many were removed."""
        key, cutoff = self.key(f"done:{group}"), time.time() - older_than_s
        return int(
            self.call(lambda: self.redis.zremrangebyscore(key, "-inf", cutoff), what="ZREMRANGE")
        )

    def done_retention_s(self) -> float:
        """How long a dedupe id must be remembered. A duplicate commit needs the entry to be
        redelivered, which happens after ``claim_idle_ms`` of idleness, at most
        ``max_deliveries`` times; keep ids for twice that, and never less than six hours."""
        s = self.settings
        return max(6 * 3600.0, 2.0 * s.claim_idle_ms / 1000.0 * s.max_deliveries)

    def is_done(self, group: str, dedupe_id: str) -> bool:
        key = self.key(f"done:{group}")
        return self.call(lambda: self.redis.zscore(key, dedupe_id), what="ZSCORE") is not None

    # ------------------------------------------------------------------ small keys
    def set(self, name: str, value: str | int | float) -> None:
        self.call(lambda: self.redis.set(self.key(name), value), what="SET")

    def get(self, name: str) -> str | None:
        value = self.call(lambda: self.redis.get(self.key(name)), what="GET")
        return None if value is None else value.decode()


def _s(x: Any) -> Any:
    return x.decode() if isinstance(x, bytes) else x


def _parse_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


# KEYS: done-set, upstream stream, downstream streams...
# ARGV: group, gated, n_ids, ids..., n_acks, acks..., now, payloads... (payload i -> KEYS[2+i])
# Publish first, ack last: a script error part-way leaves entries pending (redelivered, deduped),
# never acked-but-unpublished.
_COMMIT_LUA = """
local group, gated, n_ids = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local fresh = {}
for i = 1, n_ids do
  local id = ARGV[3 + i]
  if fresh[id] == nil then fresh[id] = (redis.call('ZSCORE', KEYS[1], id) == false) end
end
local p = 4 + n_ids
local n_acks = tonumber(ARGV[p])
local now = ARGV[p + n_acks + 1]
for id, is_new in pairs(fresh) do
  if is_new then redis.call('ZADD', KEYS[1], now, id) end
end
local published = {}
for i = 1, #ARGV - (p + n_acks + 1) do
  local payload = ARGV[p + n_acks + 1 + i]
  published[i] = 0
  if gated == 0 or fresh[ARGV[3 + i]] then
    redis.call('XADD', KEYS[2 + i], '*', 'm', payload)
    published[i] = 1
  end
end
for i = 1, n_acks do redis.pcall('XACK', KEYS[2], group, ARGV[p + i]) end
return published
"""


class _Metrics:
    """Prometheus metrics of the bus (default registry; labels: stream, group, reason)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        sg = ["stream", "group"]
        self.published = Counter(
            "tether_bus_published_messages_total", "Messages published", ["stream"]
        )
        self.published_bytes = Counter(
            "tether_bus_published_bytes_total", "Bytes published", ["stream"]
        )
        self.consumed = Counter("tether_bus_consumed_messages_total", "Messages consumed", sg)
        self.consumed_bytes = Counter("tether_bus_consumed_bytes_total", "Bytes consumed", sg)
        self.lag = Gauge("tether_bus_lag_messages", "Entries not yet delivered to the group", sg)
        self.pending = Gauge("tether_bus_pending_messages", "Delivered, not yet acked", sg)
        self.claimed = Counter(
            "tether_bus_claimed_messages_total", "Entries taken over by XAUTOCLAIM", sg
        )
        self.dead = Counter(
            "tether_bus_dead_letters_total", "Entries dead-lettered", [*sg, "reason"]
        )
        self.duplicates = Counter(
            "tether_bus_duplicates_skipped_total", "Deduplicated publishes", sg
        )
        self.reconnects = Counter("tether_bus_reconnects_total", "Reconnects after connection loss")
        self.recreated = Counter(
            "tether_bus_recreated_total", "Consumer groups found missing and recreated", sg
        )
        self.backpressure_seconds = Counter(
            "tether_bus_backpressure_wait_seconds_total",
            "Seconds producers waited for capacity",
            sg,
        )


_METRICS: list[_Metrics] = []


def bus_metrics() -> _Metrics:
    """The process-wide bus metrics, created on first use (no import-time registration)."""
    if not _METRICS:
        _METRICS.append(_Metrics())
    return _METRICS[0]


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
        return [(_s(i), f) for _, entries in (reply or []) for i, f in entries]

    def _autoclaim(self, count: int) -> list[tuple[str, Any]]:
        idle = self.bus.settings.claim_idle_ms
        key = self.bus.key(self.stream)
        cursor, entries, *_ = self.bus.call(
            lambda: self.bus.redis.xautoclaim(
                key, self.group, self.name, idle, self._claim_cursor, count
            ),
            what="XAUTOCLAIM",
        )
        self._claim_cursor = _s(cursor)
        if self._claim_cursor == "0-0":  # scan complete: look again after a fraction of idle
            self._next_claim_at = time.monotonic() + min(idle / 4000, 10.0)
        return [(_s(i), f) for i, f in entries]

    def _with_counts(self, entries: list[tuple[str, Any]]) -> list[tuple[str, Any, int]]:
        key = self.bus.key(self.stream)
        lo, hi = entries[0][0], entries[-1][0]
        rows = self.bus.call(
            lambda: self.bus.redis.xpending_range(
                key, self.group, lo, hi, 4 * len(entries) + 64, self.name
            ),
            what="XPENDING",
        )
        counts = {_s(r["message_id"]): int(r["times_delivered"]) for r in rows}
        return [(i, f, counts.get(i, 1)) for i, f in entries]

    def _decode(self, entry_id: str, fields: Any, deliveries: int) -> Delivery | None:
        raw = (fields or {}).get(PAYLOAD_FIELD)
        try:
            if deliveries > self.bus.settings.max_deliveries:
                raise _Dead("max_deliveries", f"delivered {deliveries} times")
            if raw is None:
                raise wire.WireError("undecodable", "entry has no payload field (or was deleted)")
            msg = wire.decode(raw, max_bytes=self.bus.settings.max_message_bytes)
        except (wire.WireError, _Dead) as e:
            self._dead_letter(entry_id, e.reason, e.detail, raw or b"", deliveries)
            return None
        self.bus.metrics.consumed.labels(self.stream, self.group).inc()
        self.bus.metrics.consumed_bytes.labels(self.stream, self.group).inc(len(raw))
        return Delivery(entry_id, msg, deliveries, len(raw))

    def dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        """Move a decoded entry the service cannot process (e.g. unscorable) to the dead-letter
        stream with ``reason`` and ack it, atomically. ``ref`` names the message's id."""
        msg = delivery.msg
        ref = getattr(msg, "group_id", None) or getattr(msg, "prompt_id", None) or ""
        raw = wire.encode(msg)
        self._dead_letter(delivery.entry_id, reason, detail, raw, delivery.deliveries, ref=ref)

    def _dead_letter(self, entry_id: str, reason: str, detail: str, raw: bytes, n: int,
                     *, ref: str = "") -> None:  # fmt: skip
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
            "ref": ref,
        }  # fmt: skip

        def tx() -> None:
            pipe = self.bus.redis.pipeline(transaction=True)
            pipe.xadd(self.bus.key("dead"), fields)
            pipe.xack(self.bus.key(self.stream), self.group, entry_id)
            pipe.execute()

        self.bus.call(tx, what="dead-letter MULTI/EXEC")
        self.dead_letters += 1
        self.bus.metrics.dead.labels(self.stream, self.group, reason).inc()

    def commit(self, deliveries: Sequence[Delivery], *,
               publish: Sequence[tuple[str, wire.Message]] = (),
               dedupe_ids: Sequence[str] | None = None) -> int:  # fmt: skip
        """Atomically: publish each message whose dedupe id is new, mark ids done, XACK all.

        ``dedupe_ids[i]`` gates ``publish[i]``; with no ``publish``, ids are only marked done.
        Returns how many messages were published (the rest were duplicates).
        """
        ids = [d.entry_id for d in deliveries]
        return self.bus.commit(self.group, self.stream, ids, publish=publish, dedupe_ids=dedupe_ids)

    def ack(self, deliveries: Sequence[Delivery]) -> int:
        ids = [d.entry_id for d in deliveries]
        if not ids:
            return 0
        key = self.bus.key(self.stream)
        return int(self.bus.call(lambda: self.bus.redis.xack(key, self.group, *ids), what="XACK"))

    def is_done(self, dedupe_id: str) -> bool:
        return self.bus.is_done(self.group, dedupe_id)


class _Dead(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail
