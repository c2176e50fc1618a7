"""Generator side: ``join()`` the learner's store, then ``poll()`` cheaply and ``begin()`` when an
update is pending, from the learner (pairwise) or from the member above in the chain, passing it
on to the member below; ``Receipt.units()`` hands it out a verified unit at a time from one
staging buffer (``receive()`` collects it whole). ``version`` moves only when every unit
arrived and matched."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from common.weights import handshake
from common.weights.chain import (
    PROGRESS_EVERY_S,
    Forwarder,
    Route,
    cancellable,
    link,
    release_held,
    release_later,
)
from common.weights.group import (
    BACKEND_KEY,
    GPU_KEY,
    INSTANCE_KEY,
    PROBE_TIMEOUT_S,
    default_device,
    gpu_uuid,
    make_pair_group,
    probe,
    use_device,
)
from common.weights.layout import WeightSyncError
from common.weights.store_calls import CALL_LIMIT_S, BoundedStore, StoreCaller
from common.weights.transfer import IncomingUpdate, StagingBuffer

logger = logging.getLogger(__name__)

ANNOUNCE_CHECK_S = 0.002  # a receiver waiting in begin() looks for the learner's next announcement
POLL_S = 0.25  # and reads ``pending`` and ``dropped`` this often


class WeightReceiver:
    """Generator side: ``join()``, then ``poll()`` cheaply and ``receive()`` when one is pending."""

    def __init__(self, host: str, port: int, member_id: str, *, backend: str = "auto",
                 timeout_s: float = 60.0, device: str | None = None,
                 secret: bytes | None = None) -> None:  # fmt: skip
        if not member_id or ":" in member_id or ";" in member_id or "/" in member_id:
            raise ValueError(f"member_id must be non-empty without ':', ';' or '/': {member_id!r}")
        self.host, self.port, self.member_id = host, port, member_id
        self.backend, self.timeout_s, self.device = backend, timeout_s, device
        self._secret = secret  # the run's shared secret: the learner admits only its holders
        self.version: int | None = None
        self.epoch: int | None = None
        self._instance = ""  # the publisher ``version`` came from
        self.current = -1  # the learner's latest version when it accepted our join (-1: none)
        self._store: Any = None  # BoundedStore: every call answered in time (store_calls.py)
        self._pstore: Any = None  # the same, under this join's prefix
        self._caller: StoreCaller | None = None
        self._pg: Any = None
        self._staging = StagingBuffer(device or "cpu")  # one unit at a time (transfer.py)
        self._announced = 0  # announcements seen in this join epoch's prefix
        self._links: dict[tuple[int, int], Any] = {}  # (chain epoch, link) -> its pairwise group
        self._forwarding: list[Forwarder] = []  # relays still passing the last update on

    @property
    def joined(self) -> bool:
        return self._pg is not None

    def join(self) -> int:
        """Register with the learner (new epoch) and build the pairwise group; returns the epoch."""
        import torch.distributed as dist

        self._pg = None
        try:
            # a new connection at every join: the last one may have been cut mid-request (a
            # partition), and a request that went unanswered leaves its late reply on it
            self._let_go_of_store()
            probe(self.host, self.port, timeout_s=min(self.timeout_s, PROBE_TIMEOUT_S))
            raw = dist.TCPStore(self.host, self.port, is_master=False,
                                timeout=timedelta(seconds=self.timeout_s))  # fmt: skip
            self._caller = StoreCaller(min(self.timeout_s, CALL_LIMIT_S))
            self._store = BoundedStore(raw, self._caller)
            # the publisher sets the key before it can be reached; a store without it is gloo
            has_key = self._store.check([BACKEND_KEY])
            announced = self._store.get(BACKEND_KEY).decode() if has_key else "gloo"
            if self.backend not in ("auto", announced):
                raise WeightSyncError(
                    f"this generator was set to backend {self.backend!r} but the learner "
                    f"publishes over {announced!r}: set weights.backend the same on both"
                )
            self.backend = announced
            self.device = self.device or default_device(announced)
            if str(self._staging.device) != str(self.device):
                self._staging = StagingBuffer(self.device)
            if announced == "nccl" and self._store.get(GPU_KEY).decode() == gpu_uuid(self.device):
                raise WeightSyncError(
                    f"the learner and generator {self.member_id!r} share GPU {self.device}: NCCL "
                    'cannot connect two ranks on one GPU; set weights.backend = "gloo"'
                )
            has_id = self._store.check([INSTANCE_KEY])
            instance = self._store.get(INSTANCE_KEY).decode() if has_id else ""
            if instance != self._instance:  # another learner: its versions start over
                self.version, self._instance = None, instance
            epoch = int(self._store.add(f"wsync/epoch/{self.member_id}", 1))
            prefixed = dist.PrefixStore(f"wsync/{self.member_id}/{epoch}/", raw)
            self._pstore = BoundedStore(prefixed, self._caller)
            self._announced = 0  # the learner counts its announcements per join epoch
            has = -1 if self.version is None else self.version  # not sent again on the catch-up
            join = handshake.signed(self._secret, instance=instance, member=self.member_id,
                                    epoch=epoch, has=has)  # fmt: skip
            self._store.append("wsync/joins", join.entry())
            self.current = self._admitted()
            self._pg = make_pair_group(prefixed, 1, backend=self.backend,
                                       timeout_s=self.timeout_s)  # fmt: skip
        except WeightSyncError:
            raise
        except Exception as e:
            raise WeightSyncError(
                f"could not join the learner's weight sync at {self.host}:{self.port} "
                f"as {self.member_id!r}: {e}. Check that the learner runs and that the "
                "weight sync host/port settings match"
            ) from e
        self.epoch = epoch
        logger.info("weight sync: joined as %s epoch %d", self.member_id, epoch)
        return epoch

    def _let_go_of_store(self) -> None:
        """Drop the store connection; its helper thread ends after any call it is stuck in."""
        self._store = self._pstore = None
        if self._caller is not None:
            self._caller.close()
            self._caller = None

    def _admitted(self) -> int:
        """Wait (up to ``timeout_s``) for the learner to take our join: it sets ``current``
        (its latest version, -1 for none) before its side of the rendezvous, or ``refused``
        with the reason (the weights secret, ``handshake.py``)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self._pstore.check([handshake.REFUSED_KEY]):
                why = self._pstore.get(handshake.REFUSED_KEY).decode()
                raise WeightSyncError(f"the learner refused {self.member_id}'s join: {why}")
            if self._pstore.check(["current"]):
                return int(self._pstore.get("current"))
            if time.monotonic() >= deadline:
                raise WeightSyncError(
                    f"the learner at {self.host}:{self.port} did not take {self.member_id}'s "
                    f"join within {self.timeout_s:g} s"
                )
            time.sleep(0.02)

    def poll(self) -> int | None:
        """The version waiting to be received if it is newer than ours, else None.
        Raises ``WeightSyncError`` when not joined or dropped by the learner (then rejoin)."""
        if self._pg is None:
            raise WeightSyncError(f"{self.member_id} is not joined: call join() first")
        if self._pstore.check(["dropped"]):
            self._pg = None
            reason = self._pstore.get("dropped").decode()
            raise WeightSyncError(f"the learner dropped {self.member_id} ({reason}): rejoin")
        if not self._pstore.check(["pending"]):
            return None
        pending = int(self._pstore.get("pending"))
        return pending if self.version is None or pending > self.version else None

    def receive(self, *, wait_s: float | None = None, on_unit=None) -> tuple[int, list]:
        """The whole update at once (tests, tools): ``(version, [(name, tensor), ...])``, every
        tensor its own until the caller drops it (the units are kept, so this holds the model;
        a generator loads unit by unit instead: ``begin`` and ``Receipt.units``)."""
        receipt = self.begin(wait_s=wait_s)
        named = [nt for _, unit in receipt.units(on_unit=on_unit) for nt in unit]
        return receipt.version, named

    def begin(self, *, wait_s: float | None = None) -> Receipt:
        """Wait up to ``wait_s`` (default ``timeout_s``) for an update, connect to whoever sends
        it (the learner, or the member above in a chain) and receive its preamble and header;
        then ``Receipt.units()`` receives it a unit at a time into one staging buffer.

        Raises ``WeightSyncError`` on timeout, failure, checksum mismatch or a version that is
        not newer (nothing of the update has been handed out then); ``self.version`` changes
        only once every unit arrived and matched. After a failure the receiver must ``join()``
        again unless nothing had arrived yet."""
        deadline = time.monotonic() + (self.timeout_s if wait_s is None else wait_s)
        self._wait_pending(deadline, wait_s)
        text = self._pstore.get("route").decode() if self._pstore.check(["route"]) else "0:pair"
        route, pstore = Route.parse(text), self._pstore
        t_end = time.monotonic() + self.timeout_s
        self._forwarding = [f for f in self._forwarding if f.alive()]
        fwd = pg = None
        try:
            if route.epoch:
                pg = cancellable(lambda: self._chain_link(route, 1), t_end,
                                 lambda: _called_off(pstore, text))  # fmt: skip
                if route.position < route.length:
                    fwd = Forwarder(lambda: self._relay_link(route), t_end,
                                    lambda: _called_off(pstore, text),
                                    lambda why: _report(pstore, f"{text}|{why}", "below"))  # fmt: skip
            else:
                pg = self._pg
            incoming = IncomingUpdate(
                pg, staging=self._staging, deadline=t_end,
                relay=fwd.put if fwd else None,
                progress=_reporter(pstore, text),
                cancelled=lambda: _called_off(pstore, text),
            )  # fmt: skip
            if self.version is not None and incoming.version <= self.version:
                raise WeightSyncError(
                    f"got version {incoming.version} after {self.version}: not newer"
                )
        except Exception as e:
            self._failed(e, route, text, pg, fwd)
            raise AssertionError("unreachable") from None
        return Receipt(self, incoming, route, text, pg, fwd)

    def _wait_pending(self, deadline: float, wait_s: float | None) -> None:
        """Until ``pending`` names a newer version: checks the store's ``announce/<n>`` key (the
        learner sets it after ``route`` and ``pending``) every ``ANNOUNCE_CHECK_S``, and
        ``pending`` itself (and ``dropped``) every ``POLL_S``. A generator calls ``begin`` once
        ``poll()`` found an update pending, so it does not wait here at all."""
        last_poll = time.monotonic()
        while self.poll() is None:
            while not self._pstore.check([f"announce/{self._announced + 1}"]):
                now = time.monotonic()
                if now >= deadline:
                    raise WeightSyncError(f"no weight update arrived within {wait_s} s")
                if now - last_poll >= POLL_S:
                    break
                time.sleep(ANNOUNCE_CHECK_S)
            else:
                self._announced += 1
            last_poll = time.monotonic()

    def _failed(self, e: Exception, route: Route, text: str, pg, fwd) -> None:
        """After a failed update: never reuse its staging buffer (an op left behind may still
        write to it), release the links, tell the learner; raises ``WeightSyncError``."""
        self._staging.drop()
        if fwd is not None:
            fwd.close()
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        if route.epoch:  # the pairwise group is intact: the learner retries or drops us
            release_later((self._links, pg), after_s=self.timeout_s + 1)
            self._links = {}
            _ended(self._pstore, text, f"{text}|err|{reason}")
        else:
            release_later((pg,), after_s=self.timeout_s + 1)
            self._pg = None  # the group is in an unknown state: rejoin
        if isinstance(e, WeightSyncError):
            raise e
        raise WeightSyncError(f"weight update failed mid-transfer: {e}") from e

    def _chain_link(self, route: Route, rank: int):
        """The group of the link above (rank 1) or below (rank 0) this member in the chain of
        ``route``; built once per chain epoch (the rendezvous waits up to ``timeout_s``)."""
        key = (route.epoch, route.position + 1 - rank)
        if key not in self._links:
            if any(k[0] != route.epoch for k in self._links):
                release_later(self._links, after_s=self.timeout_s + 1)
                self._links = {}
            self._links[key] = link(self.host, self.port, key[0], key[1], rank,
                                    backend=self.backend, timeout_s=self.timeout_s)  # fmt: skip
        return self._links[key]

    def _relay_link(self, route: Route):
        """The link below, from the relay's own thread (which must first pick this side's GPU)."""
        use_device(self.device or "cpu")
        return self._chain_link(route, 0)

    def close(self, *, flush_s: float | None = None) -> None:
        """Leave; first let the relays to the members below finish (up to ``flush_s``, default
        ``timeout_s``): a member that exits mid-relay breaks the chain below it."""
        end = time.monotonic() + (self.timeout_s if flush_s is None else flush_s)
        for fwd in self._forwarding:
            fwd.join(max(0.0, end - time.monotonic()))
        self.let_go(release_after_s=0.0)
        release_held(wait_s=5.0)  # none left for the interpreter's shutdown (chain.release_held)

    def let_go(self, *, release_after_s: float | None = None) -> None:
        """Drop everything this receiver holds, waiting for nothing: the store connection (its
        helper thread ends), the staging buffer, and the pairwise groups, released on a helper
        thread ``release_after_s`` from now (default ``timeout_s``: a group with an op pending
        blocks in its destructor until the op times out). For a receiver replaced by one of a
        new weight store: the old learner's chain is gone, so no relay below waits on it."""
        self._forwarding = []
        self._pg = None
        self._let_go_of_store()
        self._staging.drop()
        after_s = self.timeout_s if release_after_s is None else release_after_s
        release_later(self._links, after_s=after_s)
        self._links = {}


