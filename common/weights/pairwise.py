"""The learner's pairwise round: one pass of an update read by a sender thread per member, each
over the member's own pair group (a join, a catch-up, or ``fanout = "pairwise"``). A member the
round has not finished with at the deadline is dropped as a timeout; the others are not held
back by it."""

from __future__ import annotations

import threading
import time

from common.weights.chain import Route
from common.weights.group import Stalled, use_device
from common.weights.roster import Roster
from common.weights.rounds import Member, RoundOutcome, Update
from common.weights.stream import FeedReader, HeldFeed
from common.weights.transfer import send_update

Reader = FeedReader | HeldFeed


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
                m.announce(update.version, Route(update.version))
                use_device(self.device)  # this sender thread's GPU
                send_update(m.pg, update.header, update.version, reader.units(deadline),
                            lambda k: update.wait_digest(k, deadline), deadline,
                            device=self.device)  # fmt: skip
                m.version_sent = update.version
                return "ok"
            except Exception as e:
                if time.monotonic() >= deadline or isinstance(e, Stalled):
                    return "timeout"  # (dropped as such by run)
                self.roster.drop(m, "error")
                return f"error: {error_text(e)}"
            finally:
                m.lock.release()
