"""``Bus``: one service's handle on the trajectory bus (Redis Streams of ``wire`` messages).

Delivery is at-least-once through consumer groups (XREADGROUP ... XACK); effects are made
exactly-once by ``Consumer.commit``, which in one Lua script publishes downstream messages only
for ids not yet in the group's done-set and then acks the upstream entries. Poison entries go to
``<run>:dead``. Back-pressure is measured (lag + pending per group), never MAXLEN; only the
prefix acknowledged by every group is trimmed. Only Redis 7.0 commands are used.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import redis

from common.bus.memory import OOM_FIRST_DELAY_S, Memory, OomEpisodes, check_policy, read_memory
from common.bus.metrics import BusMetrics
from common.bus.settings import (
    BusSettings,
    BusStopping,
    BusUnavailable,
    decode_str,
    make_client,
    safe_url,
)
from common.protocol import streams, wire

log = logging.getLogger(__name__)
T = TypeVar("T")

# Errors of a server that is not (or no longer) the primary: after a failover the bus url's host
# name resolves to the new primary, but connections made before it still reach the old server,
# which refuses writes as a replica (READONLY), as a primary fenced off by
# ``min-replicas-to-write`` (NOREPLICAS), or unblocks a blocked read when it is demoted
# (UNBLOCKED); a replica cut from its primary with ``replica-serve-stale-data no`` answers
# MASTERDOWN. Nothing was written: the command is made again on a new connection.
NOT_PRIMARY = ("NOREPLICAS", "UNBLOCKED")  # redis-py's own classes stand for the other two


def not_primary(e: redis.ResponseError) -> bool:
    if isinstance(e, (redis.exceptions.ReadOnlyError, redis.exceptions.MasterDownError)):
        return True
    return str(e).startswith(NOT_PRIMARY)


class Bus:
    """One service's handle on the bus. Stream arguments are short names ("groups")."""

    def __init__(self, settings: BusSettings, *, service: str) -> None:
        self.settings, self.service = settings, service
        self.metrics = BusMetrics()
        self.redis: Any = make_client(
            settings.url,
            socket_timeout_s=settings.socket_timeout_s,
            connect_timeout_s=settings.connect_timeout_s,
        )
        self._commit_script = self.redis.register_script(_COMMIT_LUA)
        self._oom = OomEpisodes(self.metrics, lambda: read_memory(self.redis).describe())
        # Set when the service stops (SIGTERM, or the run is finished): a producer waiting for
        # room downstream gives up (``BusStopping``) instead of waiting for consumers that are
        # gone, so the service can exit.
        self.stopping = threading.Event()
        # Connection losses seen by any command of this client. A read whose connection broke
        # after the server delivered its entries leaves them pending to the reader, which never
        # received them: a consumer re-reads its own pending entries after a loss (``Consumer``).
        self.connection_losses = 0

    # ------------------------------------------------------------------ plumbing
    def key(self, name: str) -> str:
        return f"{self.settings.run}:{name}"

    def call(self, fn: Callable[[], T], *, what: str) -> T:
        """Run ``fn`` with bounded exponential back-off: reconnect on connection loss or on a
        server that is no longer the primary (``NOT_PRIMARY``; for up to ``reconnect_max_s``),
        and wait for room while Redis is out of memory (``memory.py``)."""
        deadline = time.monotonic() + self.settings.reconnect_max_s
        delay, oom_delay = 0.05, OOM_FIRST_DELAY_S
        while True:
            try:
                result = fn()
                self._oom.succeeded()
                return result
            except redis.AuthenticationError as e:  # a ConnectionError subclass: do not retry
                raise ValueError(
                    f"Redis at {self._safe_url()} refused our credentials ({e}); check the "
                    "user:password in the bus url"
                ) from e
            except redis.OutOfMemoryError:  # maxmemory reached: wait for room (memory.py)
                oom_delay = self._oom.wait(what, oom_delay)
                deadline = time.monotonic() + self.settings.reconnect_max_s
                continue
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as e:
                if isinstance(e, redis.ResponseError) and not not_primary(e):
                    raise
                if time.monotonic() + delay > deadline:
                    if isinstance(e, redis.ResponseError):
                        raise BusUnavailable(
                            f"Redis at {self._safe_url()} refused {what} for "
                            f"{self.settings.reconnect_max_s} s as a server that is not the "
                            f"primary ({type(e).__name__}: {e}). Point the bus url at the "
                            "primary, or at a name that follows it through failovers (a DNS "
                            "name or Kubernetes Service that your failover moves)"
                        ) from e
                    raise BusUnavailable(
                        f"Redis at {self._safe_url()} unreachable for {self.settings.reconnect_max_s}"
                        f" s during {what}: {e}. Is the server up? (bus reconnect_max_s)"
                    ) from e
                log.warning("bus: %s failed (%s); reconnecting in %.2f s", what, e, delay)
                self.metrics.reconnects.inc()
                self.connection_losses += 1
                # the idle connections only: the failed one was closed by redis-py, and another
                # thread's command (a blocking read) keeps its own; closing that under it raised
                # ValueError ("I/O operation on closed file") there, which nothing retries
                self.redis.connection_pool.disconnect(inuse_connections=False)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _safe_url(self) -> str:
        return safe_url(self.settings.url)

    def ping(self) -> bool:
        return bool(self.call(self.redis.ping, what="PING"))

    def memory(self) -> Memory:
        """The server's used memory against ``maxmemory`` (also set as this process's gauges)."""
        mem = self.call(lambda: read_memory(self.redis), what="INFO memory")
        self.metrics.redis_used.set(mem.used_bytes)
        self.metrics.redis_max.set(mem.max_bytes)
        return mem

    def check_server(self) -> Memory:
        """At a service's start: refuse a ``maxmemory-policy`` that can evict Tether's keys
        (``ConfigError``, exit 2) unless ``allow_evicting_policy``. Waits for Redis like any call."""
        mem = self.memory()
        check_policy(mem, url=self._safe_url(), allow_evicting=self.settings.allow_evicting_policy)
        return mem

    def close(self) -> None:
        self.redis.close()

    # ------------------------------------------------------------------ producing
    def ensure_group(self, stream: str, group: str) -> bool:
        """Create ``group`` on ``stream`` at id 0 (MKSTREAM). Returns True if it was created.
        Also starts this pair's back-pressure and recreated counters at 0 (dashboards)."""
        self.metrics.backpressure_seconds.labels(stream, group)
        self.metrics.recreated.labels(stream, group)
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
        entry_id = self.call(lambda: self.redis.xadd(self.key(stream), {streams.PAYLOAD_FIELD: data}),
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
        return [{decode_str(k): decode_str(v) for k, v in g.items()} for g in groups]

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
            if self.stopping.is_set():
                raise BusStopping(f"stopped while waiting for room in {self.key(stream)}/{group}")
            waited = time.monotonic() - start
            if timeout_s is not None and waited >= timeout_s:
                raise TimeoutError(
                    f"{self.key(stream)}: group {group!r} still full after {waited:.1f} s"
                )
            time.sleep(delay)
            self.metrics.backpressure_seconds.labels(stream, group).inc(delay)
            delay = min(delay * 2, 0.5)
        return time.monotonic() - start

    def in_flight(self) -> dict[str, int]:
        """Entries on their way to the learner, per stream, from one atomic snapshot (MULTI of
        XINFO GROUPS): prompts and groups not yet acknowledged by the generators' / scorers'
        group (lag + pending), scored groups not yet delivered to the learner (lag). A lag Redis
        cannot tell (after deletions) counts as one in flight."""

        def snapshot() -> list[Any]:
            pipe = self.redis.pipeline(transaction=True)
            for stream, _ in streams.PIPELINE:
                pipe.xinfo_groups(self.key(stream))
            return list(pipe.execute(raise_on_error=False))

        out = {}
        for (stream, group), reply in zip(streams.PIPELINE, self.call(snapshot, what="MULTI XINFO"),
                                          strict=True):  # fmt: skip
            infos = [] if isinstance(reply, Exception) else reply  # no such key: nothing there
            info = next((g for g in infos if decode_str(g["name"]) == group), None)
            if info is None:
                out[stream] = 0
                continue
            lag = info.get("lag")
            pending = int(info["pending"]) if stream != streams.SCORED else 0
            out[stream] = (1 if lag is None else int(lag)) + pending
        return out

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
                bounds.append(_parse_id(decode_str(first)))
            else:
                ms, seq = _parse_id(g["last-delivered-id"])
                bounds.append((ms, seq + 1))
        if not bounds:  # nobody consumes this stream yet: everything is unacknowledged
            return 0
        ms, seq = min(bounds)
        return int(self.call(lambda: self.redis.xtrim(self.key(stream), minid=f"{ms}-{seq}", approximate=False),
                             what="XTRIM"))  # fmt: skip

    # ------------------------------------------------------------------ consuming
    def commit(self, group: str, stream: str, entry_ids: Sequence[str], *,
               publish: Sequence[tuple[str, wire.Message]] = (),
               dedupe_ids: Sequence[str] | None = None,
               count_as: str | None = None) -> int:  # fmt: skip
        """Atomically publish (deduplicated) downstream messages and XACK upstream entries.

        ``count_as``: a generator id whose run-long published-groups count (``generated_groups``)
        grows by the number published, in the same script, so that a SIGKILL can never leave a
        published group uncounted (or counted twice)."""
        if dedupe_ids is not None and publish and len(dedupe_ids) != len(publish):
            raise ValueError(
                "commit: dedupe_ids needs one id per published message (or no publish)"
            )
        payloads = [(s, wire.encode(m)) for s, m in publish]
        ids = list(dedupe_ids) if dedupe_ids is not None else []
        gated = 1 if dedupe_ids is not None else 0
        keys = [
            self.key(streams.done_set(group)),
            self.key(stream),
            self.key(streams.in_hand(stream, group)),
            self.key(streams.strikes(stream, group)),
        ] + [self.key(s) for s, _ in payloads]
        if count_as:
            keys.append(self.key(streams.GENERATED_GROUPS))
        args: list[Any] = [group, gated, count_as or "", len(ids), *ids]
        args += [len(entry_ids), *entry_ids, time.time()]
        args += [p for _, p in payloads]
        flags = self.call(lambda: self._commit_script(keys=keys, args=args), what="commit")
        for (s, p), flag in zip(payloads, flags, strict=True):
            if flag:
                self.metrics.published.labels(s).inc()
                self.metrics.published_bytes.labels(s).inc(len(p))
        self.metrics.duplicates.labels(stream, group).inc(len(flags) - sum(flags))
        return int(sum(flags))

    def count_generated(self, sid: str, n: int) -> None:
        """Add ``n`` to generator ``sid``'s run-long published-groups count. The generator counts
        inside its commit (``commit(count_as=...)``); this is for tools and tests."""
        key = self.key(streams.GENERATED_GROUPS)
        self.call(lambda: self.redis.hincrby(key, sid, n), what="HINCRBY")

    def generated_groups(self) -> dict[str, int]:
        """Generator id -> groups it published over the run (``commit(count_as=...)``)."""
        key = self.key(streams.GENERATED_GROUPS)
        raw = self.call(lambda: self.redis.hgetall(key), what="HGETALL")
        return {k.decode(): int(v) for k, v in raw.items()}

    def prune_done(self, group: str, older_than_s: float) -> int:
        """Forget dedupe ids committed more than ``older_than_s`` ago (the done-set's score is the
        commit time). Returns how many were removed."""
        key, cutoff = self.key(streams.done_set(group)), time.time() - older_than_s
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
        key = self.key(streams.done_set(group))
        return self.call(lambda: self.redis.zscore(key, dedupe_id), what="ZSCORE") is not None

    # ------------------------------------------------------------------ small keys
    def set(self, name: str, value: str | int | float) -> None:
        self.call(lambda: self.redis.set(self.key(name), value), what="SET")

    def get(self, name: str) -> str | None:
        value = self.call(lambda: self.redis.get(self.key(name)), what="GET")
        return None if value is None else value.decode()

    def delete(self, name: str) -> None:
        self.call(lambda: self.redis.delete(self.key(name)), what="DEL")

    # ------------------------------------------------------------------ the status hash
    def write_status(self, service: str, sid: str, doc: str) -> None:
        """Set replica ``<service>:<sid>``'s heartbeat (a JSON document) in the status hash."""
        key = self.key(streams.STATUS)
        self.call(lambda: self.redis.hset(key, f"{service}:{sid}", doc), what="HSET status")

    def read_statuses(self) -> dict[str, str]:
        """Every replica's last heartbeat: ``{"<service>:<sid>": JSON document}``."""
        raw = self.call(lambda: self.redis.hgetall(self.key(streams.STATUS)), what="HGETALL status")
        return {decode_str(k): decode_str(v) for k, v in raw.items()}


def _parse_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


# KEYS: done-set, upstream stream, its in-hand and strikes hashes (``strikes.py``), downstream
# streams..., [count hash when count_as is set]
# ARGV: group, gated, count_as, n_ids, ids..., n_acks, acks..., now, payloads...
# (payload i -> KEYS[4+i]; the count hash is the key after the last downstream stream)
# Publish first, ack last: a script error part-way leaves entries pending (redelivered, deduped),
# never acked-but-unpublished. The count grows with what was published, in the same script.
# Under Redis's maxmemory the first write (ZADD) is refused and nothing is written at all.
_COMMIT_LUA = """
local group, gated, count_as, n_ids = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local fresh = {}
for i = 1, n_ids do
  local id = ARGV[4 + i]
  if fresh[id] == nil then fresh[id] = (redis.call('ZSCORE', KEYS[1], id) == false) end
end
local p = 5 + n_ids
local n_acks = tonumber(ARGV[p])
local now = ARGV[p + n_acks + 1]
for id, is_new in pairs(fresh) do
  if is_new then redis.call('ZADD', KEYS[1], now, id) end
end
local published, n_published = {}, 0
local n_payloads = #ARGV - (p + n_acks + 1)
for i = 1, n_payloads do
  local payload = ARGV[p + n_acks + 1 + i]
  published[i] = 0
  if gated == 0 or fresh[ARGV[4 + i]] then
    redis.call('XADD', KEYS[4 + i], '*', 'm', payload)
    published[i] = 1
    n_published = n_published + 1
  end
end
if count_as ~= '' and n_published > 0 then
  redis.call('HINCRBY', KEYS[5 + n_payloads], count_as, n_published)
end
for i = 1, n_acks do
  redis.pcall('XACK', KEYS[2], group, ARGV[p + i])
  redis.call('HDEL', KEYS[3], ARGV[p + i])
  redis.call('HDEL', KEYS[4], ARGV[p + i])
end
return published
"""
