"""vLLM worker extension: in-place, versioned weight updates from the learner.

Pass ``worker_extension_cls="services.generator.worker_ext.TetherWorkerExtension"`` to the engine;
the methods below run inside the worker process through ``collective_rpc``:

- ``tether_join(host, port, member_id, timeout_s)`` -> ``{"member_id", "epoch", "behind"}``:
  ``behind`` = the learner has (or will have: none published yet) a version this engine lacks,
  and sends it now
- ``tether_poll()`` -> ``{"pending": version | None, "error": str | None}`` (cheap: two store
  lookups; ``error`` set means the learner dropped us or we are not joined: call ``tether_join``)
- ``tether_receive_update(wait_s=None)`` -> ``{"ok", "version", "bytes", "seconds", "checksum",
  "adapter", "error", "mixed"}``: receives the update a unit at a time into one staging buffer,
  verifies each unit's checksum, and loads it with ``model_runner.reload_weights`` before the
  next arrives (``model.load_weights`` breaks on a second load on CPU;
  ``services.generator.update_stream``), or, for a LoRA learner's adapter-only update
  (``adapter`` true), takes it whole and swaps the engine's adapter
  (``services.generator.adapter``). A failed or corrupted update returns ``ok=False``; it leaves
  the previous version loaded when it failed before its first unit, else ``mixed`` is true and
  the engine's version label is dropped until a complete version loads.
- ``tether_check_lora()`` -> None or the reason this engine cannot take adapter updates.
- ``tether_weights_checksum(layout=None)`` -> the checksum of the engine's weights in the
  learner's (Hugging Face) naming, computed like ``common.weights.checksum.tensors_checksum``.
- ``tether_version()`` -> the loaded policy version (None before the first update).
- ``tether_model_info()`` -> ``{"class", "module"}`` of the model vLLM runs: its own
  implementation (``vllm.model_executor.models.llama``) or the Transformers fallback.

Tensor parallelism (``tensor_parallel_size`` > 1): only the engine's TP rank 0 joins the
learner's weight sync, so the engine is one member of the chain and receives each update once.
It passes each unit on to the other TP workers over the engine's own TP group as it arrives (a
JSON table over its CPU group, then the unit's bytes over its device group), and every worker
loads it with ``reload_weights``, whose weight loaders keep the worker's own slice of each
tensor: a worker holds one unit at a time, never the model. The other workers answer ``tether_join``/``tether_poll`` with nothing
(the generator reads TP rank 0's answer, the first).

The worker blocks while it receives and loads (the engine pauses between steps); the generator
service decides what to do with requests in flight. Errors are returned, not raised, so a bad
update never takes the engine core down. Metrics: this runs in vLLM's engine-core process, which
nobody scrapes, so it returns its numbers (version, bytes, seconds) and the generator service
records them in its own process (``services/generator/loop.py``, ``_apply_update``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from common.engine_routing import RoutingRecorder
from common.weights.adapter import ADAPTER_CONFIG, split_adapter
from common.weights.checksum import tensors_checksum
from common.weights.handshake import secret_from_env
from common.weights.layout import WeightSyncError
from common.weights.receiver import WeightReceiver
from services.generator import adapter
from services.generator.update_stream import LoadStream, tp_units, vllm_held

logger = logging.getLogger(__name__)


class TetherWorkerExtension(RoutingRecorder):
    model_runner: Any  # provided by the vLLM worker this class is mixed into
    _tether_rx = None
    _tether_version: int | None = None
    _tether_layout: list | None = None  # [(name, dtype, shape)] of the last update

    def tether_join(self, host: str, port: int, member_id: str, timeout_s: float = 60.0) -> dict:
        if _tp_rank() != 0:  # the engine joins once, through its TP rank 0
            return {"member_id": member_id, "epoch": None, "behind": None}
        rx = self._tether_rx
        if rx is None or (rx.host, rx.port, rx.member_id) != (host, port, member_id):
            # A new weight store is a new learner process (e.g. restarted from a checkpoint):
            # its versions start from the checkpoint, so ours is no reference for "newer".
            if rx is not None:
                _let_go(rx)
            self._tether_rx = WeightReceiver(
                host, port, member_id, timeout_s=timeout_s, secret=secret_from_env()
            )
        else:
            self._tether_rx.version = self._tether_version
        epoch = self._tether_rx.join()
        rx = self._tether_rx
        behind = rx.version is None or rx.current > rx.version
        return {"member_id": member_id, "epoch": epoch, "behind": behind}

    def tether_poll(self) -> dict:
        try:
            if _tp_rank() != 0:
                return {"pending": None, "error": None}  # TP rank 0 answers for the engine
            if self._tether_rx is None:
                raise WeightSyncError("not joined: call tether_join first")
            return {"pending": self._tether_rx.poll(), "error": None}
        except Exception as e:  # noqa: BLE001 - a dead store raises anything; the service rejoins
            kind = "" if isinstance(e, WeightSyncError) else f"{type(e).__name__}: "
            return {"pending": None, "error": f"{kind}{e}"}

    def tether_receive_update(self, wait_s: float | None = None) -> dict:
        """Receive the pending update and load it a unit at a time as it arrives (see the module
        docstring); every TP worker takes part."""
        from vllm.distributed.parallel_state import get_tp_group

        t0 = time.monotonic()
        receipt, error = None, ""
        made = self._tether_rx._staging.allocations if self._tether_rx is not None else 0
        if _tp_rank() == 0:
            try:
                if self._tether_rx is None:
                    raise RuntimeError("not joined: call tether_join first")
                receipt = self._tether_rx.begin(wait_s=wait_s)
            except Exception as e:  # noqa: BLE001 - errors are returned so the engine core survives
                error = str(e) or type(e).__name__
        group = get_tp_group()
        names = [t[0] for t in receipt.layout["tensors"]] if receipt is not None else []
        adapter_update = ADAPTER_CONFIG in names  # rank 0 knows; the others learn it below
        if group.world_size > 1:
            adapter_update = bool(_tp_int(group, int(adapter_update)))
        units = tp_units(receipt, error, group)
        if adapter_update:  # a LoRA learner's adapter (megabytes): taken whole, then swapped
            try:
                named = [(n, t.clone()) for _, unit in units for n, t in unit]
            except Exception as e:  # noqa: BLE001
                return self._tether_failed(str(e) or type(e).__name__)
            version = receipt.version if receipt is not None else -1
            adapter, rest = split_adapter(named)
            adapter_error = self._tether_load_adapter(adapter or {}, rest, version)
            if adapter_error:
                return self._tether_failed(adapter_error)
            return self._tether_loaded(version, named, _checksum(receipt), t0, adapter=True)
        skip = frozenset({"lm_head.weight"}) if self._tether_tied() else frozenset()
        stream = LoadStream(units, skip=skip, held=vllm_held)
        missing = self._tether_load(stream)
        version = receipt.version if receipt is not None else -1
        if group.world_size > 1:  # every worker reaches this point (tp_units ends on all alike)
            version = _tp_int(group, version)
        if stream.error:
            return self._tether_failed(stream.error, mixed=stream.mixed)
        if missing:
            # Loaded in part: vLLM only logs this and keeps the old values of the rest.
            return self._tether_failed(
                f"the update left {len(missing)} engine parameter(s) unchanged: "
                f"{', '.join(missing[:8])}; the learner's tensor names do not map onto this "
                "vLLM model (the engine now mixes versions: restart the generator)", mixed=True,
            )  # fmt: skip
        layout = receipt.layout["tensors"] if receipt is not None else []
        named_meta = [(n, dt, shape) for n, dt, shape, _, _ in layout]
        done = self._tether_loaded(version, named_meta, _checksum(receipt), t0, adapter=False,
                                   nbytes=receipt.nbytes if receipt is not None else 0)  # fmt: skip
        if self._tether_rx is not None:  # staging buffers made for this update (1: one, reused)
            done["staging_allocations"] = self._tether_rx._staging.allocations - made
        return done

    def _tether_failed(self, error: str, *, mixed: bool = False) -> dict:
        """An update that did not load. ``mixed``: some of it did (the engine now mixes two
        versions): its version label is dropped, and the receiver asks the learner for the
        whole current version at its next join."""
        if mixed:
            self._tether_version = None
            if self._tether_rx is not None:
                self._tether_rx.version = None
            logger.error("weight update failed after part of it loaded: %s", error)
        else:
            logger.warning(
                "weight update failed, keeping version %s: %s", self._tether_version, error
            )
        return {"ok": False, "version": self._tether_version, "error": error, "mixed": mixed}

    def _tether_loaded(self, version: int, named: list, checksum: str, t0: float, *,
                       adapter: bool, nbytes: int = 0) -> dict:  # fmt: skip
        """``named``: the adapter's tensors, or the full update's ``(name, dtype, shape)``."""
        self._tether_version = version
        self._tether_layout = None if adapter else [(n, dt, tuple(s)) for n, dt, s in named]
        if adapter:
            nbytes = sum(t.numel() * t.element_size() for _, t in named)
        seconds = time.monotonic() - t0
        kind = "adapter" if adapter else "weights"
        logger.info("loaded %s version %d (%d bytes, %.3f s)", kind, version, nbytes, seconds)
        return {"ok": True, "version": version, "bytes": nbytes, "seconds": seconds,
                "checksum": checksum, "adapter": adapter, "error": None}  # fmt: skip

    def _tether_load_adapter(self, config: dict, named: list, version: int) -> str | None:
        """Swap the engine's LoRA adapter (``services.generator.adapter``); the error, or None."""
        try:
            modules = adapter.load(self.model_runner, config, named)
        except Exception as e:  # noqa: BLE001 - returned: the previous adapter stays loaded
            error = f"the adapter of version {version} was not loaded: {e}"
            logger.error("%s", error)
            return error
        logger.info("adapter version %d acts on %d engine modules", version, modules)
        return None

    def tether_check_lora(self) -> str | None:
        try:
            adapter.check(self.model_runner)
        except adapter.AdapterLoadError as e:
            return str(e)
        return None

    def tether_version(self) -> int | None:
        return self._tether_version

    def tether_model_info(self) -> dict:
        model = self.model_runner.get_model()
        return {"class": type(model).__name__, "module": type(model).__module__}

    def tether_weights_checksum(self, layout: list | None = None) -> str:
        """``layout``: [(name, dtype name, shape)] in the learner's naming; default: the last
        update's. Fused vLLM parameters (qkv_proj, gate_up_proj) are split back by their
        ``output_sizes``; padded vocabulary rows are cut; a tied lm_head reads the head's own
        packed GEMM weight where it has one (CPU), else the embedding."""
        layout = layout if layout is not None else self._tether_layout
        if layout is None:
            raise ValueError(
                "no layout: pass one or receive a full-weights update first (an adapter "
                "update is verified on receipt; its engine copy is checked by log-prob parity)"
            )
        if _tp_size() > 1:
            raise ValueError(
                "with tensor parallelism each worker holds a slice of each tensor: compare the "
                "engine's log-probs with the learner's instead of a checksum of its weights"
            )
        return tensors_checksum([(n, self._tether_engine_tensor(n, s)) for n, _, s in layout])

    # -- helpers

    def _tether_load(self, named) -> list[str]:
        """Load ``named`` (an iterable of ``(name, tensor)``, read once) in place with
        ``reload_weights``; return the engine parameters that it did not load (vLLM's own check
        only logs a warning). A model whose ``load_weights`` reports nothing is not checked."""
        model = self.model_runner.get_model()
        expected = {n for n, _ in model.named_parameters()}
        loaded: list[set[str]] = []
        load_weights = model.load_weights

        def recording(weights):
            result = load_weights(weights)
            if result is not None:
                loaded.append(set(result))
            return result

        model.load_weights = recording  # an instance attribute shadows the method, for this call
        _reset_cpu_moe_kernels(model)
        try:
            self.model_runner.reload_weights(weights_iterator=iter(named))  # a unit at a time
        finally:
            del model.load_weights
        if self._tether_tied():
            _repack_tied_lm_head(model)
        return sorted(expected - set().union(*loaded)) if loaded else []

    def _tether_tied(self) -> bool:
        cfg = self.model_runner.model_config.hf_config
        return bool(getattr(cfg.get_text_config(), "tie_word_embeddings", False))

    def _tether_engine_tensor(self, name: str, shape):
        model = self.model_runner.get_model()
        gemm = False
        if name == "lm_head.weight" and self._tether_tied():
            # A separate tied head computes the logits with its own packed copy on CPU: read
            # that (through its GEMM), not the embedding it was packed from.
            gemm = hasattr(getattr(model, "lm_head", None), "cpu_linear")
            name = name if gemm else "model.embed_tokens.weight"
        module_path, _, pname = name.rpartition(".")
        part = None
        try:
            module = model.get_submodule(module_path)
        except AttributeError:
            module, part = self._tether_fused(model, module_path)
        t = self._tether_read(module, pname, gemm=gemm)
        if part is not None:
            start = sum(module.output_sizes[:part])
            t = t[start : start + module.output_sizes[part]]
        shape = tuple(shape)
        if tuple(t.shape) != shape and t.dim() == len(shape) and t.shape[1:] == shape[1:]:
            t = t[: shape[0]]  # vocabulary rows padded by the engine
        if tuple(t.shape) != shape:
            raise ValueError(f"engine tensor for {name} has shape {tuple(t.shape)}, not {shape}")
        return t

    @staticmethod
    def _tether_fused(model, module_path: str):
        """(fused module, index of the part) for e.g. ``...self_attn.q_proj`` -> qkv_proj, 0."""
        parent, _, leaf = module_path.rpartition(".")
        for fused, parts in (getattr(model, "packed_modules_mapping", {}) or {}).items():
            if leaf in parts:
                return model.get_submodule(f"{parent}.{fused}"), parts.index(leaf)
        raise ValueError(f"the engine has no module for {module_path!r}")

    @staticmethod
    def _tether_read(module, pname: str, *, gemm: bool = False):
        """A parameter's value. vLLM's CPU backend packs linear weights into oneDNN/sgl handles
        and leaves an empty ``weight`` (or, with ``gemm``, a stale one): read it back through
        the layer's own GEMM with an identity input (exact: every output is one weight times
        1.0 plus zeros)."""
        import torch

        p = getattr(module, pname)
        packed = p.numel() == 0 or gemm
        if pname != "weight" or not packed or not hasattr(module, "cpu_linear"):
            return p.detach()
        size = p.shape[1] if p.numel() else module.input_size_per_partition
        eye = torch.eye(size, dtype=p.dtype, device=p.device)
        with torch.no_grad():
            return module.cpu_linear(eye, p, None).t().contiguous()


