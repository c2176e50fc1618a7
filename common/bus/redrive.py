"""``tether bus redrive``: return dead letters to their stream once their cause is fixed.

A dead letter is *re-drivable* when it holds its whole message (``complete``: it decoded, so it
is not garbage), the message is a training prompt or group with a sampler position, and that
position's cycle is one the learner has still to train (``cycle`` in its last heartbeat, which
after a restart is its checkpoint's next cycle): a group of a cycle the learner has already
trained without it would only be acknowledged as a duplicate. Held-out entries are not re-driven
(a restarted learner starts its rounds afresh), nor undecodable ones.

Re-driving an entry adds its message to its stream again (a new entry id, no strikes, so it is
consumed as new) and deletes the dead letter, in one transaction. The learner reads the
dead-letter stream once and remembers the positions it gave up on, so re-driving while it runs
would race with it: the command refuses while the learner's heartbeat is fresh. Stop the run
(or let it stop), fix the cause, ``tether bus redrive``, then ``tether train --resume``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from functools import partial
from typing import TYPE_CHECKING, Any

from common.bus.dead_letters import field_of
from common.protocol import streams

if TYPE_CHECKING:
    from common.bus.client import Bus

ALIVE_S = 15.0  # a heartbeat younger than this means the service runs (as in `tether status`)
_LEARNER = f"learner:{streams.LEARNER_CONSUMER}"
_STREAMS = {s for s, _ in streams.PIPELINE}


class RedriveRefused(RuntimeError):
    """Re-driving now would race with a running learner."""


def learner_heartbeat(bus: Bus) -> dict[str, Any]:
    """The learner's last status document (empty when it never reported)."""
    doc = bus.read_statuses().get(_LEARNER)
    try:
        return json.loads(doc) if doc else {}
    except ValueError:
        return {}


def heartbeat_age(doc: dict[str, Any]) -> float | None:
    """Seconds since a status document's heartbeat; None when it has none (never reported).
    Younger than ``ALIVE_S``: the service runs."""
    beat = doc.get("heartbeat")
    return None if beat is None else time.time() - float(beat)


def redrivable(fields: dict[Any, Any], *, learner_cycle: int | None) -> bool:
    """Whether a dead-letter entry can go back to its stream (see the module docstring)."""
    cycle = field_of(fields, "cycle")
    return (
        field_of(fields, "complete") == "1"
        and field_of(fields, "stream") in _STREAMS
        and field_of(fields, "split") == "train"
        and cycle.isdigit()
        and (learner_cycle is None or int(cycle) >= learner_cycle)
    )


def dead_entries(bus: Bus, *, page: int = 500) -> list[tuple[str, dict[Any, Any]]]:
    """Every entry of the dead-letter stream, oldest first."""
    key, out, start = bus.key(streams.DEAD), [], "-"
    while True:
        rows = bus.call(partial(bus.redis.xrange, key, start, "+", page), what="XRANGE dead")
        out += [(i.decode() if isinstance(i, bytes) else i, f) for i, f in rows]
        if len(rows) < page:
            return out
        start = f"({out[-1][0]}"


def redrive(bus: Bus, *, reasons: set[str] | None = None, dry_run: bool = False) -> dict[str, Any]:
    """Re-drive the re-drivable dead letters (of ``reasons``, or all). Returns counts by reason:
    ``redriven`` and ``kept`` (not re-drivable). ``RedriveRefused`` while the learner runs."""
    beat = learner_heartbeat(bus)
    age = heartbeat_age(beat)
    if age is not None and age < ALIVE_S and not dry_run:
        raise RedriveRefused(
            f"the learner of run {bus.settings.run!r} is running (heartbeat {age:.0f} s ago): it "
            "has read the dead letters already and would not wait for re-driven entries. Stop the "
            "run (Ctrl-C, or let it stop), then run `tether bus redrive` and `tether train "
            "--resume`. `--dry-run` shows what would be re-driven."
        )
    cycle = beat.get("cycle")
    learner_cycle = int(cycle) if isinstance(cycle, int) else None
    redriven: Counter[str] = Counter()
    kept: Counter[str] = Counter()
    for dead_id, fields in dead_entries(bus):
        reason = field_of(fields, "reason")
        if reasons and reason not in reasons:
            continue
        if not redrivable(fields, learner_cycle=learner_cycle):
            kept[reason] += 1
            continue
        redriven[reason] += 1
        if not dry_run:
            _move(bus, dead_id, fields)
    return {"redriven": dict(redriven), "kept": dict(kept), "learner_cycle": learner_cycle,
            "dry_run": dry_run}  # fmt: skip


def _move(bus: Bus, dead_id: str, fields: dict[Any, Any]) -> None:
    raw = fields.get(b"raw", fields.get("raw"))
    target = bus.key(field_of(fields, "stream"))

    def tx() -> None:
        pipe = bus.redis.pipeline(transaction=True)
        pipe.xadd(target, {streams.PAYLOAD_FIELD: raw})
        pipe.xdel(bus.key(streams.DEAD), dead_id)
        pipe.execute()

    bus.call(tx, what="redrive MULTI/EXEC")


def format_redrive(result: dict[str, Any]) -> str:
    verb = "would re-drive" if result["dry_run"] else "re-drove"
    moved = sum(result["redriven"].values())
    kept = sum(result["kept"].values())
    by = ", ".join(f"{r} {n}" for r, n in sorted(result["redriven"].items()))
    lines = [f"{verb} {moved} dead letter(s){f' ({by})' if by else ''}"]
    if kept:
        why = ", ".join(f"{r} {n}" for r, n in sorted(result["kept"].items()))
        lines.append(
            f"kept {kept} that cannot be re-driven ({why}): undecodable or truncated, held-out, "
            f"or of a cycle the learner has trained already (it is at cycle "
            f"{result['learner_cycle']})"
        )
    return "\n".join(lines)
