"""Every collective the learner runs outside FSDP itself, in one place. Each is a no-op (or the
local value) without a process group or with one rank, so the same code runs as a plain
``python`` process, and every rank must call each one in the same order."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _multi_rank() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_world_size() > 1


def rank_world() -> tuple[int, int]:
    """(this rank, number of ranks); (0, 1) without a process group."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    import torch.distributed as dist

    if _multi_rank():
        dist.barrier()


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``t`` summed (or its maximum taken, ``op="max"``) over ranks, in place."""
    import torch.distributed as dist

    if _multi_rank():
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


def global_sum(value: float, device: torch.device) -> float:
    """``value`` summed over ranks (float64)."""
    import torch

    if not _multi_rank():
        return value
    return float(all_reduce(torch.tensor([value], dtype=torch.float64, device=device)).item())


def broadcast_int(value: int, device: torch.device) -> int:
    """Rank 0's ``value`` on every rank."""
    import torch
    import torch.distributed as dist

    if not _multi_rank():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is true on any rank (a barrier that also carries one bit)."""
    import torch

    if not _multi_rank():
        return flag
    return bool(all_reduce(torch.tensor([int(flag)], dtype=torch.int64, device=device), "max"))


# The word rank 0 says at the top of every cycle (``control``): the others wait for it.
# CATCH_UP: a generator joined while rank 0 waits for input; every rank runs a weight publish
# of the current version to it (a streamed publish gathers from every rank), then listens again.
STOP, GO, WAITING, CATCH_UP, FINISH = 0, 1, 2, 3, 4  # FINISH: ended early (`tether finish`)


def control(word: int, stopping: bool, device: torch.device) -> tuple[int, bool]:
    """One control exchange: (rank 0's ``word``, whether any rank is ``stopping``), on every
    rank. The others pass word 0. Rank 0 says WAITING every ``learner.keepalive_s`` while it
    waits for input, so no rank sits in one collective longer than that however long the wait,
    and a rank that got SIGTERM makes every rank stop at the same point."""
    import torch

    if not _multi_rank():
        return word, stopping
    t = all_reduce(torch.tensor([word, int(stopping)], dtype=torch.int64, device=device))
    return int(t[0].item()), bool(t[1].item())


def broadcast_bytes(data: bytes | None, *, rank: int, device: torch.device) -> bytes:
    """Rank 0's ``data`` on every rank: its length, then its bytes (two broadcasts)."""
    import torch
    import torch.distributed as dist

    if not _multi_rank():
        assert data is not None
        return data
    size = broadcast_int(len(data) if rank == 0 and data is not None else 0, device)
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    if rank == 0:
        assert data is not None, "rank 0 broadcasts what it holds"
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, 0)
    return data if rank == 0 and data is not None else buf.cpu().numpy().tobytes()


def set_cpu_threads(device: torch.device, threads: int) -> None:
    """``learner.cpu_threads``: this rank's intra-op threads on CPU (0: leave them as they are)."""
    import torch

    if device.type == "cpu" and threads > 0:
        torch.set_num_threads(threads)
        logging.getLogger(__name__).info(
            "learner: %d intra-op threads on CPU (learner.cpu_threads)", threads
        )
