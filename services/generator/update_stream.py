"""The generator's side of one update at the sizes users train: the tensors go into the engine a
unit at a time as they arrive, so a worker never holds a second copy of the model.

TP rank 0 receives each unit (``common.weights.receiver.Receipt``: one staging buffer, every
unit verified before it is handed out) and passes it to the engine's other TP workers over the
engine's TP group (``tp_units``: the unit's table over its CPU group, its bytes over the device
group), and every worker loads it with vLLM's weight loaders, which keep the worker's own slice.
``LoadStream`` turns the units into the ``(name, tensor)`` iterator ``reload_weights`` reads,
and lets each unit's memory go before the next arrives.

Memory per worker besides its own weights, at any moment of an update:
    one unit (``max(weights.bucket_mb, the largest tensor)``, whole, not yet sliced)
    + what vLLM's layerwise reload holds itself: the layer being loaded, materialised at the
      worker's slice, and the source tensors of a fused layer (q/k/v, gate/up, experts) until
      its last part arrives (its loaders copy them only then).
A failure before the first unit is handed out leaves the previous version whole; after it, the
engine mixes versions (``LoadStream.mixed``) until a complete one loads.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

from common.weights.layout import WeightSyncError, dtype_of
from common.weights.transfer import StagingBuffer, tensor_at

logger = logging.getLogger(__name__)


class LoadStream:
    """Iterate for an update's ``(name, tensor)``s, unit after unit (``units``: ``(k, named)``
    pairs). The loader must copy what it keeps: before the next unit is received, every tensor
    of the last one that the loader does not hold (``held()``: ids of tensors it keeps, e.g.
    vLLM's layerwise reload buffering a fused layer's parts) is emptied, and each one it holds
    is moved to memory of its own, so the staging buffer is free to take the next unit. A failure ends the iteration instead of raising into the
    loader (vLLM's reload would stay half done): it is kept in ``error``."""

    def __init__(self, units: Iterator[tuple[int, list]], *, skip: frozenset[str] = frozenset(),
                 held: Callable[[], set[int]] = set) -> None:  # fmt: skip
        self._units, self.skip, self.held = units, skip, held
        self.error = ""
        self.units_handed = 0

    @property
    def mixed(self) -> bool:
        """The update failed after some of it was handed to the loader."""
        return bool(self.error) and self.units_handed > 0

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        handed: list = []
        while True:
            self._release(handed)
            try:
                item = next(self._units, None)
            except Exception as e:  # noqa: BLE001 - kept: the loader finishes with what it has
                self.error = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
                return
            if item is None:
                return
            named = item[1]
            item = None
            self.units_handed += 1
            for name, t in named:
                if name not in self.skip:
                    handed.append(t)
                    yield name, t
            named = t = None  # type: ignore[assignment]

    def _release(self, handed: list) -> None:
        if not handed:
            return
        keep = self.held()
        for t in handed:
            if id(t) in keep:
                # kept until its layer is complete: given memory of its own (a copy of a layer's
                # part, not the whole unit), so the staging buffer is free for the next unit
                # now. Left on the buffer, each such unit made the next one wait
                # ``transfer.RELEASE_WAIT_S`` and take a temporary buffer of its size: 7 s of
                # every 538 MB update of SmolLM2-135M (about 150 units), on an idle machine.
                t.set_(t.clone())
        if handed[0].device.type == "cuda":  # the copies from it are queued, not done
            import torch

            torch.cuda.current_stream(handed[0].device).synchronize()
        for t in handed:
            if id(t) not in keep:
                t.set_()  # the loader is done with it; its loop variable may still name it
        handed.clear()


def vllm_held() -> set[int]:
    """Ids of the tensors vLLM's layerwise reload keeps until their layer is complete."""
    from vllm.model_executor.model_loader.reload import layerwise

    held: set[int] = set()
    for info in list(layerwise.LAYERWISE_INFO.values()):
        for _, args in getattr(info, "loaded_weights", None) or ():
            held.update(id(v) for v in args.arguments.values() if hasattr(v, "data_ptr"))
    return held


def tp_units(receipt: Any, error: str, group: Any) -> Iterator[tuple[int, list]]:
    """Every TP worker: the update's units in turn, ``(k, [(name, tensor), ...])``. TP rank 0
    reads ``receipt`` (None with ``error`` when it could not start) and sends each unit to
    the others: a JSON table (names, dtypes, shapes, offsets; or the end, with the error if
    any) over the group's CPU group, then the unit's bytes over its device group. Any worker
    raises ``WeightSyncError`` when rank 0's receipt failed."""
    import torch

    if group is None or group.world_size == 1:
        if receipt is None:
            raise WeightSyncError(error)
        yield from receipt.units()
        return
    if group.rank_in_group == 0:
        try:
            if receipt is None:
                raise WeightSyncError(error)
            for k, named in receipt.units():
                buf = receipt.incoming.current
                base = buf.data_ptr()
                table = [[n, str(t.dtype).removeprefix("torch."), list(t.shape),
                          t.data_ptr() - base, t.numel() * t.element_size()]
                         for n, t in named]  # fmt: skip
                _send_table(group, {"k": k, "tensors": table, "total": buf.numel()})
                group.broadcast(buf if buf.device == group.device else buf.to(group.device), 0)
                buf = None
                yield k, named
        except WeightSyncError as e:
            _send_table(group, {"end": True, "error": str(e)})
            raise
        _send_table(group, {"end": True, "error": ""})
        return
    staging = StagingBuffer(group.device)
    while True:
        head = _recv_table(group)
        if head.get("end"):
            if head["error"]:
                raise WeightSyncError(head["error"])
            return
        buf = staging.take(int(head["total"]))
        group.broadcast(buf, 0)
        named = [(n, tensor_at(buf, off, dtype_of(dt), shape))
                 for n, dt, shape, off, _ in head["tensors"]]  # fmt: skip
        buf = None
        yield int(head["k"]), named
        named = None  # type: ignore[assignment]
        if torch.cuda.is_available() and str(group.device).startswith("cuda"):
            torch.cuda.current_stream().synchronize()


def _send_table(group: Any, table: dict) -> None:
    import torch
    import torch.distributed as dist

    raw = json.dumps(table).encode()
    dist.broadcast(torch.tensor([len(raw)], dtype=torch.int64), src=group.ranks[0],
                   group=group.cpu_group)  # fmt: skip
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.broadcast(data, src=group.ranks[0], group=group.cpu_group)


def _recv_table(group: Any) -> dict:
    import torch
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=group.ranks[0], group=group.cpu_group)
    data = torch.zeros(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=group.ranks[0], group=group.cpu_group)
    return json.loads(bytes(data.numpy()))
