"""One copy out of the learner: a publish goes down a chain learner -> m1 -> m2 -> ... -> mN, piece
by piece, each member passing every piece on while the next one arrives (see the package
docstring). This module holds both ends of that: the route a member is given, the links, the
member's ``Forwarder`` and the learner's ``ChainRound`` (who got the version, who failed, retry).

Keys, in each member's own store prefix (``wsync/<member>/<join epoch>/``):
``route`` = ``<version>:<chain epoch>:<position>:<chain length>`` (or ``<version>:pair``),
``result`` = ``<route>|ok`` or ``<route>|err|<reason>`` (then ``end/<route>``, which the learner
checks often), ``progress`` = ``<route>|<pieces>``,
``below`` = ``<route>|<reason>`` when passing the update on to the next member failed.
Link p (p = 1..n) is a pairwise group over ``wsync/chain/<epoch>/link/<p>/``: rank 0 = position
p - 1 (0 = the learner), rank 1 = position p.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from common.weights.group import CANCEL_CHECK_S, broadcast, finish, make_pair_group
from common.weights.layout import WeightSyncError

T = TypeVar("T")

logger = logging.getLogger(__name__)

RELAY_WINDOW_OPS = 4  # collectives a relay keeps in flight to the member below
PROGRESS_EVERY_S = 0.05  # a member reports progress at most this often (a store round trip)
WATCH_SLICE_S = 0.02  # the learner reads the members' states at least this often in a round
END_CHECK_S = 0.002  # and checks this often whether the last member has ended


@dataclass(frozen=True)
class Route:
    version: int
    epoch: int = 0  # 0 = the pairwise path (a join, a catch-up, or fanout = "pairwise")
    position: int = 0
    length: int = 0

    def __str__(self) -> str:
        if not self.epoch:
            return f"{self.version}:pair"
        return f"{self.version}:{self.epoch}:{self.position}:{self.length}"

    @classmethod
    def parse(cls, text: str) -> Route:
        parts = text.split(":")
        if parts[1:] == ["pair"]:
            return cls(int(parts[0]))
        return cls(*(int(x) for x in parts))  # type: ignore[arg-type]


def link(host: str, port: int, epoch: int, position: int, rank: int, *, backend: str,
         timeout_s: float):  # fmt: skip
    """The pairwise group of link ``position`` of chain ``epoch`` (blocks until both ends are in).

    It meets over a store client of its own: a rendezvous holds its client's lock while it waits
    for the other end, and the learner's watch and a member's checks must go on meanwhile."""
    import torch.distributed as dist

    client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    prefix = f"wsync/chain/{epoch}/link/{position}/"
    return make_pair_group(dist.PrefixStore(prefix, client), rank, backend=backend,
                           timeout_s=timeout_s)  # fmt: skip


_holders: dict[threading.Thread, threading.Event] = {}  # release_later's threads, until done
_holders_lock = threading.Lock()


def release_later(groups, *, after_s: float) -> None:
    """Let go of process groups on a helper thread, ``after_s`` (their ops' timeout) from now, or
    at ``release_held()``: a gloo group with an op still pending (a peer that stopped) blocks in
    its destructor until that op times out, and whoever drops the last reference pays for it.
    This thread holds one until then, so that it is not the caller's time (nor that of an
    exception's traceback)."""
    now = threading.Event()

    def hold(held=groups) -> None:
        now.wait(after_s)
        held = None  # noqa: F841 - dropped here, on this thread
        with _holders_lock:
            _holders.pop(threading.current_thread(), None)

    th = threading.Thread(target=hold, name="wsync-release", daemon=True)
    with _holders_lock:
        _holders[th] = now
    th.start()


def release_held(wait_s: float) -> None:
    """Let go now of every group ``release_later`` holds, waiting up to ``wait_s`` for it. For a
    process that ends: a gloo group still alive when the interpreter shuts down can abort it
    (its worker threads hold finished ops' tensors, whose release then needs the GIL:
    "terminate called without an active exception")."""
    with _holders_lock:
        held = list(_holders.items())
    for _, now in held:
        now.set()
    until = time.monotonic() + wait_s
    for th, _ in held:
        th.join(max(0.0, until - time.monotonic()))


def cancellable(fn: Callable[[], T], deadline: float, cancelled: Callable[[], bool]) -> T:
    """``fn()`` (a group's rendezvous, which cannot be interrupted) on a helper thread, given up
    at ``deadline`` or when ``cancelled()``: a member above that stopped before the rendezvous
    must not keep this one from the learner's next round."""
    outcome: Future[T] = Future()

    def run() -> None:
        try:
            outcome.set_result(fn())
        except Exception as e:  # noqa: BLE001 - raised in the caller's thread below
            outcome.set_exception(e)

    threading.Thread(target=run, name="wsync-link", daemon=True).start()
    while not futures.wait([outcome], timeout=CANCEL_CHECK_S).done:
        if time.monotonic() >= deadline or cancelled():
            raise WeightSyncError(
                "the member above in the chain did not connect (round called off)"
            )
    return outcome.result()


class Forwarder:
    """A member's relay: builds (or reuses) the link to the next member and sends it every tensor
    put in, in order, on its own thread, so that receiving never waits for the next member. A
    failure downstream stops forwarding and is recorded; it never fails this member's own receive
    (the learner blames the first member that did not get the version, not the one above it)."""

    def __init__(self, make_link, deadline: float, cancelled, on_error) -> None:
        self._make_link, self.deadline, self.cancelled = make_link, deadline, cancelled
        self._on_error = on_error
        self._q: queue.Queue = queue.Queue()
        self.error: str | None = None
        self.pg: Any = None
        self._thread = threading.Thread(target=self._run, name="wsync-forward", daemon=True)
        self._thread.start()

    def put(self, t) -> None:
        self._q.put(t)

    def close(self) -> None:
        self._q.put(None)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            self.pg = self._make_link()
            ops: deque = deque()  # a few in flight, as the learner sends them (transfer.py)
            while (t := self._q.get()) is not None:
                ops.append(broadcast(self.pg, t))
                while len(ops) > RELAY_WINDOW_OPS or (ops and self._q.empty()):
                    finish(self.pg, ops.popleft(), self.deadline, self.cancelled)
                    self._q.task_done()
            while ops:
                finish(self.pg, ops.popleft(), self.deadline, self.cancelled)
                self._q.task_done()
        except Exception as e:  # noqa: BLE001 - recorded; the learner sees the next member fail
            self.error = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            logger.warning("weight sync: passing the update on failed: %s", self.error)
            self._on_error(self.error)
        finally:
            self.pg = None  # any wait in its destructor is this thread's
            with self._q.mutex:  # let go of the views still queued: their buffer may be freed
                self._q.queue.clear()
                self._q.unfinished_tasks = 0
                self._q.all_tasks_done.notify_all()


def _wait_end(x: _Watch, timeout_s: float) -> None:
    """Until ``x``'s member reports its end of the round (``end/<route>``, set with its
    ``result``; the last member of a chain ends last) or ``timeout_s``: one key checked every
    ``END_CHECK_S``, so the round learns of the end at once, while every member's state is read
    once per slice (reading them all every 2 ms took a CPU core's worth of time from the send it
    watched, measured with py-spy; the store's own blocking ``wait`` ignored its timeout)."""
    until = time.monotonic() + timeout_s
    key = f"end/{x.route}"
    while time.monotonic() < until:
        if x.member.store.check([key]):
            return
        time.sleep(END_CHECK_S)


@dataclass(eq=False)
class _Watch:
    member: Any
    route: str
    seen: str = ""
    changed: float = 0.0  # when ``seen`` last changed (the member had the version then, if ok)


@dataclass
class FirstSend:
    """The learner's own send of a chain round (to the first member): its error once it failed."""

    error: str | None = None


class ChainRound:
    """The learner's side of one publish down a chain: send to the first member, then watch every
    member's ``result`` and ``progress`` until all have the version or the deadline.

    Failure rule: a chain breaks at its first member without the version. That member is blamed
    (dropped; it rejoins through the pairwise path) when it reports an error itself, when it made
    no progress for ``stall_s`` (dead or stopped: a SIGSTOPped process makes none), or when a
    member below it (or the learner's own send) failed and it stayed quiet ``grace_s``. The
    members below it are sent the version again at once, down a new chain (``run`` loops).
    """

    def __init__(self, *, stall_s: float, grace_s: float) -> None:
        self.stall_s, self.grace_s = stall_s, grace_s

    def watch(self, members: list, routes: list[str], sender: FirstSend, deadline: float):
        """Returns (members that have the version, the blamed member or None, its reason, when
        each member that has it had it: ``time.monotonic()`` by member id, to a slice)."""
        now = time.monotonic()
        w = [_Watch(m, r, changed=now) for m, r in zip(members, routes, strict=True)]
        acked: list = []
        while True:
            below = []
            for x in w:
                res, prog, down = (
                    v.decode() for v in x.member.store.multi_get(["result", "progress", "below"])
                )
                state = res if res.startswith(x.route + "|") else prog
                if state != x.seen and state.startswith(x.route + "|"):
                    x.seen, x.changed = state, time.monotonic()
                if down.startswith(x.route + "|"):
                    below.append(down.split("|", 1)[1])
            acked = [x.member for x in w if x.seen == x.route + "|ok"]
            at = {x.member.member_id: x.changed for x in w if x.seen == x.route + "|ok"}
            pending = [x for x in w if x.seen != x.route + "|ok"]
            if not pending:
                return acked, None, "", at
            now = time.monotonic()
            first = pending[0]
            errors = [x for x in pending if x.seen.startswith(x.route + "|err|")]
            if first in errors:
                return acked, first.member, "error: " + first.seen.split("|err|", 1)[1], at
            quiet = now - first.changed
            if quiet > self.stall_s:
                return acked, first.member, f"stalled: no progress for {quiet:.1f} s", at
            signals = [x.seen.split("|err|", 1)[1] for x in errors] + below
            signals += [sender.error] if sender.error else []
            if signals and quiet > self.grace_s:
                return acked, first.member, f"broke the chain ({signals[0]})", at
            if now >= deadline:
                return acked, None, "", at
            _wait_end(pending[-1], min(WATCH_SLICE_S, deadline - now))
