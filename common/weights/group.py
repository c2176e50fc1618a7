"""The pairwise process group a learner and one generator share (gloo, or NCCL GPU to GPU), its
broadcast, and the deadline every collective is held to (``finish``)."""

from __future__ import annotations

import logging
import math
import socket
import time
from datetime import timedelta

from common.weights.layout import WeightSyncError

logger = logging.getLogger(__name__)

BACKEND_KEY = "wsync/backend"  # set by the publisher: receivers use the learner's choice
GPU_KEY = "wsync/learner_gpu"  # NCCL: the learner's GPU, so a generator on it can say so
INSTANCE_KEY = "wsync/instance"  # one id per publisher: a version means something only within it
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


def use_device(device: str) -> None:
    """Make ``device`` this thread's current GPU (a no-op for host memory): the CUDA device is
    per thread, and every sender or relay thread must start its NCCL ops on its side's GPU."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))


def probe(host: str, port: int, *, timeout_s: float) -> None:
    """Fail at once when nothing listens at the weight store's address (a learner that died or
    restarted elsewhere): a TCPStore client keeps retrying a refused connection for up to
    ~2 × its timeout (measured: 18.6 s for 10 s), which kept a generator from stopping or
    re-reading the address for minutes with the default 120 s."""
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


CANCEL_CHECK_S = 0.05  # how often a waiting collective asks whether its round was called off


def finish(pg, work, deadline: float | None, cancelled=None) -> None:
    """Wait for one collective, bounded by ``deadline`` (``time.monotonic()``; None = the group's
    own timeout) and by ``cancelled`` (a zero-argument callable asked every ``CANCEL_CHECK_S``:
    true = the learner called this round off, e.g. to retry without a stuck member).

    Both backends are waited on in slices, so a deadline or a cancellation ends the wait at once:
    gloo's ``wait(timeout)`` returns as soon as the op completes and raises "Operation timed out!"
    at the end of a slice without harming the op; NCCL's ``wait()`` only orders the GPU stream, so
    its completion is polled. Past the deadline an NCCL communicator is aborted (only this group is
    lost) instead of leaving NCCL's watchdog to kill the process later; a gloo op left behind
    fails by itself at the group's timeout, and its buffer is not reused (see the receiver).
    An op that made no progress for the group's own timeout raises ``Stalled``.

    NCCL's completion is polled without a sleep (``sleep(0)`` only lets other threads run):
    with several ops in flight on the link (``transfer.WINDOW_OPS``) the poll decides when the
    next op is posted, never whether the link is busy.
    """
    try:
        _finish(pg, work, deadline, cancelled)
    except RuntimeError as e:
        if any(m in str(e) for m in GLOO_TIMEOUTS):  # gloo's per-op timeout: the peer is stuck
            raise Stalled(f"weight transfer stalled: {str(e).splitlines()[0][:200]}") from e
        raise


# gloo's own per-op timeout (the group's ``timeout_s``) fails that op with "Timed out waiting
# ..." and closes the pair, so the other ops in flight on it fail with the second message; with
# several in flight (``transfer.WINDOW_OPS``) the one waited on can be either, whichever op's
# timer fired first (measured: 1 in 12 with 4 in flight, a member that misses the deadline
# was reported as an error instead of a timeout).
GLOO_TIMEOUTS = ("Timed out", "Application timeout caused pair closure")


def _finish(pg, work, deadline: float | None, cancelled) -> None:
    nccl = type(pg).__name__ == "ProcessGroupNCCL"
    next_check = time.monotonic() + CANCEL_CHECK_S
    while True:
        now = time.monotonic()
        if nccl:
            if work.is_completed():
                break
            time.sleep(0)
        else:
            limit = min(next_check, deadline) if deadline is not None else next_check
            try:
                # whole milliseconds, at least 1: c10d reads a 0 ms timeout as "wait forever"
                work.wait(timedelta(milliseconds=max(1, math.ceil((limit - now) * 1000))))
                return
            except RuntimeError as e:
                if "Operation timed out!" not in str(e):
                    raise
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            _give_up(pg, nccl, "weight transfer did not finish before the deadline")
        if now >= next_check:
            next_check = now + CANCEL_CHECK_S
            if cancelled is not None and cancelled():
                _give_up(pg, nccl, "weight transfer called off by the learner (new round)")
    work.wait()  # raises the collective's error, if any


class Stalled(WeightSyncError):
    """One collective made no progress for the group's timeout (``timeout_s``): the peer is
    stuck. A deadline that grows with an update's bytes can be later than that."""


def _give_up(pg, nccl: bool, why: str):
    if nccl:
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - the group is dropped either way
            logger.warning("aborting the NCCL weight group failed", exc_info=True)
        why = "NCCL " + why
    raise WeightSyncError(why)
