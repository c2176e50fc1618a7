"""``tether bus inspect``: streams, groups, lag, pending and dead letters of one run."""

from __future__ import annotations

from functools import partial
from typing import Any

from common.bus.client import Bus
from common.bus.settings import BusSettings
from common.protocol.streams import DEAD


def _s(x: Any) -> Any:
    return x.decode(errors="replace") if isinstance(x, bytes) else x


def inspect_bus(settings: BusSettings, *, last_dead: int = 5) -> dict[str, Any]:
    """A JSON-able snapshot of every stream under ``<run>:`` and the last dead letters."""
    bus = Bus(settings, service="inspect")
    r: Any = bus.redis
    prefix = f"{settings.run}:"
    try:
        keys = bus.call(
            lambda: sorted(_s(k) for k in r.scan_iter(match=prefix + "*", _type="stream")),
            what="SCAN",
        )
        streams = []
        for key in keys:
            name = key[len(prefix) :]
            groups = []
            for g in bus.call(partial(bus.groups_info, name), what="XINFO GROUPS"):
                lag, pending = bus.backlog(name, g["name"])
                groups.append({"name": g["name"], "lag": lag, "pending": pending,
                               "consumers": int(g["consumers"])})  # fmt: skip
            length = bus.call(partial(r.xlen, key), what="XLEN")
            streams.append({"stream": name, "length": int(length), "groups": groups})
        dead_key = bus.key(DEAD)
        dead = bus.call(lambda: r.xrevrange(dead_key, count=last_dead), what="XREVRANGE")
        recent = [
            {k: _s(f.get(k.encode(), b"")) for k in ("reason", "stream", "entry_id", "detail")}
            | {"dead_id": _s(i)}
            for i, f in dead
        ]
        n_dead = int(bus.call(lambda: r.xlen(dead_key), what="XLEN"))
        return {
            "run": settings.run,
            "streams": streams,
            "dead_letters": n_dead,
            "recent_dead": recent,
        }
    finally:
        bus.close()


def format_inspect(d: dict[str, Any]) -> str:
    """Human-readable table of ``inspect_bus`` output."""
    lines = [f"run {d['run']}", f"{'stream':<24} {'length':>8}  {'group':<16} {'lag':>8} "
             f"{'pending':>8} {'consumers':>9}"]  # fmt: skip
    for s in d["streams"]:
        rows = s["groups"] or [{"name": "-", "lag": "-", "pending": "-", "consumers": "-"}]
        for i, g in enumerate(rows):
            head = f"{s['stream']:<24} {s['length']:>8}" if i == 0 else " " * 33
            lines.append(
                f"{head}  {g['name']:<16} {g['lag']:>8} {g['pending']:>8} {g['consumers']:>9}"
            )
    if not d["streams"]:
        lines.append("(no streams)")
    lines.append(f"dead letters: {d['dead_letters']}")
    for r in d["recent_dead"]:
        lines.append(
            f"  {r['dead_id']}  {r['reason']:<14} {r['stream']}/{r['entry_id']}  {r['detail'][:60]}"
        )
    return "\n".join(lines)
