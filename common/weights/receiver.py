"""Generator side: ``join()`` the learner's store, then ``poll()`` cheaply and ``receive()`` when an
update is pending; a failed update leaves the previous complete version in place."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

from common.weights.group import (
    BACKEND_KEY,
    GPU_KEY,
    PROBE_TIMEOUT_S,
    default_device,
    gpu_uuid,
    make_pair_group,
    probe,
)
from common.weights.layout import WeightSyncError
from common.weights.transfer import receive_update

logger = logging.getLogger(__name__)


class WeightReceiver:
    """Generator side: ``join()``, then ``poll()`` cheaply and ``receive()`` when one is pending."""

    def __init__(self, host: str, port: int, member_id: str, *, backend: str = "auto",
                 timeout_s: float = 60.0, device: str | None = None) -> None:  # fmt: skip
        if not member_id or ":" in member_id or ";" in member_id or "/" in member_id:
            raise ValueError(f"member_id must be non-empty without ':', ';' or '/': {member_id!r}")
        self.host, self.port, self.member_id = host, port, member_id
        self.backend, self.timeout_s, self.device = backend, timeout_s, device
        self.version: int | None = None
        self.epoch: int | None = None
        self._store: Any = None
        self._pstore: Any = None
        self._pg: Any = None
        self._spare = self._latest_buf = None

    @property
    def joined(self) -> bool:
        return self._pg is not None

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
            epoch = int(self._store.add(f"wsync/epoch/{self.member_id}", 1))
            self._pstore = dist.PrefixStore(f"wsync/{self.member_id}/{epoch}/", self._store)
            self._store.append("wsync/joins", f"{self.member_id}:{epoch};")
            self._pg = make_pair_group(self._pstore, 1, backend=self.backend,
                                       timeout_s=self.timeout_s)  # fmt: skip
        except Exception as e:
            raise WeightSyncError(
                f"could not join the learner's weight sync at {self.host}:{self.port} "
                f"as {self.member_id!r}: {e}. Check that the learner runs and that the "
                "weight sync host/port settings match"
            ) from e
        self.epoch = epoch
        logger.info("weight sync: joined as %s epoch %d", self.member_id, epoch)
        return epoch

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
        try:
            version, named, _, buf = receive_update(
                self._pg,
                device=self.device or "cpu",
                on_unit=on_unit,
                staging=self._spare,
                deadline=time.monotonic() + self.timeout_s,
            )
        except Exception as e:
            self._pg = None  # the group is in an unknown state: rejoin
            if isinstance(e, WeightSyncError):
                raise
            raise WeightSyncError(f"weight update failed mid-transfer: {e}") from e
        if self.version is not None and version <= self.version:
            raise WeightSyncError(f"got version {version} after {self.version}: not newer")
        self.version = version
        # double buffering: the next update lands in the buffer returned the time before
        # (page-faulting a fresh buffer costs more than the transfer on small machines)
        self._spare, self._latest_buf = self._latest_buf, buf
        return version, named

    def close(self) -> None:
        self._pg = self._pstore = self._store = self._spare = self._latest_buf = None
