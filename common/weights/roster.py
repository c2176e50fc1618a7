"""The learner's members and the state the publisher's parts share: who is a member (the acceptor
adds, a round drops), the latest update (what a member that joins is waiting for), whether a
publish holds the members (then the acceptor leaves them to it) and each member's link rate
(which members are too slow for the chain). One lock guards all of it."""

from __future__ import annotations

import logging
import statistics
import threading

from common.telemetry.metrics import metric
from common.weights.rounds import Member, Update

logger = logging.getLogger(__name__)


# a link is measured on updates of at least this size: below it the socket buffers at both ends
# (several MB each) take most of the update at once and hide the link's rate
MEASURE_MIN_BYTES = 64 << 20


def _members_gauge(n: int) -> None:
    metric("Gauge", "tether_weights_members", "Live weight-sync members").set(n)


def count_failure(reason: str) -> None:
    """``tether_weights_member_failures_total{reason}``: a member dropped, or a join refused."""
    metric("Counter", "tether_weights_member_failures_total", "Member failures",
           ("reason",)).labels(reason).inc()  # fmt: skip


class Roster:
    """``slow_fraction``: a member whose link is below this fraction of the rate of the member
    above it in a chain is slow (0: none is); see ``chain_round``."""

    def __init__(self, *, slow_fraction: float = 0.0) -> None:
        self.lock = threading.Lock()
        self._members: dict[str, Member] = {}
        self.latest: Update | None = None
        self.publishing = False  # while true the acceptor leaves the members to the publish
        self.slow_fraction = slow_fraction
        # by member id, kept across its rejoins: the slow ones, and the chain round in which each
        # other one's link was shown fine (``chain_round``)
        self._slow: set[str] = set()
        self._shown: dict[str, int] = {}
        self._rounds = 0
        self._chain_rate: float | None = None  # bytes/s of the last measured chain round

    def ids(self) -> dict[str, int]:
        """Live members: member id -> join epoch."""
        with self.lock:
            return {m.member_id: m.epoch for m in self._members.values()}

    def all(self) -> list[Member]:
        with self.lock:
            return list(self._members.values())

    def latest_version(self) -> int:
        """The version a member that joins now must wait for (-1: none published yet)."""
        with self.lock:
            return self.latest.version if self.latest else -1

    def open(self, update: Update) -> None:
        """``update`` is the latest, and a publish of it holds the members."""
        with self.lock:
            self.latest, self.publishing = update, True

    def release(self) -> None:
        with self.lock:
            self.publishing = False

    def behind(self, *, unless_publishing: bool = False) -> tuple[Update | None, list[Member]]:
        """The latest update and the members that lack it (none while a publish holds them, if
        ``unless_publishing``)."""
        with self.lock:
            update = self.latest
            if update is None or (unless_publishing and self.publishing):
                return update, []
            return update, [m for m in self._members.values() if m.version_sent < update.version]

    def claim_behind(self) -> tuple[Update | None, list[Member]]:
        """As ``behind``, none while a publish holds the members, and not the slow ones (they
        are sent it in the background); when some lack the latest update, a publish to them
        holds them from now on (``release`` when it ends)."""
        with self.lock:
            update = self.latest
            if update is None or self.publishing:
                return update, []
            behind = [
                m
                for m in self._members.values()
                if m.version_sent < update.version and m.member_id not in self._slow
            ]
            self.publishing = bool(behind)
            return update, behind

    def chain_round(self, order: list[str], seconds: list[float], nbytes: int) -> None:
        """A chain round that failed nowhere: ``order`` the members from the first down,
        ``seconds`` when each had the version from the round's start. A relay passes each
        piece on as it comes, so a member has the update about when its own link or one above
        it has carried it: a member whose time is over 1/``slow_fraction`` times that of the
        member above it is behind a slow link. It leaves the chain (``is_slow``); a member
        below it that is not has shown its link is fine (``chain_order``). The first member's
        link has no one above to be judged against: ``chain_order`` moves it down the next
        round while its link has not been shown, and again when it had the update over
        1/``slow_fraction`` times later than the last round's rate says (its link may have
        become slow; if the learner's own link did, the next round's rate says so and nothing
        more moves). Updates under ``MEASURE_MIN_BYTES`` tell nothing."""
        if nbytes < MEASURE_MIN_BYTES or self.slow_fraction <= 0 or len(order) < 2:
            return
        with self.lock:
            self._rounds += 1
            found = []
            expected = nbytes / self._chain_rate if self._chain_rate else None
            moved = expected is not None and seconds[0] > expected / self.slow_fraction
            if moved:
                self._shown.pop(order[0], None)
            for i in range(1, len(order)):
                if seconds[i] > seconds[i - 1] / self.slow_fraction:
                    found.append((order[i], seconds[i], seconds[i - 1]))
                    self._slow.add(order[i])
                else:
                    self._shown.setdefault(order[i], self._rounds)
            fine = [t for m, t in zip(order, seconds, strict=True) if m not in self._slow]
            if fine:
                self._chain_rate = nbytes / statistics.median(fine)
            slow = len(self._slow)
        self._slow_gauge(slow)
        if moved:
            logger.info(
                "weight sync: the chain's first member %s had the update %.1f s into the round, "
                "over %g times the last rounds' %.1f s: it goes down the chain next round, to be "
                "judged against the member above it", order[0], seconds[0],
                1 / self.slow_fraction, expected,
            )  # fmt: skip
        for mid, t, above in found:
            logger.warning(
                "weight sync: %s had the update %.1f s into the round, the member above it "
                "%.1f s: its link is over %g times slower; it leaves the chain (where it holds "
                "every member below it to its rate) and is sent each version in the background, "
                "from a copy the learner holds", mid, t, above, 1 / self.slow_fraction,
            )  # fmt: skip

    def measured(self, member_id: str, nbytes: int, busy_s: float) -> None:
        """A pairwise send of ``nbytes`` to the member waited ``busy_s`` for its link
        (``send_update``): a slow member whose link now takes updates at ``slow_fraction`` of
        the chain's rate or more goes back into the chain."""
        if nbytes < MEASURE_MIN_BYTES or busy_s <= 0:
            return
        with self.lock:
            rate, chain = nbytes / busy_s, self._chain_rate
            back = bool(member_id in self._slow and chain and rate >= self.slow_fraction * chain)
            if back:
                self._slow.discard(member_id)
            slow = len(self._slow)
        if back and chain:
            self._slow_gauge(slow)
            logger.info("weight sync: %s's link took an update at %.3f GB/s (the chain: %.3f): "
                        "back in the chain", member_id, rate / 1e9, chain / 1e9)  # fmt: skip

    @staticmethod
    def _slow_gauge(n: int) -> None:
        metric("Gauge", "tether_weights_slow_members",
               "Members whose link is too slow for the chain").set(n)  # fmt: skip

    def chain_order(self, members: list[Member]) -> list[Member]:
        """The chain's order: members whose link has been shown fine first (in the order they
        were, so the chain does not change once every link is shown), then the others by id."""
        with self.lock:
            key = {m.member_id: self._shown.get(m.member_id, 1 << 62) for m in members}
        return sorted(members, key=lambda m: (key[m.member_id], m.member_id))

    def is_slow(self, m: Member) -> bool:
        with self.lock:
            return m.member_id in self._slow

    def slow_ids(self) -> list[str]:
        with self.lock:
            return sorted(self._slow)

    def add(self, m: Member) -> None:
        """A joined member (a rejoin replaces its earlier self)."""
        with self.lock:
            self._members[m.member_id] = m
            n = len(self._members)
        _members_gauge(n)
        logger.info("weight sync: %s joined (epoch %s)", m.member_id, m.epoch)

    def drop(self, m: Member, reason: str, detail: str = "") -> None:
        """``reason``: a metric label (one word); ``detail``: what the log says, if more. The
        member is told through its store, and rejoins with a new epoch."""
        with self.lock:
            if self._members.get(m.member_id) is not m:
                return
            del self._members[m.member_id]
            n = len(self._members)
        _members_gauge(n)
        count_failure(reason)
        logger.warning("weight sync: dropped %s (epoch %d): %s", m.member_id, m.epoch,
                       detail or reason)  # fmt: skip
        try:
            m.store.set("dropped", reason)
        except Exception:  # the store is ours; a failure here only delays the rejoin
            logger.debug("could not mark %s dropped", m.member_id, exc_info=True)

    def clear(self) -> None:
        with self.lock:
            self._members.clear()
