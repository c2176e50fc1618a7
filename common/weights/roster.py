"""The learner's members and the state the publisher's parts share: who is a member (the acceptor
adds, a round drops), the latest update (what a member that joins is waiting for) and whether a
publish holds the members (then the acceptor leaves them to it). One lock guards all of it."""

from __future__ import annotations

import logging
import threading

from common.telemetry.metrics import metric
from common.weights.rounds import Member, Update

logger = logging.getLogger(__name__)


def _members_gauge(n: int) -> None:
    metric("Gauge", "tether_weights_members", "Live weight-sync members").set(n)


def count_failure(reason: str) -> None:
    """``tether_weights_member_failures_total{reason}``: a member dropped, or a join refused."""
    metric("Counter", "tether_weights_member_failures_total", "Member failures",
           ("reason",)).labels(reason).inc()  # fmt: skip


class Roster:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._members: dict[str, Member] = {}
        self.latest: Update | None = None
        self.publishing = False  # while true the acceptor leaves the members to the publish

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
        """As ``behind``, none while a publish holds the members; when some lack the latest
        update, a publish to them holds them from now on (``release`` when it ends)."""
        with self.lock:
            update = self.latest
            if update is None or self.publishing:
                return update, []
            behind = [m for m in self._members.values() if m.version_sent < update.version]
            self.publishing = bool(behind)
            return update, behind

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
