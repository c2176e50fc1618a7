"""`tether bench memory --size scale`: each learner rank's memory at the sizes users train, measured
without a GPU, against `tether plan --memory`.

The learner's own code runs at the Qwen3-32B and Qwen3-30B-A3B shapes as rank 0 of 8 under
torch's ``FakeTensorMode`` (tensors with shapes, dtypes and devices but no data) and a fake
process group (``FakeStore``; collectives carry nothing), with torch's FSDP memory tracker
(``FSDPMemTracker``) counting every tensor's bytes as it is made and freed, by kind (sharded
and unsharded parameters, gradients, activations, temporaries, optimizer state). torchtitan's
memory estimate (its ``scripts/estimate``) works the same way.

What runs, as the learner runs it: the model built on the meta device (``shard_loading``),
FSDP2 sharded with bf16 compute and fp32 master weights and gradient reduction
(``model._shard``; with ``learner.cpu_offload``, ``CPUOffloadPolicy``), gradient checkpointing,
AdamW (``optim.build_optimizer``), one ``train_step`` over one micro-batch of
``TOKENS`` tokens per rank (every token after the first a response token: the logits path at
its largest) with the loss of ``token_logprobs_and_entropy``, then the tensors a checkpoint
save hands to DCP (``checkpoint_state.model_state`` / ``optimizer_state``) and a streamed
publish's gather, unit by unit (``gather.stream_units``). Each phase's peak is taken from the
tracker (reset at each phase's start): ``forward_backward`` (up to the optimizer step),
``optimizer`` (the step), ``checkpoint``, ``publish``; the GPU's share after every operator
(``DevicePeak``).

The device is the CPU (torch here has no CUDA, and a fake CUDA tensor cannot run an operator
with autograd on it), so every tensor lands on one device. With offload the "device" bytes are
then the total minus what offload keeps in host memory (sharded parameters and gradients and
the optimizer's state, and the step's own temporaries, which run on the CPU). Three things are
not counted: the CUDA context and NCCL's buffers (``memory_plan.GPU_RUNTIME_BYTES``), the
allocator's fragmentation, and attention's workspace (the CPU's SDPA kernel stands in for the
GPU's). Values the fake tensors cannot give (a loss as a Python float, the gradient norm) are
answered by ``KnownValues`` below; the batch's masks are real tensors, so the response
positions a step selects are those of a real batch.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: TID253 - the fake-tensor step: torch is what it measures

from bench.episodes import provenance
from common.config.shared import BUCKET_MB
from common.weights.layout import build_layout
from services.learner import checkpoint_state, gather, shard_loading
from services.learner import model as model_mod
from services.learner.optim import build_optimizer, build_schedule, build_scheduler
from services.learner.train_step import train_step
from tether.runs.memory_plan import MODELS, phase_peaks

log = logging.getLogger(__name__)

WORLD = 8
TOKENS = 4096
SHAPES = ("qwen3-32b", "qwen3-30b-a3b")
TOLERANCE = 0.10  # the plan within 10 % of the measured peak, per phase
FLOOR_BYTES = 1 << 28  # or within 0.25 GiB: offload's optimizer and checkpoint phases hold ~0
OFFLOADED_KINDS = ("Sharded Param", "Sharded Grad", "OptState")


class KnownValues(TorchDispatchMode):
    """Answers what fake tensors cannot: an operator whose inputs are all real tensors (the
    batch's masks and token ids) runs on them for real; a boolean mask indexing a fake tensor
    becomes the index of its True positions (so the selected rows are counted, not guessed);
    a fake scalar read as a Python number reads 1 (a loss, a norm: finite, so the step runs)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        import torch
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
        from torch.utils._pytree import tree_flatten

        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else 1 if not t.is_floating_point() else 1.0
        if func is torch.ops.aten.index.Tensor:
            self_, indices = args
            real = []
            for i in indices:
                if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
                    with unset_fake_temporarily():
                        real.extend(i.nonzero(as_tuple=True))
                else:
                    real.append(i)
            return func(self_, real)
        return func(*args, **kwargs)


class DevicePeak(TorchDispatchMode):
    """The GPU's share of the tracker's running total after every operator, and its peak:
    everything, or with offload everything but what offload keeps in host memory
    (``OFFLOADED_KINDS``). With offload the GPU's peak need not fall where the total's does (at
    the logits rather than at the end of backward), so it is followed operator by operator."""

    def __init__(self, tracker: Any, *, offload: bool) -> None:
        super().__init__()
        self.tracker, self.offload = tracker, offload
        self.peak = 0

    def now(self) -> int:
        total = 0
        for snap in self.tracker._curr_mem_snap.values():  # read only
            total += snap.get("Total", 0)
            if self.offload:
                total -= sum(
                    v for k, v in snap.items() if getattr(k, "value", k) in OFFLOADED_KINDS
                )
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.distributed.tensor import DTensor

        if any(t == DTensor for t in types):
            return NotImplemented  # as the tracker: count the local operators DTensor runs
        res = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.now())
        return res


