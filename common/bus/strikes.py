"""Poison evidence: which entries made their consumer fail, as opposed to which were only
delivered again.

Redis counts every delivery of an entry (``times_delivered``), a consumer reading back its own
pending entries after a restart (``XREADGROUP ... 0``) included. That count cannot tell a message
that kills its consumer from a consumer that stopped for another reason while it held the
message: the learner holds scored entries pending until a checkpoint covers their training, so
five learner restarts between two checkpoints (a full disk, OOM kills, node drains) made Redis
count its own valid data as poison.

Tether counts *strikes* instead, per consumer group, in Redis:

- An entry is **in hand** from the moment a consumer takes it for processing until that consumer
  commits, acknowledges or dead-letters it (``inhand:<stream>:<group>``: entry id -> consumer).
- When an entry is delivered again (its consumer's own pending entries after a restart, or a
  claim by a peer after ``bus.claim_idle_s``) while it is still marked in hand, the consumer that
  held it stopped working on it without finishing: it crashed, was killed, or hung past the
  claim time with it. That is a **strike** (``strikes:<stream>:<group>``: entry id -> count).
- An entry with ``bus.max_deliveries`` strikes is dead-lettered (reason ``max_deliveries``): a
  prompt that crashes the vLLM engine every time still ends there.
- A consumer that stops on purpose (SIGTERM) lets go of what it holds (``let_go``): those
  entries are delivered again without a strike. A consumer that holds entries pending on
  purpose (the learner, until its checkpoint) does not track them at all (``strikes=False``):
  its restarts never count against its data.
- **Isolation**: an entry with ``SUSPECT_AT`` strikes or more is a *suspect*; its consumer takes
  it alone, when it holds nothing else, so that entries that were in hand beside a poison entry
  when it struck are not dead-lettered with it: they finish on their own, and the poison fails
  alone.

The marks are removed with the acknowledgement (in the commit script, or in the same
transaction), so the two hashes hold only pending entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from common.protocol import streams

if TYPE_CHECKING:
    from common.bus.client import Bus

SUSPECT_AT = 2  # strikes from which an entry is taken alone

# KEYS: in-hand hash, strikes hash. ARGV: consumer, suspect_at, ids...
# An id still marked in hand gets a strike; every id is then marked in hand by this consumer,
# except suspects (taken later, alone: ``mark``). Returns each id's strikes.
_TAKE_LUA = """
local out = {}
local suspect_at = tonumber(ARGV[2])
for i = 3, #ARGV do
  local id = ARGV[i]
  local n
  if redis.call('HEXISTS', KEYS[1], id) == 1 then
    n = redis.call('HINCRBY', KEYS[2], id, 1)
  else
    n = tonumber(redis.call('HGET', KEYS[2], id) or '0')
  end
  if n < suspect_at then
    redis.call('HSET', KEYS[1], id, ARGV[1])
  else
    redis.call('HDEL', KEYS[1], id)
  end
  out[#out + 1] = n
end
return out
"""


class Strikes:
    """The in-hand and strike marks of one (stream, group), through ``bus``."""

    def __init__(self, bus: Bus, stream: str, group: str) -> None:
        self.bus = bus
        self.in_hand_key = bus.key(streams.in_hand(stream, group))
        self.strikes_key = bus.key(streams.strikes(stream, group))
        self._take = bus.redis.register_script(_TAKE_LUA)

    def take(self, consumer: str, entry_ids: Sequence[str]) -> list[int]:
        """Mark ``entry_ids`` in hand by ``consumer`` (suspects excepted), striking those that
        were still in hand; returns each one's strikes."""
        if not entry_ids:
            return []
        keys = [self.in_hand_key, self.strikes_key]
        args = [consumer, SUSPECT_AT, *entry_ids]
        return [int(n) for n in self.bus.call(lambda: self._take(keys=keys, args=args),
                                              what="take (in-hand marks)")]  # fmt: skip

    def mark(self, consumer: str, entry_id: str) -> None:
        """Mark a suspect in hand as its consumer takes it, alone."""
        self.bus.call(lambda: self.bus.redis.hset(self.in_hand_key, entry_id, consumer),
                      what="HSET in-hand")  # fmt: skip

    def let_go(self, entry_ids: Sequence[str]) -> None:
        """Unmark ``entry_ids``: they stay pending and come back without a strike."""
        if entry_ids:
            self.bus.call(lambda: self.bus.redis.hdel(self.in_hand_key, *entry_ids),
                          what="HDEL in-hand")  # fmt: skip

    def count(self, entry_ids: Sequence[str]) -> list[int]:
        """The strikes of ``entry_ids`` (0 for none)."""
        if not entry_ids:
            return []
        raw = self.bus.call(lambda: self.bus.redis.hmget(self.strikes_key, list(entry_ids)),
                            what="HMGET strikes")  # fmt: skip
        return [int(x) if x is not None else 0 for x in raw]
