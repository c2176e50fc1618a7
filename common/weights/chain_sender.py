"""The learner's side of a chain round (see the package docstring, "One copy out of the learner"):
the chain epoch and each member's place in it, the learner's one send (to the first member, over
link 1, kept for the epoch), and the retry after a failure (``ChainRound`` blames one member; the
rest get the version again at once down a new chain)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from common.telemetry.metrics import metric
from common.weights.chain import (
    ChainRound,
    FirstSend,
    Route,
    link,
    release_held,
    release_later,
)
from common.weights.group import use_device
from common.weights.pairwise import Reader, error_text
from common.weights.roster import Roster
from common.weights.rounds import Member, RoundOutcome, Update
from common.weights.transfer import send_update

logger = logging.getLogger(__name__)


class ChainSender:
    def __init__(self, roster: Roster, *, host: str, port: int, backend: str, timeout_s: float,
                 device: str) -> None:  # fmt: skip
        self.roster, self.host, self.port = roster, host, port
        self.backend, self.timeout_s, self.device = backend, timeout_s, device
        # a member quiet for a quarter of the deadline is stuck: the rest still get the version
        self.watcher = ChainRound(stall_s=timeout_s / 4, grace_s=min(0.5, timeout_s / 8))
        self.epoch = 0  # the chain epoch (mirrored to Redis by the learner: weights:epoch)
        self._key: list[tuple[str, int]] = []  # the (member, join epoch)s of the current epoch
        self._dirty = False  # the last round failed: the next one starts a new epoch
        self._links1: dict[int, Any] = {}  # chain epoch -> the learner's link to its first member

    def run(self, update: Update, members: list[Member], deadline: float,
            new_pass: Callable[[], Reader], outcome: RoundOutcome) -> None:  # fmt: skip
        """Send ``update`` down a chain of the members this thread can lock now (the others are
        being caught up pairwise and get it from the acceptor); each try reads a new pass
        (``new_pass()``). On a failure blame one member, drop it, and send the rest again at
        once down a new chain."""
        chain = [m for m in self.roster.chain_order(members) if m.lock.acquire(False)]
        results = outcome.per_member
        outcome.members = [m.member_id for m in chain]
        try:
            rest = [m for m in chain if m.version_sent < update.version]
            results.update({m.member_id: "ok" for m in chain if m not in rest})
            while rest and time.monotonic() < deadline:
                epoch, routes = self._route(update.version, rest)
                first = FirstSend()
                reader = new_pass()
                t0 = time.monotonic()
                threading.Thread(target=self._send_first,
                                 args=(update, epoch, first, deadline, reader),
                                 name="wsync-chain", daemon=True).start()  # fmt: skip
                outcome.root_bytes += update.nbytes
                acked, blamed, why, at = self.watcher.watch(rest, routes, first, deadline)
                reader.leave()  # a sender still at it stops at the chain epoch's change
                for m in acked:
                    results[m.member_id], m.version_sent = "ok", update.version
                if len(acked) == len(rest):  # a whole round: each link against the one above
                    order = [m.member_id for m in rest]
                    self.roster.chain_round(order, [at[i] - t0 for i in order], update.nbytes)
                rest = [m for m in rest if m not in acked and m is not blamed]
                if blamed is None:
                    break
                results[blamed.member_id] = why
                self._dirty = True
                self.roster.drop(blamed, why.split(":")[0].split(" ")[0], why)
            for m in rest:
                results[m.member_id], self._dirty = "timeout", True
                self.roster.drop(m, "timeout")
        finally:
            for m in chain:
                m.lock.release()

    def close(self, wait_s: float) -> None:
        """Let go of the learner's links (and those let go of before, still held): see
        ``release_held``."""
        release_later(self._links1, after_s=0.0)
        self._links1 = {}
        release_held(wait_s)

    def _route(self, version: int, rest: list[Member]) -> tuple[int, list[str]]:
        """A new chain epoch when the members changed or the last round failed; every member is
        told its place (``route``) before ``pending`` tells it to look."""
        key = [(m.member_id, m.epoch) for m in rest]
        if key != self._key or self._dirty:
            self._key, self.epoch, self._dirty = key, self.epoch + 1, False
            release_later(self._links1, after_s=self.timeout_s + 1)
            self._links1 = {}
            metric("Gauge", "tether_weights_chain_epoch", "Weight chain epoch").set(self.epoch)
            logger.info("weight sync: chain epoch %d: %s", self.epoch, [k[0] for k in key])
        routes = [Route(version, self.epoch, p, len(rest)) for p in range(1, len(rest) + 1)]
        for m, r in zip(rest, routes, strict=True):
            m.announce(version, r)
        return self.epoch, [str(r) for r in routes]

    def _send_first(self, update: Update, epoch: int, first: FirstSend, deadline: float,
                    reader: Reader) -> None:  # fmt: skip
        """The learner's only send of a chain round: to the first member, over link 1."""
        try:
            use_device(self.device)
            pg = self._links1.get(epoch)
            if pg is None:
                pg = link(self.host, self.port, epoch, 1, 0, backend=self.backend,
                          timeout_s=self.timeout_s)  # fmt: skip
                if epoch == self.epoch:
                    self._links1[epoch] = pg
            send_update(pg, update.header, update.version, reader.units(deadline),
                        lambda k: update.wait_digest(k, deadline), deadline,
                        lambda: self.epoch != epoch, device=self.device)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - ChainRound blames the first member
            first.error = error_text(e)
        finally:
            reader.leave()
