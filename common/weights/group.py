"""The pairwise process group a learner and one generator share (gloo, or NCCL GPU to GPU), its
broadcast, and the deadline every collective is held to (``finish``)."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from common.weights.layout import WeightSyncError

logger = logging.getLogger(__name__)

BACKEND_KEY = "wsync/backend"  # set by the publisher: receivers use the learner's choice
GPU_KEY = "wsync/learner_gpu"  # NCCL: the learner's GPU, so a generator on it can say so
NCCL_WATCHDOG_MARGIN_S = 60.0
PROBE_TIMEOUT_S = 5.0  # connecting to the weight store's port before building the TCPStore client


def default_device(backend: str) -> str:
    """Where update buffers live: this process's current GPU for NCCL, host memory for gloo."""
    if backend == "gloo":
        return "cpu"
    if backend != "nccl":
        raise ValueError(f"weight sync backend must be 'gloo' or 'nccl', got {backend!r}")
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            'weights.backend = "nccl" needs a CUDA GPU in both the learner and the generator '
            '(on different GPUs: NCCL refuses two ranks on one device); use "gloo" (the default)'
        )
    return f"cuda:{torch.cuda.current_device()}"


def probe(host: str, port: int, *, timeout_s: float) -> None:
    """Fail at once when nothing listens at the weight store's address (a learner that died or
    restarted elsewhere): a TCPStore client keeps retrying a refused connection for up to
    ~2 × its timeout (measured: 18.6 s for 10 s), which kept a generator from stopping or
    re-reading the address for minutes with the default 120 s."""
    import socket

    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise WeightSyncError(
            f"the learner's weight store at {host}:{port} is not reachable ({e})"
        ) from e


def gpu_uuid(device: str) -> str:
    import torch

    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


def make_pair_group(store, rank: int, *, backend: str, timeout_s: float):
    """A 2-process group (rank 0 = learner) over ``store``; blocks until both sides are in."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        # Our own deadline (``finish``) aborts a stuck transfer first; NCCL's watchdog, which tears
        # the whole process down on a timeout, gets a later one.
        opts._timeout = timedelta(seconds=timeout_s + NCCL_WATCHDOG_MARGIN_S)
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    raise ValueError(f"weight sync backend must be 'gloo' or 'nccl', got {backend!r}")


def broadcast(pg, tensor):
    """Start a broadcast from rank 0 on a pairwise group; returns the work handle."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([tensor], opts)


def finish(pg, work, deadline: float | None) -> None:
    """Wait for one collective, bounded by ``deadline`` (``time.monotonic()``; None = the group's
    own timeout).

    gloo's ``wait()`` blocks the caller and honours the group's timeout. NCCL's only orders the
    GPU stream and returns at once: completion is polled instead, and a transfer still running at
    the deadline (a peer that died or hangs) aborts the pairwise communicator — only this member
    is lost — instead of leaving NCCL's watchdog to kill the process later.
    """
    if type(pg).__name__ != "ProcessGroupNCCL":
        work.wait()
        return
    while not work.is_completed():
        if deadline is not None and time.monotonic() >= deadline:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - the member is dropped either way
                logger.warning("aborting the NCCL weight group failed", exc_info=True)
            raise WeightSyncError("NCCL weight transfer did not finish before the deadline")
        time.sleep(0.0005)
    work.wait()  # raises the collective's error, if any
