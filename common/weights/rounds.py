"""What the learner's publisher keeps per round: the report a publish returns, what a round has
done so far (``RoundOutcome``), each member it sends to (its process group, its store, what it was
last sent) and the update in flight (its layout, its deadline allowance and the running checksum
through each unit, computed beside the sends). ``common.weights.publisher`` runs the rounds with
them (``pairwise``, ``chain_sender``)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from common.weights.chain import Route
from common.weights.checksum import UpdateHasher
from common.weights.layout import WeightSyncError


@dataclass
class PublishReport:
    version: int
    bytes: int
    seconds: float
    checksum: str
    per_member: dict[str, str] = field(default_factory=dict)
    root_bytes: int = 0  # what the learner itself sent: once per chain round, once per pairwise
    epoch: int = 0  # the chain epoch of the last round (0: nothing went down a chain)
    slow: list[str] = field(default_factory=list)  # members sent it in the background


@dataclass
class RoundOutcome:
    """What one round (chain or pairwise) has done so far. Filled as members finish, so that a
    report taken at the deadline holds every outcome known by then, even while the round is still
    dropping the late ones."""

    members: list[str] = field(default_factory=list)  # the members the round serves
    per_member: dict[str, str] = field(default_factory=dict)  # "ok", "timeout", "error: ..."
    root_bytes: int = 0  # what the learner sent in it

    def settled(self) -> dict[str, str]:
        """Every served member's outcome; one the round has not finished with is a timeout (the
        round drops it as such right after the deadline)."""
        return {m: self.per_member.get(m, "timeout") for m in list(self.members)}


@dataclass(eq=False)
class Member:
    member_id: str
    epoch: int
    pg: Any
    store: Any
    version_sent: int = -1
    lock: threading.Lock = field(default_factory=threading.Lock)
    announced: int = 0  # announcements made in its prefix (the receiver blocks on the next)

    def announce(self, version: int, route: Route) -> None:
        """Tell the member where to listen for ``version`` and wake it: ``route``, ``pending``,
        then ``announce/<n>``, on which its receiver blocks (no poll interval to wait out)."""
        self.store.multi_set(["result", "progress", "below", "route"], ["", "", "", str(route)])
        self.store.set("pending", str(version))
        self.announced += 1
        self.store.set(f"announce/{self.announced}", str(version))


@dataclass(eq=False)
class Update:
    version: int
    header: bytes
    layout: dict
    nbytes: int
    allowance_s: float  # its deadline, from the start of a round: grows with its bytes
    units: list | None = None  # the unit buffers when held in memory; None when streamed
    digests: list[bytes] = field(default_factory=list)  # running checksum through unit k
    cond: threading.Condition = field(default_factory=threading.Condition)
    hashing: bool = False  # a hasher reads the current pass

    @property
    def n_units(self) -> int:
        return len(self.layout["units"])

    @property
    def digest(self) -> bytes:
        return self.digests[-1] if len(self.digests) == self.n_units else b""

    @property
    def hashed(self) -> bool:
        return len(self.digests) == self.n_units

    def wait_digest(self, k: int, deadline: float) -> bytes:
        """The running checksum through unit ``k`` once the hasher has it (it reads each unit
        as the senders do, so this waits for at most the unit being sent)."""
        with self.cond:
            while len(self.digests) <= k:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WeightSyncError("checksum not ready before the deadline")
                self.cond.wait(min(left, 0.1))
            return self.digests[k]

    def hash_units(self, units) -> None:
        """Hash ``units`` (the buffers in order), publishing each running digest."""
        hasher = UpdateHasher(self.layout)
        for k, buf in enumerate(units):
            start, end = self.layout["units"][k][:2]
            hasher.upto(buf, start, end)
            with self.cond:
                if k == len(self.digests):  # a pass hashed again after one broke off
                    self.digests.append(hasher.digest())
                self.cond.notify_all()