def hf_config(name: str) -> Any:
    """The Hugging Face config of a ``memory_plan.MODELS`` shape (its config.json values)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    m = MODELS[name]
    common: dict[str, Any] = dict(hidden_size=m.hidden, num_hidden_layers=m.layers, num_attention_heads=m.heads,
                  num_key_value_heads=m.kv_heads, head_dim=m.head_dim, vocab_size=m.vocab,
                  tie_word_embeddings=m.tied, max_position_embeddings=40960)  # fmt: skip
    if m.experts:
        return Qwen3MoeConfig(moe_intermediate_size=m.intermediate, num_experts=m.experts,
                              num_experts_per_tok=m.experts_per_token, intermediate_size=6144,
                              decoder_sparse_step=1, **common)  # fmt: skip
    return Qwen3Config(intermediate_size=m.intermediate, **common)


def _batch(vocab: int, tokens: int) -> dict[str, Any]:
    import torch

    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    response = torch.ones_like(ids)
    response[:, 0] = 0
    return {"ids": ids, "resp": response, "attn": torch.ones_like(ids)}


class PhasePeaks:
    """Each phase's peak from the tracker (its peak reset at the phase's start; the tracker
    keeps one running peak, so the reset writes its two private fields, as its ``__enter__``
    does)."""

    def __init__(self, tracker: Any, device: DevicePeak) -> None:
        self.tracker, self.device = tracker, device
        self.phases: dict[str, dict[str, int]] = {}
        self.device_peaks: dict[str, int] = {}

    def reset(self) -> None:
        t = self.tracker
        t._peak_mem_snap = t.get_tracker_snapshot("current")
        t._peak_mem = {dev: snap["Total"] for dev, snap in t._peak_mem_snap.items()}
        self.device.peak = self.device.now()

    def end(self, name: str) -> None:
        self.device_peaks[name] = self.device.peak
        snap = self.tracker.get_tracker_snapshot("peak")
        merged: dict[str, int] = {}
        for dev_snap in snap.values():
            for kind, nbytes in dev_snap.items():
                key = str(getattr(kind, "value", kind))  # "Sharded Param", ..., "Total"
                merged[key] = merged.get(key, 0) + int(nbytes)
        self.phases[name] = merged
        self.reset()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.reset()
        yield
        self.end(name)


def measure(name: str, *, offload: bool, tokens: int = TOKENS, world: int = WORLD) -> dict:
    """One shape, one offload setting: the learner's step, a checkpoint's state dict and a
    publish's gather under fake tensors; each phase's peak by kind, in bytes."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # the fake group is this measurement's own: left behind, it would tell every later user of
    # torch.distributed in the process (a test's micro-batches) that there are 8 ranks
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        return _measure(name, offload=offload, tokens=tokens, world=world)
    finally:
        if own:
            dist.destroy_process_group()


def _measure(name: str, *, offload: bool, tokens: int, world: int) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))  # outside fake mode (it reads its rank list)
    device = torch.device("cpu")
    config = hf_config(name)
    batch = _batch(config.vocab_size, tokens)
    t0 = time.monotonic()
    gc.collect()  # the collector stays on, as in the learner
    with FakeTensorMode(allow_non_fake_inputs=True), KnownValues():
        model = shard_loading.build_meta_from_config(config)
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model_mod._shard(model, device=device, param_dtype=torch.bfloat16, offload=offload,
                         mesh=mesh)  # fmt: skip
        model.to_empty(device=device)
        optimizer = build_optimizer(model, lr=1e-6)
        scheduler = build_scheduler(optimizer, build_schedule(warmup_steps=1))
        tracker = FSDPMemTracker(mod=model, optm=optimizer)
        tracker.track_inputs(tuple(batch.values()))
        device_peak = DevicePeak(tracker, offload=offload)
        peaks = PhasePeaks(tracker, device_peak)
        optimizer.register_step_pre_hook(lambda *_: peaks.end("forward_backward"))
        optimizer.register_step_post_hook(lambda *_: peaks.end("optimizer"))

        def loss_fn(m: Any, mb: Any) -> Any:
            logp, _ = model_mod.token_logprobs_and_entropy(m, mb["ids"], mb["attn"],
                                                           mb["resp"])  # fmt: skip
            return -(logp * mb["resp"]).sum() / tokens

        with tracker, device_peak:
            for step in range(2):  # the first step makes AdamW's state; the second is measured
                peaks.reset()
                train_step(model, optimizer, scheduler, [batch], loss_fn, grad_clip=1.0)
                if step == 0:
                    first = dict(peaks.phases)
                    tracker.reset_mod_stats()  # the tracker's per-module stats: one pass each
            with peaks.phase("checkpoint"):
                state = checkpoint_state.model_state(model)
                optim_tensors, _ = checkpoint_state.optimizer_state(model, optimizer)
                del state, optim_tensors
            with peaks.phase("publish"):
                # Under fake tensors the work registry of torch's functional collectives keeps
                # every gathered unit (its wait never runs), so each unit's own rise is taken,
                # from its start, on top of the memory before the publish.
                before = device_peak.now()
                items = gather.publish_items(model)
                specs = gather.publish_specs(items, torch.bfloat16)
                layout = build_layout(specs, 1, int(BUCKET_MB * 2**20))
                rise, start = 0, device_peak.now()
                device_peak.peak = start
                for _k, tensors in gather.stream_units(items, layout, dtype=torch.bfloat16,
                                                       rank0=True, device=device):  # fmt: skip
                    del tensors
                    rise = max(rise, device_peak.peak - start)
                    start = device_peak.now()
                    device_peak.peak = start
            peaks.device_peaks["publish"] = before + rise
    phases = peaks.phases
    return {
        "model": name,
        "offload": offload,
        "world_size": world,
        "tokens_per_micro_batch": tokens,
        "seconds": round(time.monotonic() - t0, 1),
        "phases": phases,
        "first_step_optimizer": first.get("optimizer", {}),
        "device_bytes": dict(peaks.device_peaks),
    }


