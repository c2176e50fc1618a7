"""Generator side: ``join()`` the learner's store, then ``poll()`` cheaply and ``receive()`` when an
update is pending, from the learner (pairwise) or from the member above in the chain, passing it
on to the member below; a failed update leaves the previous complete version in place."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

from common.weights import handshake
from common.weights.chain import (
    PROGRESS_EVERY_S,
    Forwarder,
    Route,
    cancellable,
    link,
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
from common.weights.transfer import receive_update

logger = logging.getLogger(__name__)


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
        self._store: Any = None
        self._pstore: Any = None
        self._pg: Any = None
        self._spare = self._latest_buf = None
        self._links: dict[tuple[int, int], Any] = {}  # (chain epoch, link) -> its pairwise group
        self._forwarding: list[tuple[Any, Forwarder]] = []  # buffers still being passed on

    @property
    def joined(self) -> bool:
        return self._pg is not None

    @property
    def last_buffer(self) -> Any:
        """The staging buffer the last ``receive()``'s tensors are views into (a uint8 tensor):
        a tensor-parallel engine passes it on whole to its other workers."""
        return self._latest_buf

    def join(self) -> int:
        """Register with the learner (new epoch) and build the pairwise group; returns the epoch."""
        import torch.distributed as dist

        self._pg = None
        try:
            if self._store is None:
                probe(self.host, self.port, timeout_s=min(self.timeout_s, PROBE_TIMEOUT_S))
                self._store = dist.TCPStore(self.host, self.port, is_master=False,
                                            timeout=timedelta(seconds=self.timeout_s))  # fmt: skip
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
            self._pstore = dist.PrefixStore(f"wsync/{self.member_id}/{epoch}/", self._store)
            has = -1 if self.version is None else self.version  # not sent again on the catch-up
            join = handshake.signed(self._secret, instance=instance, member=self.member_id,
                                    epoch=epoch, has=has)  # fmt: skip
            self._store.append("wsync/joins", join.entry())
            self.current = self._admitted()
            self._pg = make_pair_group(self._pstore, 1, backend=self.backend,
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
        """Wait up to ``wait_s`` (default ``timeout_s``) for an update, receive and verify it.

        Returns ``(version, [(name, tensor), ...])``: views into a staging buffer that stays
        valid until the next-but-one ``receive()`` (two buffers alternate). Raises
        ``WeightSyncError`` on timeout, failure or checksum mismatch; ``self.version`` is then
        unchanged and the receiver must ``join()`` again unless nothing had arrived yet.
        """
        deadline = time.monotonic() + (self.timeout_s if wait_s is None else wait_s)
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise WeightSyncError(f"no weight update arrived within {wait_s} s")
            time.sleep(0.02)
        text = self._pstore.get("route").decode() if self._pstore.check(["route"]) else "0:pair"
        route, pstore = Route.parse(text), self._pstore
        t_end = time.monotonic() + self.timeout_s
        self._forwarding = [(b, f) for b, f in self._forwarding if f.alive()]
        if any(b is self._spare for b, _ in self._forwarding):
            self._spare = None  # still being read by a relay to a slow member: take a fresh one
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
            version, named, _, buf = receive_update(
                pg,
                device=self.device or "cpu",
                on_unit=on_unit,
                staging=self._spare,
                deadline=t_end,
                relay=fwd.put if fwd else None,
                progress=_reporter(pstore, text),
                cancelled=lambda: _called_off(pstore, text),
            )
        except Exception as e:
            # an op left behind may still write into the staging buffer: never reuse it
            self._spare = None
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            if route.epoch:  # the pairwise group is intact: the learner retries or drops us
                release_later((self._links, pg), after_s=self.timeout_s + 1)
                self._links = {}
                _report(pstore, f"{text}|err|{reason}")
            else:
                release_later((pg,), after_s=self.timeout_s + 1)
                self._pg = None  # the group is in an unknown state: rejoin
            if isinstance(e, WeightSyncError):
                raise
            raise WeightSyncError(f"weight update failed mid-transfer: {e}") from e
        finally:
            if fwd is not None:
                fwd.close()
        _report(pstore, f"{text}|ok")
        if fwd is not None:
            self._forwarding.append((buf, fwd))
        if self.version is not None and version <= self.version:
            raise WeightSyncError(f"got version {version} after {self.version}: not newer")
        self.version = version
        # double buffering: the next update lands in the buffer returned the time before
        # (page-faulting a fresh buffer costs more than the transfer on small machines)
        self._spare, self._latest_buf = self._latest_buf, buf
        return version, named

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
        for _, fwd in self._forwarding:
            fwd.join(max(0.0, end - time.monotonic()))
        self._forwarding = []
        self._pg = self._pstore = self._store = self._spare = self._latest_buf = None
        release_later(self._links, after_s=self.timeout_s + 1)
        self._links = {}


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


def _reporter(pstore, route: str):
    """``progress(n)`` for ``receive_update``: pieces received, at most every PROGRESS_EVERY_S."""
    last = [0.0]

    def progress(n: int) -> None:
        now = time.monotonic()
        if n == 1 or now - last[0] >= PROGRESS_EVERY_S:
            pstore.set("progress", f"{route}|{n}")
            last[0] = now

    return progress
