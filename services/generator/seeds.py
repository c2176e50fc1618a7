"""Per-request sampling seeds: a response depends on the run's seed and its place in the data,
never on which other requests shared its batch.

vLLM draws a request that carries a seed from its own generator (``SamplingParams.seed``); one
with ``n`` responses hands response ``i`` the seed ``seed + i``. ``request_seed`` derives a
prompt's seed from (run seed, split, cycle, sampler position), so the ``i``-th response of a
prompt is drawn from (run seed, split, cycle, position, i) whatever else the engine runs beside
it, whichever generator takes it, and again the same when a prompt is redelivered after a crash.
"""

from __future__ import annotations

import hashlib

# Seeds stay below 2**62: vLLM adds the response index, torch's generators take < 2**64.
_SEED_BITS = 62


def _hash(key: str) -> int:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _SEED_BITS)


def request_seed(*, run_seed: int, split: str, cycle: int, index: int) -> int:
    """The seed of one prompt's request: a hash of its coordinates (62 bits)."""
    return _hash(f"tether-sample/{run_seed}/{split}/{cycle}/{index}")


def episode_seed(seed: int | None, *, response: int, turn: int) -> int | None:
    """The seed of turn ``turn`` of response ``response`` of a prompt whose request seed is
    ``seed`` (episodes sample each turn as a request of its own): distinct per response and
    turn, so a group's episodes do not repeat each other's draws. None stays None."""
    return None if seed is None else _hash(f"tether-turn/{seed}/{response}/{turn}")