def compare(measured: dict[str, Any]) -> dict[str, Any]:
    """The plan's per-phase GPU bytes (without the runtime it assumes) beside the measured."""
    plan = phase_peaks(MODELS[measured["model"]], ranks=measured["world_size"],
                       offload=measured["offload"],
                       tokens_per_micro_batch=measured["tokens_per_micro_batch"])  # fmt: skip
    rows = {}
    for phase, got in measured["device_bytes"].items():
        want = plan[phase]
        ratio = want / got if got else (1.0 if not want else float("inf"))
        rows[phase] = {"measured": got, "plan": want, "plan_over_measured": round(ratio, 4),
                       "within": within(want, got)}  # fmt: skip
    return rows


def within(plan: int, measured: int) -> bool:
    """The plan is within ``TOLERANCE`` of the measured bytes, or within ``FLOOR_BYTES``."""
    return abs(plan - measured) <= max(TOLERANCE * measured, FLOOR_BYTES)


def run_scale_bench(*, out_path: Path, quick: bool = False) -> dict[str, Any]:
    shapes = ("qwen3-30b-a3b",) if quick else SHAPES
    runs = []
    for name in shapes:
        for offload in (False, True):
            log.info("memory scale: %s, offload %s", name, offload)
            m = measure(name, offload=offload)
            m["versus_plan"] = compare(m)
            runs.append(m)
    result = {
        "bench": "memory_scale",
        "world_size": WORLD,
        "tokens_per_micro_batch": TOKENS,
        "tolerance": TOLERANCE,
        "runs": runs,
        "all_within": all(r["within"] for m in runs for r in m["versus_plan"].values()),
        **provenance(),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    print(format_scale(result))
    return result


def format_scale(r: dict[str, Any]) -> str:
    """Per model, offload setting and phase: measured GPU bytes per rank, the plan's, the ratio."""
    gib = 2**30
    lines = ["| model | offload | phase | measured (GiB) | plan (GiB) | plan ÷ measured |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for m in r["runs"]:
        for phase, row in m["versus_plan"].items():
            lines.append(
                f"| {m['model']} | {'yes' if m['offload'] else 'no'} | {phase} "
                f"| {row['measured'] / gib:.2f} | {row['plan'] / gib:.2f} "
                f"| {row['plan_over_measured']:.3f}{'' if row['within'] else ' **off**'} |"
            )
    return "\n".join(lines)


def row_scale(r: dict[str, Any]) -> str:
    """The row of bench/README.md's results table: whether every phase is within the tolerance
    (or the floor), and the worst relative miss among the phases above the floor (a phase that
    holds almost nothing, offload's optimizer step, has no meaningful ratio)."""
    rows = [row for m in r["runs"] for row in m["versus_plan"].values()]
    big = [row for row in rows if row["measured"] > FLOOR_BYTES]
    worst = max((abs(row["plan_over_measured"] - 1) for row in big), default=0.0)
    floor = f"{FLOOR_BYTES / 2**30:g} GiB"
    verdict = "every phase within" if r["all_within"] else "**not** every phase within"
    models = ", ".join(sorted({m["model"] for m in r["runs"]}))
    return (
        f"| memory scale | {models}, {r['world_size']} fake ranks, fake tensors | plan ÷ "
        f"measured GPU bytes per rank, each phase | {verdict} {r['tolerance'] * 100:.0f} % or "
        f"{floor}; worst {worst * 100:.1f} % off among the {len(big)} phases over {floor} "
        f"({len(rows) - len(big)} under it) | ≤ {r['tolerance'] * 100:.0f} % | - | "
        "`tether bench memory --size scale` |"
    )
