"""What a dead letter says about the run: which sampler position of which cycle will never
arrive, and how many generated responses it holds.

A dead-letter entry (``<run>:dead``, written by ``Consumer``) records the message it holds:
``ref`` (its group or prompt id) and, for a prompt or a (scored) group, ``split``, ``cycle``
and ``index`` (the sampler position). An entry whose message decoded keeps the whole payload
(``complete = 1``), so that ``tether bus redrive`` can return it to its stream once the cause is
fixed (``redrive.py``); an undecodable one keeps its first ``DEAD_RAW_BYTES`` only. The learner reads them with ``DeadLetters`` so that a
cycle waiting for a dead-lettered prompt or group goes on without it instead of waiting
forever; the books (``tether status``) count the responses of the dead-lettered groups.
"""

from __future__ import annotations

import time
from collections import defaultdict
from functools import partial
from typing import TYPE_CHECKING, Any

from common.bus.settings import decode_str
from common.protocol import streams, wire

if TYPE_CHECKING:
    from common.bus.client import Bus

# streams whose entries hold generated responses (a prompt holds none)
_GROUP_STREAMS = (streams.GROUPS, streams.SCORED)
DEAD_RAW_BYTES = 4096  # raw bytes kept of an entry that could not be decoded


def dead_letter_fields(
    *, reason: str, detail: str, stream: str, entry_id: str, group: str, consumer: str,
    deliveries: int, service: str, raw: bytes, msg: wire.Message | None, max_bytes: int,
) -> dict[str, Any]:  # fmt: skip
    """The fields of a dead-letter entry. A message that decoded (``msg``) is kept whole, up to
    ``max_bytes``, and marked ``complete``: it can be re-driven."""
    complete = msg is not None and len(raw) <= max_bytes
    return {
        "reason": reason, "detail": detail[:500], "stream": stream, "entry_id": entry_id,
        "group": group, "consumer": consumer, "deliveries": deliveries, "service": service,
        "at": time.time(), "raw": raw if complete else raw[:DEAD_RAW_BYTES],
        "complete": int(complete), **position_fields(msg),
    }  # fmt: skip


def position_fields(msg: wire.Message | None) -> dict[str, str | int]:
    """The fields a dead-letter entry records of ``msg`` (empty strings when unknown, e.g. an
    entry that could not be decoded)."""
    group = msg.group if isinstance(msg, wire.ScoredGroup) else msg
    ref = getattr(group, "group_id", None) or getattr(group, "prompt_id", None) or ""
    if isinstance(group, (wire.PromptMsg, wire.TrajectoryGroup)):
        return {"ref": ref, "split": group.split, "cycle": group.cycle, "index": group.index}
    return {"ref": ref, "split": "", "cycle": "", "index": ""}


def field_of(fields: dict[Any, Any], name: str) -> str:
    value = fields.get(name.encode(), fields.get(name, b""))
    return decode_str(value) if isinstance(value, bytes) else str(value)


def holds_responses(fields: dict[Any, Any]) -> bool:
    """Whether a dead-letter entry is a generated group (train or eval): its responses were
    counted as generated and are now counted as dead-lettered. A prompt holds none, and an
    entry nobody could decode was not published by a generator."""
    return field_of(fields, "stream") in _GROUP_STREAMS and field_of(fields, "split") != ""


class DeadLetters:
    """Rank 0's view of the dead-letter stream: the positions that will never arrive.

    ``poll()`` reads the entries added since the last call (all of them after a restart: the
    stream is durable, so a restarted learner learns the same losses) and records, per
    ``(split, cycle)``, the sampler positions whose prompt or group was dead-lettered.
    """

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._cursor = "-"
        self.lost: dict[tuple[str, int], dict[int, str]] = defaultdict(dict)  # -> index: reason

    def poll(self, count: int = 1000) -> int:
        """Read the new entries; returns how many positions were newly found lost."""
        key, found = self.bus.key(streams.DEAD), 0
        while True:
            start = self._cursor if self._cursor == "-" else f"({self._cursor}"
            rows = self.bus.call(partial(self.bus.redis.xrange, key, start, "+", count),
                                 what="XRANGE dead")  # fmt: skip
            for entry_id, fields in rows:
                self._cursor = decode_str(entry_id)
                split, cycle, index = (field_of(fields, k) for k in ("split", "cycle", "index"))
                if split and cycle.isdigit() and index.isdigit():
                    lost = self.lost[(split, int(cycle))]
                    if int(index) not in lost:
                        lost[int(index)] = field_of(fields, "reason")
                        found += 1
            if len(rows) < count:
                return found

    def of(self, split: str, cycle: int) -> dict[int, str]:
        """Position -> reason, for every lost position of ``cycle`` (an eval round for "eval")."""
        return self.lost.get((split, cycle), {})

    def forget(self, split: str, cycle: int) -> None:
        self.lost.pop((split, cycle), None)