class Receipt:
    """One update being received (``WeightReceiver.begin``): ``version``, ``layout`` and
    ``nbytes`` are known; ``units()`` yields ``(k, [(name, tensor), ...])`` for each unit in turn,
    verified, as views into the one staging buffer (valid until the next unit is asked for).
    When the last unit matched, the receiver's ``version`` moves and ``checksum`` is set. A
    failure raises ``WeightSyncError`` from ``units()``; a caller that stops reading before the
    end (its load failed) calls ``abandon(reason)``, which counts as a failure."""

    def __init__(self, rx: WeightReceiver, incoming: IncomingUpdate, route: Route, text: str,
                 pg, fwd) -> None:  # fmt: skip
        self.rx, self.incoming, self.route, self.text = rx, incoming, route, text
        self.pg, self.fwd = pg, fwd
        self.version, self.layout, self.nbytes = incoming.version, incoming.layout, incoming.nbytes
        self.checksum: str | None = None
        self.done = False

    def units(self, on_unit=None) -> Iterator[tuple[int, list]]:
        rx = self.rx
        try:
            yield from self.incoming.units(on_unit=on_unit)
        except GeneratorExit:
            self.abandon("the generator stopped reading the update (its load failed)")
            raise
        except Exception as e:
            self.done = True
            rx._failed(e, self.route, self.text, self.pg, self.fwd)
        self.done = True
        if self.fwd is not None:
            self.fwd.close()
            rx._forwarding.append(self.fwd)  # let it finish passing the last pieces on
        _ended(rx._pstore, self.text, f"{self.text}|ok")
        rx.version, self.checksum = self.version, self.incoming.checksum

    def abandon(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        try:
            self.rx._failed(WeightSyncError(reason), self.route, self.text, self.pg, self.fwd)
        except WeightSyncError:
            pass


def _called_off(pstore, route: str) -> bool:
    """The learner moved this member to another round, or dropped it."""
    if pstore.check(["dropped"]):
        return True
    return pstore.check(["route"]) and pstore.get("route").decode() != route


def _report(pstore, value: str, key: str = "result") -> None:
    try:
        pstore.set(key, value)
    except Exception:  # noqa: BLE001 - the learner then blames us after its stall time
        logger.warning("weight sync: could not report %r to the learner", value, exc_info=True)


def _ended(pstore, route: str, result: str) -> None:
    """The member's outcome of a round: ``result``, then ``end/<route>`` (the learner blocks on
    it, ``chain._wait_end``)."""
    _report(pstore, result)
    _report(pstore, result, f"end/{route}")


def _reporter(pstore, route: str):
    """``progress(n)`` for ``IncomingUpdate``: pieces received, at most every PROGRESS_EVERY_S."""
    last = [0.0]

    def progress(n: int) -> None:
        now = time.monotonic()
        if n == 1 or now - last[0] >= PROGRESS_EVERY_S:
            pstore.set("progress", f"{route}|{n}")
            last[0] = now

    return progress
