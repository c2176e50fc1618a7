"""Memory on paper: each learner rank's GPU and host memory for a model shape, a number of FSDP
ranks and the offload settings (``tether plan --memory``).

Per rank, with R ranks, P parameters (FSDP2 full sharding, bf16 compute, fp32 master weights):

- model states: fp32 weights 4P/R, fp32 gradients 4P/R, AdamW's two moments 8P/R = 16P/R bytes;
  with ``learner.cpu_offload`` they live in host memory (FSDP2 CPUOffloadPolicy) instead;
- the frozen reference (``learner.kl_coef > 0``): its fp32 shards 4P/R, in host memory with
  ``learner.reference_cpu_offload``;
- the GPU's peak is that of the learner's highest phase (``phase_peaks``: forward/backward, the
  optimizer step, a checkpoint's state dict, a publish's gather), each phase's terms checked
  against the learner's own step run under fake tensors at 32B, world size 8
  (``tether bench memory --size scale``, ``bench/memory_scale.py``);
- GPU runtime (CUDA context, NCCL buffers, allocator slack): ``GPU_RUNTIME_BYTES``, assumed:
  no GPU was available to measure it (``bench/README.md``);
- host memory per rank: the process (``HOST_PROCESS_BYTES``: Python, torch, transformers; the
  baseline RSS measured by ``tether bench memory`` on a CPU rank) plus the streamed publish's
  window (2 units of ``weights.bucket_mb`` plus the largest tensor, gathered in bf16) plus
  whatever is offloaded (pinned host memory) plus, with ``learner.async_checkpoint``, the copy
  of the model states an asynchronous save writes from (16P/R).

The numbers are a plan, not a promise: fragmentation, a longer micro-batch or a large MoE
routing buffer add to them. ``tether bench memory`` measures the same terms on this machine's
CPU at the Qwen2.5-0.5B shape (bench/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from services.learner.optim import FOREACH_MAX_TEMPORARY_BYTES

GiB = 1 << 30
GPU_RUNTIME_BYTES = 3 * GiB  # assumed (CUDA context ~0.6 GiB, NCCL, allocator slack)
HOST_PROCESS_BYTES = int(1.0 * GiB)  # measured baseline of a learner rank (bench memory)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder-only model: what the memory plan needs of its config."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width; for MoE, each expert's
    vocab: int
    tied: bool = False
    experts: int = 0  # routed experts per layer (0: dense)
    experts_per_token: int = 0
    qkv_bias: bool = False

    @property
    def attention_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return self.hidden * (q + 2 * kv) + q * self.hidden + bias

    @property
    def mlp_params(self) -> int:
        one = 3 * self.hidden * self.intermediate
        return one * self.experts + self.hidden * self.experts if self.experts else one

    @property
    def layer_params(self) -> int:
        return self.attention_params + self.mlp_params + 2 * self.hidden  # + the two norms

    @property
    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def active_intermediate(self) -> int:
        k = self.experts_per_token if self.experts else 1
        return self.intermediate * k


# From the models' config.json (Hugging Face): the shapes users train.
MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape(name="qwen2.5-0.5b", hidden=896, layers=24, heads=14, kv_heads=2,
                   head_dim=64, intermediate=4864, vocab=151936, tied=True, qkv_bias=True),
        ModelShape(name="qwen2.5-7b", hidden=3584, layers=28, heads=28, kv_heads=4,
                   head_dim=128, intermediate=18944, vocab=152064, qkv_bias=True),
        ModelShape(name="qwen3-32b", hidden=5120, layers=64, heads=64, kv_heads=8,
                   head_dim=128, intermediate=25600, vocab=151936),
        ModelShape(name="qwen3-30b-a3b", hidden=2048, layers=48, heads=32, kv_heads=4,
                   head_dim=128, intermediate=768, vocab=151936, experts=128,
                   experts_per_token=8),
    )
}  # fmt: skip


def rank_memory(
    model: ModelShape,
    *,
    ranks: int,
    offload: bool,
    reference: bool = False,
    reference_offload: bool = False,
    tokens_per_micro_batch: int = 4096,
    bucket_bytes: int = 64 << 20,
    async_checkpoint: bool = False,
) -> dict[str, Any]:
    """Bytes per rank on the GPU and in host memory, term by term (module docstring)."""
    if ranks < 1 or tokens_per_micro_batch < 1:
        raise ValueError(f"ranks ({ranks}) and tokens_per_micro_batch must be >= 1")
    p = model.params
    states = 16 * p // ranks
    ref = 4 * p // ranks if reference else 0
    phases = phase_peaks(model, ranks=ranks, offload=offload,
                         tokens_per_micro_batch=tokens_per_micro_batch, bucket_bytes=bucket_bytes)  # fmt: skip
    gpu = {
        "peak_phase": max(phases.values()),  # bench/memory_scale.py measures each phase
        "reference": 0 if reference_offload else ref,
        "runtime": GPU_RUNTIME_BYTES,
    }
    h = model.hidden
    # the largest tensor a publish gathers whole (bf16): the embedding, or a fused projection
    fused = model.intermediate * h * (2 * model.experts if model.experts else 1)
    largest = max(model.vocab * h, fused) * 2
    host = {
        "process": HOST_PROCESS_BYTES,
        "publish_window": 2 * bucket_bytes + largest,
        "offloaded_states": states if offload else 0,
        "offloaded_reference": ref if reference_offload else 0,
        "async_checkpoint_copy": states if async_checkpoint else 0,
    }
    return {
        "model": model.name,
        "params": p,
        "ranks": ranks,
        "offload": offload,
        "gpu_bytes": sum(gpu.values()),
        "host_bytes": sum(host.values()),
        "gpu_terms": gpu,
        "gpu_phases": phases,
        "host_terms": host,
    }


# The logits path as ``token_logprobs_and_entropy`` runs it, bytes per token per vocabulary entry
# at its peak (the start of backward): the bf16 logits (2), the selected rows' bf16 copy (2), their
# fp32 copy (4), and, as backward starts, the logsumexp's softmax and the fp32 gradient (4 + 4).
LOGITS_BYTES_PER_ENTRY = 16


def phase_peaks(
    model: ModelShape, *, ranks: int, offload: bool, tokens_per_micro_batch: int = 4096,
    bucket_bytes: int = 64 << 20,
) -> dict[str, int]:  # fmt: skip
    """Each phase's peak GPU bytes per rank, without ``GPU_RUNTIME_BYTES`` (what
    ``bench/memory_scale.py`` measures under fake tensors, phase by phase):

    - ``forward_backward``: the larger of two moments. At the logits (no gradient yet): the
      model states, the gathered root unit and last layer (and the layer prefetched for the
      backward's recompute), each layer's checkpointed input and the logits path
      (``LOGITS_BYTES_PER_ENTRY``). At the end of backward (the gradients nearly all there):
      the model states and gradients, the root unit still gathered (bf16, from the forward to
      the end of backward), and the layer being reduced: its two gathered copies (it and the
      next, prefetched), its all-gather buffer, its bf16 gradients and their fp32 copy for the
      reduce-scatter (12 bytes × the layer).
    - ``optimizer``: weights, gradients, AdamW's moments and the step's temporary (the
      multi-tensor step: 4P/R; parameter by parameter above ``FOREACH_MAX_TEMPORARY_BYTES``:
      two fp32 copies of the largest shard). With offload the step runs in host memory.
    - ``checkpoint``: the weights and moments (the state a save hands to DCP is views).
    - ``publish``: the weights and moments, plus the unit being gathered whole in bf16 (a
      bucket, or the largest tensor) and this rank's shard of it cast to bf16.

    With ``offload`` the weights, gradients and moments are in host memory; the GPU holds a
    layer's fp32 shard on its way to the all-gather."""
    p, t, h, v = model.params, tokens_per_micro_batch, model.hidden, model.vocab
    layer, root = model.layer_params, model.root_params
    weights, moments, grads = 4 * p // ranks, 8 * p // ranks, 4 * p // ranks
    states = 0 if offload else weights + moments
    on_device_grads = 0 if offload else grads
    shard_in = 4 * max(layer, root) // ranks if offload else 0
    activations = t * h * 2 * model.layers
    gathered = 2 * root + 2 * 2 * layer  # the root and the last layer (and its prefetch), bf16
    at_logits = states + gathered + activations + t * v * LOGITS_BYTES_PER_ENTRY + shard_in
    at_end = states + on_device_grads + 2 * root + 12 * layer + shard_in
    if 4 * p // ranks <= FOREACH_MAX_TEMPORARY_BYTES:
        temporary = 4 * p // ranks
    else:
        temporary = 2 * 4 * _largest_tensor(model) // ranks
    unit = max(bucket_bytes, 2 * _largest_tensor(model))  # bf16, gathered whole on rank 0
    return {
        "forward_backward": max(at_logits, at_end),
        "optimizer": 0 if offload else weights + grads + moments + temporary,
        "checkpoint": states,
        "publish": states + unit + 2 * _largest_tensor(model) // ranks,
    }


def _largest_tensor(model: ModelShape) -> int:
    """Elements of the model's largest tensor: the embedding, or a fused expert projection."""
    fused = 2 * model.intermediate * model.hidden * (model.experts or 1)
    return max(model.vocab * model.hidden, fused)


GPU_HEADROOM = 0.9  # a plan "fits" in 90 % of the GPU: fragmentation and peaks the terms miss


def memory_plan(
    names: list[str],
    *,
    ranks: int,
    gpu_gib: float,
    ranks_per_node: int,
    host_limit_gib: float,
    reference: bool,
    tokens_per_micro_batch: int,
    async_checkpoint: bool = False,
) -> list[dict[str, Any]]:
    """For each model, without and with offload: per-rank GPU and host bytes, the host bytes of
    one pod (``ranks_per_node`` ranks), and whether they fit ``GPU_HEADROOM`` of ``gpu_gib`` and
    ``host_limit_gib`` (a pod's memory limit: deploy/k8s/learner.yaml)."""
    if ranks_per_node < 1 or ranks % ranks_per_node:
        raise ValueError(
            f"--ranks-per-node {ranks_per_node} must divide --learner-ranks {ranks} (pods of "
            "equal size)"
        )
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}: choose from {', '.join(MODELS)}")
    rows = []
    for name in names:
        for offload in (False, True):
            r = rank_memory(MODELS[name], ranks=ranks, offload=offload, reference=reference,
                            reference_offload=offload and reference,
                            tokens_per_micro_batch=tokens_per_micro_batch,
                            async_checkpoint=async_checkpoint)  # fmt: skip
            node = r["host_bytes"] * ranks_per_node
            rows.append({**r, "node_host_bytes": node,
                         "fits_gpu": r["gpu_bytes"] <= GPU_HEADROOM * gpu_gib * GiB,
                         "fits_host": node <= host_limit_gib * GiB})  # fmt: skip
    return rows


def format_rows(rows: list[dict[str, Any]], *, gpu_gib: float, host_limit_gib: float) -> str:
    """The plan as a Markdown table (what the README and deploy/README.md show)."""
    head = (f"| model | params | offload | GPU per rank | fits {gpu_gib:g} GiB | host per rank "
            f"| host per pod | fits {host_limit_gib:g} GiB |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['params'] / 1e9:.2f} B | {'yes' if r['offload'] else 'no'} "
            f"| {r['gpu_bytes'] / GiB:.1f} GiB | {'yes' if r['fits_gpu'] else 'NO'} "
            f"| {r['host_bytes'] / GiB:.1f} GiB | {r['node_host_bytes'] / GiB:.1f} GiB "
            f"| {'yes' if r['fits_host'] else 'NO'} |"
        )
    return "\n".join(lines)