def _let_go(rx: WeightReceiver) -> None:
    """Drop the receiver of a weight store that was replaced (``WeightReceiver.let_go``); a
    failure is logged, and the new join goes on."""
    try:
        rx.let_go()
    except Exception as e:  # noqa: BLE001 - the old store may be gone in any way
        logger.warning(
            "weight sync: dropping the receiver of %s:%d failed: %s", rx.host, rx.port, e
        )


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().rank_in_group


def _tp_size() -> int:
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().world_size


def _checksum(receipt: Any) -> str:
    """The update's checksum as verified on receipt (TP rank 0; "" on the other workers)."""
    return (receipt.checksum or "") if receipt is not None else ""


def _tp_int(group: Any, value: int) -> int:
    """TP rank 0's ``value`` on every TP worker (over the group's CPU group)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.broadcast(t, src=group.ranks[0], group=group.cpu_group)
    return int(t.item())


def _reset_cpu_moe_kernels(model) -> None:
    """vLLM 0.32 CPU: make the next load re-pack routed-expert weights.

    The CPU MoE kernel needs its expert weights re-packed into a blocked layout
    (``cpu_prepack_moe_weight``) after loading. vLLM does that when it builds the kernel, and
    on a weight update (``moe_kernel`` already set) it skips the step, so reloaded experts stay
    in checkpoint layout and the engine computes garbage — silently (measured: mean |Δ log-prob|
    0.82 after an update of the Qwen3-MoE fixture). With the kernel cleared the reload takes
    the first-load path and packs again. GPU backends do not pack; left alone there.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        method: Any = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None


def _repack_tied_lm_head(model) -> None:
    """vLLM CPU: rebuild a tied output head's GEMM from the embedding just reloaded.

    On CPU, vLLM packs the ``lm_head`` weight for its GEMM (``dispatch_cpu_unquantized_gemm``:
    an sgl-kernel packed copy or a oneDNN handle) when the weights are processed. A tied head
    (Qwen2/Qwen3 <= 4B, Llama-3.2 1B/3B: ``lm_head.tie_weights(embed_tokens)``) shares the
    embedding's parameter but is never loaded itself, so a reload updates the embedding and
    leaves the head's packed copy at the old weights — silently (measured on the tied Qwen3
    fixture after an update of every parameter: mean |Δ log-prob| 0.056, max 1.1). Models that
    compute logits from the embedding module itself (Gemma) have no separate head.
    """
    from vllm.platforms import current_platform

    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not current_platform.is_cpu() or head is None or embed is None or head is embed:
        return
    method: Any = getattr(head, "quant_method", None)
    if getattr(head, "weight", None) is getattr(embed, "weight", None) and method is not None:
        method.process_weights_after_loading(head)
