"""Redis ACL users for a deployment: one per service kind, allowed only the commands that kind
sends (Redis 7.0 names), so a compromised scorer, say, cannot trim streams, rewrite the
learner's keys with SET, read other keys with SCAN, or reconfigure the server.

The sets are what the code calls, read from it and checked against real services under these
users (tests/services/test_redis_acl.py: Debian's Redis 7.0, whose ACL LOG must stay empty while
a whole run trains, and each user refused a command outside its set):

- every service: PING and SELECT (connection), GET (the run-finished record, weight keys), HSET
  (its status heartbeat), its consumer group (XGROUP CREATE, XREADGROUP, XAUTOCLAIM, XPENDING,
  XACK), the dead-letter move (MULTI, XADD, XACK, EXEC), back-pressure and lag (XINFO GROUPS,
  XRANGE), INFO (``INFO memory``: the start-up refusal of an evicting ``maxmemory-policy`` and
  the memory figures of an out-of-memory wait, ``common.bus.memory``);
- generator and scorer: the atomic commit (``Bus.commit``: EVALSHA, SCRIPT LOAD when the server
  lost the script, and inside it ZSCORE, ZADD, XADD, XACK, HDEL of the entries' marks; HINCRBY
  for the generator's run-long count), the in-hand and strike marks (``common.bus.strikes``:
  its script's HEXISTS, HINCRBY, HGET, HSET, HDEL; HSET, HDEL and HMGET outside it), XCLAIM (a
  generator keeps its held prompts claimed), SET (a generator's version key);
- learner: XADD (prompts), SET and DEL (versions, the weight store's address, the run-finished
  record), XTRIM (the acknowledged prefix) and ZREMRANGEBYSCORE (old dedupe ids); and what
  `tether status` and `tether bus inspect` read when run with the learner's URL (HGETALL, XLEN,
  XREVRANGE, SCAN, HMGET for the re-drivable dead letters' strikes). `tether bus redrive`
  moves dead letters (XADD, XDEL): an operator's act, with the operator's (``default``) user;
- exporter (redis_exporter, for the Prometheus alerts): INFO, CONFIG GET (``maxmemory``), its
  client name, SLOWLOG and LATENCY.

Keys (``KEYS``; Redis 7.0 key selectors): the learner reads and writes every key (it creates the
run's streams and groups, publishes the weights' keys and writes the run-finished record); a
generator or a scorer reads every key (``%R~*``: the run-finished record, the versions, the
backlog of the next stage) but writes only the keys of its own stage — its input stream and
consumer group's marks, its output stream, the dead letters, the status hash, and for a
generator its version key and the run-long count (``common.protocol.streams`` names them all).
So a compromised generator cannot write ``<run>:run:finished`` (which would stop every service),
the learner's version or weight keys, or the scored stream (forged rewards); a scorer cannot
write prompts. Patterns start with ``*:`` (any run: the run name is configuration, and the users
would otherwise need re-issuing with each new run name; run names cannot contain ``:``). A glob
cannot say "one segment", so ``~*:groups`` also matches ``<run>:generated:groups``: a scorer
could write the generators' run-long counts (``tether status``'s books), nothing that steers the
run. The exporter touches no key. Pub/sub: none (``resetchannels``). The ``default`` user stays for the
operator (and the health checks), with its own password.
"""

from __future__ import annotations

from common.protocol import streams

_CONNECTION = ("ping", "select")
_CONSUMER = ("xgroup|create", "xreadgroup", "xautoclaim", "xpending", "xack")
_DEAD_LETTER = ("multi", "xadd", "xack", "exec")
_BACKLOG = ("xinfo|groups", "xrange")
_EVERY_SERVICE = (*_CONNECTION, "get", "hset", "info", *_CONSUMER, *_DEAD_LETTER, *_BACKLOG)
_COMMIT = ("evalsha", "script|load", "zscore", "zadd", "xadd", "xack", "hdel")
_STRIKES = ("evalsha", "script|load", "hexists", "hincrby", "hget", "hset", "hdel", "hmget")
_STATUS_TOOLS = ("hgetall", "xlen", "xrevrange", "scan", "hmget")

COMMANDS: dict[str, tuple[str, ...]] = {
    "learner": (
        *_EVERY_SERVICE,
        "set",
        "del",
        "xtrim",
        "zremrangebyscore",
        *_STATUS_TOOLS,
    ),
    "generator": (*_EVERY_SERVICE, *_COMMIT, *_STRIKES, "hincrby", "xclaim", "set"),
    "scorer": (*_EVERY_SERVICE, *_COMMIT, *_STRIKES),
    # redis_exporter with its default flags: what Debian 12's 1.45 sends (measured by the test:
    # ACL LOG empty while it scrapes) and LATENCY HISTOGRAM, which 1.67 (the image the deploy
    # files name) adds for Redis 7 (read from its source)
    "exporter": (
        "ping",
        "client|setname",
        "info",
        "config|get",
        "slowlog|get",
        "slowlog|len",
        "latency|latest",
        "latency|histogram",
    ),
}


def _own(*names: str) -> tuple[str, ...]:
    """Read-and-write patterns for the keys ``names`` of any run (``<run>:<name>``)."""
    return tuple(f"~*:{n}" for n in names)


_READ_ALL = "%R~*"
KEYS: dict[str, tuple[str, ...]] = {
    "learner": ("~*",),
    "generator": (
        _READ_ALL,
        *_own(
            streams.PROMPTS,  # its consumer group (XREADGROUP, XACK, XAUTOCLAIM, XCLAIM)
            streams.in_hand(streams.PROMPTS, streams.GENERATORS),
            streams.strikes(streams.PROMPTS, streams.GENERATORS),
            streams.done_set(streams.GENERATORS),
            streams.GROUPS,  # its output, and the scorers' group it ensures
            streams.DEAD,
            streams.STATUS,
            streams.GENERATED_GROUPS,
            streams.generator_version("*"),
        ),
    ),
    "scorer": (
        _READ_ALL,
        *_own(
            streams.GROUPS,
            streams.in_hand(streams.GROUPS, streams.SCORERS),
            streams.strikes(streams.GROUPS, streams.SCORERS),
            streams.done_set(streams.SCORERS),
            streams.SCORED,  # its output, and the learner's group it ensures
            streams.DEAD,
            streams.STATUS,
        ),
    ),
    "exporter": (),
}

KINDS = tuple(COMMANDS)


def user_name(kind: str) -> str:
    """The ACL user of a service kind: ``tether-<kind>``."""
    if kind not in COMMANDS:
        raise ValueError(f"no Redis ACL user for {kind!r}; kinds: {', '.join(KINDS)}")
    return f"tether-{kind}"


def rules(kind: str) -> list[str]:
    """The ACL rules of ``kind``'s user after ``on`` and its password: no channels, its key
    patterns, then nothing but its commands (each once, in a stable order)."""
    user_name(kind)  # refuses an unknown kind
    commands = (f"+{c}" for c in sorted(set(COMMANDS[kind])))
    return ["resetchannels", "resetkeys", *KEYS[kind], "-@all", *commands]


def setuser(kind: str, password: str) -> list[str]:
    """``ACL SETUSER`` arguments creating ``kind``'s user with ``password`` (tests, tools)."""
    return [user_name(kind), "reset", "on", f">{password}", *rules(kind)]
