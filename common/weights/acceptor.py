"""The learner's acceptor: takes in the joins generators append to the store (see the package
docstring, "Membership"), checks each one's proof (``handshake``), builds the member's pair group
over a store client of its own and adds it to the ``Roster``. On its own thread it does that every
``accept_interval_s`` and then calls back (the publisher catches the new members up)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from common.weights import handshake
from common.weights.group import make_pair_group
from common.weights.roster import Roster, count_failure
from common.weights.rounds import Member

logger = logging.getLogger(__name__)

JOINS_KEY = "wsync/joins"


class Acceptor:
    def __init__(self, store: Any, roster: Roster, *, host: str, backend: str, timeout_s: float,
                 secret: bytes | None, instance: str) -> None:  # fmt: skip
        self.store, self.roster = store, roster
        self.host, self.backend, self.timeout_s = host, backend, timeout_s
        self.secret, self.instance = secret, instance
        self.lock = threading.Lock()  # one pass over the join list at a time
        self._seen = 0  # entries of the join list read
        self._taken: set[tuple[str, int]] = set()  # (member, join epoch)s accepted: no replays
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self, *, wait: bool = True) -> bool:
        """Take in the pending joins; with ``wait=False`` only if no one else is at it (False
        then: that one will)."""
        if not self.lock.acquire(blocking=wait):
            return False
        try:
            self._take_pending()
        finally:
            self.lock.release()
        return True

    def start(self, interval_s: float, then: Callable[[], Any]) -> None:
        """Every ``interval_s`` on a thread of its own: ``then()``, which takes the joins in
        (``take``) and serves them; an error is logged and the thread goes on."""

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    then()
                except Exception:  # keep accepting: one bad join must not stop the acceptor
                    logger.exception("weight sync: accepting members failed")

        self._thread = threading.Thread(target=loop, name="wsync-accept", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s)

    def _take_pending(self) -> None:
        import torch.distributed as dist

        if not self.store.check([JOINS_KEY]):
            return
        entries = self.store.get(JOINS_KEY).decode().split(";")[:-1]
        for entry in entries[self._seen :]:
            self._seen += 1
            # <member>:<join epoch>:<version it holds from this publisher, -1 for none>:<proof>
            try:
                join = handshake.Join.parse(entry)
            except ValueError:
                logger.warning("weight sync: ignoring a malformed join %r", entry[:100])
                continue
            prefix = f"wsync/{join.member}/{join.epoch}/"
            pstore = dist.PrefixStore(prefix, self.store)
            why = handshake.refusal(self.secret, join, instance=self.instance)
            if not why and (join.member, join.epoch) in self._taken:
                why = f"{join.member} epoch {join.epoch} has joined already (a replayed join)"
            if why:
                logger.warning("weight sync: refused a join: %s", why)
                pstore.set(handshake.REFUSED_KEY, why)
                count_failure("refused")
                continue
            self._taken.add((join.member, join.epoch))
            # what the member must wait for (set before it can finish joining)
            pstore.set("current", str(self.roster.latest_version()))
            try:
                # the rendezvous over a client of its own: it holds its client's lock while it
                # waits, and a publish's watch uses the main one meanwhile
                client = dist.TCPStore(self.host, self.store.port, is_master=False,
                                       timeout=timedelta(seconds=self.timeout_s))  # fmt: skip
                pg = make_pair_group(dist.PrefixStore(prefix, client), 0, backend=self.backend,
                                     timeout_s=self.timeout_s)  # fmt: skip
            except Exception as e:
                logger.warning("weight sync: join of %s epoch %s failed: %s", join.member,
                               join.epoch, e)  # fmt: skip
                count_failure("join")
                continue
            self.roster.add(Member(join.member, join.epoch, pg, pstore, join.has))
