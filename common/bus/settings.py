"""Connection and delivery settings of a service's bus client, checked at construction, and the
helpers that need only a URL or a reply (a client with explicit timeouts, one PING, a URL safe
to print, the errors the bus tells apart)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import redis


@dataclass
class BusSettings:
    """Connection and delivery settings shared by every service's bus client."""

    url: str = "redis://127.0.0.1:6379/0"  # redis:// or rediss:// (TLS), user:password@ allowed
    run: str = "tether"  # namespace: streams are "<run>:<name>"
    block_ms: int = 2_000  # XREADGROUP BLOCK time per read call
    claim_idle_ms: int = 300_000  # take over entries idle this long (> slowest honest work)
    max_deliveries: int = 5  # strikes (its consumer failed holding it) before dead-lettering
    max_message_bytes: int = 64 * 1024 * 1024  # larger payloads are refused / dead-lettered
    max_backlog: int = 1_024  # producers wait while a group's lag + pending reaches this
    socket_timeout_s: float = 30.0  # must exceed block_ms, or blocking reads time out
    connect_timeout_s: float = 5.0
    reconnect_max_s: float = 120.0  # give up (raise) after Redis is unreachable this long
    allow_evicting_policy: bool = False  # run on a server whose maxmemory-policy can evict keys

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


def make_client(url: str, *, socket_timeout_s: float, connect_timeout_s: float) -> Any:
    """A redis-py client with explicit timeouts and no built-in retries (``Bus.call`` retries).

    No CLIENT SETINFO on connect (``driver_info=None``): a service's ACL user is not allowed it
    (``common.bus.acl``), and redis-py would send it on every new connection. TLS settings
    travel in a ``rediss://`` URL's query (``?ssl_ca_certs=/path/ca.pem``, ``ssl_certfile``,
    ``ssl_keyfile`` for a client certificate), which redis-py reads."""
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        socket_keepalive=True,
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
        driver_info=None,
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


class BusUnavailable(ConnectionError):
    """Redis stayed unreachable for longer than ``reconnect_max_s``."""


class BusStopping(RuntimeError):
    """The service is stopping (``Bus.stopping``): a wait for room downstream was given up."""


def is_nogroup(e: Exception) -> bool:
    return isinstance(e, redis.ResponseError) and str(e).startswith("NOGROUP")


def decode_str(x: Any) -> Any:
    """``x`` decoded from UTF-8 if it is bytes (redis-py replies), else as it is."""
    return x.decode() if isinstance(x, bytes) else x
