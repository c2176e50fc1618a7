"""The learner's pairwise round: one pass of an update read by a sender thread per member, each
over the member's own pair group (a join, a catch-up, or ``fanout = "pairwise"``). A member is
"ok" once it reports its own end of the round (every unit received, verified and taken), not when
the learner's sends return: those end when the last bytes left the learner, which may still be in
a slow link's queue, where the next round's new route would call them off. A member the round has
not finished with at the deadline is dropped as a timeout; the others are not held back by it.
Each send measures its member's link (``Roster.measured``: a slow member's background sends
bring it back into the chain once its link keeps up)."""

from __future__ import annotations

import threading
import time

from common.weights.chain import Route
from common.weights.group import Stalled, use_device
from common.weights.layout import WeightSyncError
from common.weights.roster import Roster
from common.weights.rounds import Member, RoundOutcome, Update
from common.weights.stream import FeedReader, HeldFeed
from common.weights.transfer import send_update

Reader = FeedReader | HeldFeed
END_CHECK_S = 0.01  # how often a sender checks whether its member reported the round's end


def error_text(e: BaseException) -> str:
    """An error's first line (200 characters at most), or its type's name."""
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


class PairwiseRound:
    def __init__(self, roster: Roster, *, device: str) -> None:
        self.roster, self.device = roster, device

    def run(self, update: Update, members: list[Member], readers: list[Reader], deadline: float,
            outcome: RoundOutcome) -> None:  # fmt: skip
        """Send ``update`` to ``members`` (``readers``: one per member, of one pass), each
        outcome into ``outcome`` as it is known."""
        outcome.members = [m.member_id for m in members]
        outcome.root_bytes = update.nbytes * len(members)
        results = outcome.per_member
        done = threading.Lock()
        by_id = dict(zip(outcome.members, readers, strict=True))

        def one(m: Member) -> None:
            result = self._send_one(m, update, deadline, by_id[m.member_id])
            with done:
                results.setdefault(m.member_id, result)

        threads = [threading.Thread(target=one, args=(m,), daemon=True) for m in members]
        for th in threads:
            th.start()
        for th in threads:
            th.join(max(0.0, deadline - time.monotonic()))
        with done:  # results that arrive later are ignored: they were reported as timeouts
            for m in members:
                if results.setdefault(m.member_id, "timeout") == "timeout":
                    by_id[m.member_id].leave()
                    self.roster.drop(m, "timeout")

    def _send_one(self, m: Member, update: Update, deadline: float, reader: Reader) -> str:
        with reader:
            if not m.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                # held by a chain publish until its deadline: its outcome is that publish's
                return "ok" if m.version_sent >= update.version else "timeout"
            try:
                if m.version_sent >= update.version:
                    return "ok"
                route = Route(update.version)
                m.announce(update.version, route)
                use_device(self.device)  # this sender thread's GPU
                busy_s = send_update(m.pg, update.header, update.version,
                                     reader.units(deadline),
                                     lambda k: update.wait_digest(k, deadline), deadline,
                                     device=self.device)  # fmt: skip
                end = _member_end(m, str(route), deadline)
                if end != "ok":
                    raise WeightSyncError(f"{m.member_id} failed it: {end.removeprefix('err|')}")
                m.version_sent = update.version
                self.roster.measured(m.member_id, update.nbytes, busy_s)
                return "ok"
            except Exception as e:
                if time.monotonic() >= deadline or isinstance(e, Stalled):
                    return "timeout"  # (dropped as such by run)
                self.roster.drop(m, "error")
                return f"error: {error_text(e)}"
            finally:
                m.lock.release()


def _member_end(m: Member, route: str, deadline: float) -> str:
    """The member's outcome of its pairwise round (``end/<route>``, which it sets once it has
    every unit verified and taken, or on failure): ``ok`` or ``err|<why>``. Raises ``Stalled``
    when none came by ``deadline``."""
    key = f"end/{route}"
    while not m.store.check([key]):
        if time.monotonic() >= deadline:
            raise Stalled(f"{m.member_id} did not report the end of version {route} in time")
        time.sleep(END_CHECK_S)
    return m.store.get(key).decode().removeprefix(route + "|")
