"""Redis memory: what the server holds against its ``maxmemory``, which eviction policies Tether
refuses, and how a client waits out an out-of-memory episode.

**Out of memory means wait, not crash.** With ``maxmemory`` set and the ``noeviction`` policy
(what ``deploy/k8s/redis.yaml`` and ``tether train``'s embedded server use), Redis refuses every
command that could grow memory (``OOM command not allowed``): XADD, SET, HSET, the commit
script, XGROUP CREATE. It still serves reads, XACK, XTRIM and deletes, which is how memory comes
back: the learner acknowledges and trims after each checkpoint, and a raised ``maxmemory`` helps
at once. ``Bus.call`` therefore retries ``OutOfMemoryError`` with bounded exponential back-off
(``OOM_FIRST_DELAY_S`` doubling to ``OOM_MAX_DELAY_S`` between tries) for as long as it lasts,
logs one line when an episode starts (with the server's used memory and ``maxmemory``) and one
when it ends, and counts the seconds waited (``tether_bus_oom_wait_seconds_total``;
``tether_bus_oom_waiting`` is 1 meanwhile). Producers thus slow down instead of exiting, and a
refused write wrote nothing (a script or MULTI refused at its first write is not half applied).

**Eviction loses data silently.** A policy that evicts (``allkeys-*``) deletes streams, consumer
groups and dedupe sets to make room: the run then waits for entries that no longer exist.
Tether sets no expiry on its keys, so ``volatile-*`` policies never evict them and are accepted
with ``noeviction``. Every service checks the policy at start (``check_policy``) and refuses an
evicting one (exit 2) unless ``bus.allow_evicting_policy`` says the user knows.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from common.config.errors import ConfigError

log = logging.getLogger(__name__)

OOM_FIRST_DELAY_S = 0.1
OOM_MAX_DELAY_S = 5.0
SAFE_POLICIES = ("noeviction", "volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl")


@dataclass
class Memory:
    """``INFO memory`` of the server: bytes used, ``maxmemory`` (0 = no limit) and the policy."""

    used_bytes: int
    max_bytes: int
    policy: str

    def describe(self) -> str:
        limit = f"maxmemory {_mb(self.max_bytes)}" if self.max_bytes else "no maxmemory"
        return f"used {_mb(self.used_bytes)} of {limit}, policy {self.policy}"


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def read_memory(client: Any) -> Memory:
    """The server's memory figures (``INFO memory``: readable without CONFIG rights)."""
    info = client.info("memory")
    return Memory(
        used_bytes=int(info.get("used_memory", 0)),
        max_bytes=int(info.get("maxmemory", 0)),
        policy=str(info.get("maxmemory_policy", "noeviction")),
    )


def check_policy(memory: Memory, *, url: str, allow_evicting: bool) -> None:
    """Refuse a ``maxmemory-policy`` that can evict Tether's keys (``ConfigError``: exit 2),
    unless ``allow_evicting`` (``bus.allow_evicting_policy``); warn when it is allowed."""
    if memory.policy in SAFE_POLICIES:
        return
    text = (
        f"Redis at {url} has maxmemory-policy {memory.policy}: when it fills up it deletes keys "
        "to make room, and Tether's streams, consumer groups and dedupe sets are keys. A run "
        "then loses trajectories and waits for entries that no longer exist. Fix: run "
        "`redis-cli CONFIG SET maxmemory-policy noeviction` (and set it in the server's "
        "configuration, e.g. `maxmemory-policy noeviction` in redis.conf or your managed "
        "service's parameter group); Tether waits out a full Redis instead of losing data. "
        "To run anyway, knowing that eviction loses data, set bus.allow_evicting_policy = true."
    )
    if not allow_evicting:
        raise ConfigError(text)
    log.warning("bus.allow_evicting_policy = true: %s", text)


class OomEpisodes:
    """The back-off and the log lines of one client's out-of-memory episodes (thread-safe: a
    service's threads share its ``Bus``)."""

    def __init__(self, metrics: Any, describe: Any) -> None:
        self.metrics, self._describe = metrics, describe
        self._lock = threading.Lock()
        self._since: float | None = None
        self._waiting = 0

    def wait(self, what: str, delay_s: float) -> float:
        """Sleep ``delay_s`` for a refused ``what``; returns the next delay (bounded doubling)."""
        with self._lock:
            if self._since is None:
                self._since = time.monotonic()
                log.warning(
                    "Redis is out of memory (%s): waiting, with back-off up to %.0f s between "
                    "tries, for room to %s; nothing is lost meanwhile. Memory comes back as the "
                    "learner acknowledges and trims (after each checkpoint: "
                    "learner.checkpoint_every_steps) or when maxmemory is raised "
                    "(CONFIG SET maxmemory ...)",
                    self._safe_describe(),
                    OOM_MAX_DELAY_S,
                    what,
                )
            self._waiting += 1
            self.metrics.oom_waiting.set(1)
        try:
            time.sleep(delay_s)
        finally:
            with self._lock:
                self._waiting -= 1
            self.metrics.oom_wait_seconds.inc(delay_s)
        return min(delay_s * 2, OOM_MAX_DELAY_S)

    def succeeded(self) -> None:
        """A call went through: end the episode, if one is going on."""
        if self._since is None:
            return
        with self._lock:
            if self._since is None or self._waiting:
                return
            took, self._since = time.monotonic() - self._since, None
            self.metrics.oom_waiting.set(0)
        log.warning("Redis accepts writes again after %.1f s out of memory", took)

    def _safe_describe(self) -> str:
        try:
            return str(self._describe())
        except Exception as exc:  # noqa: BLE001 - only for the log line
            return f"INFO memory failed: {exc}"
