"""Policy / reference models for the learner: process group, FSDP2 sharding, log-probs, weights.

One code path for CPU and GPU: the device decides the backend (gloo on CPU, NCCL on CUDA) and the
precision (fp32 on CPU; bf16 compute with fp32 master weights and fp32 gradient reduction on GPU).

Gradient reduction: FSDP2 averages gradients over ranks by default. Tether's loss functions return
a loss already normalised by the *whole step's* denominator (all ranks, all micro-batches), so the
right reduction is a plain sum. ``load_policy`` sets every FSDP unit's divide factor to 1 with
sum-only collectives, which makes an N-rank step produce the same gradient as one process that
sums the same micro-batch losses (tested in ``tests/services/test_learner_fsdp.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.ports import free_port
from services.learner import packing

if TYPE_CHECKING:
    import torch

    from services.learner.lora import LoraSettings

logger = logging.getLogger(__name__)


def setup_distributed(
    backend: str | None = None, *, timeout_s: float = 1800.0
) -> tuple[int, int, torch.device]:
    """Join (or create) the default process group; returns ``(rank, world_size, device)``.

    Under ``torchrun`` the ``RANK``/``WORLD_SIZE``/``MASTER_*`` variables are used. Without them a
    one-rank group on a free loopback port is created, so the same learner code runs as a plain
    ``python`` process. ``backend`` defaults to ``nccl`` when CUDA is available, else ``gloo``.
    Calling it again returns the existing group's values.
    """
    import torch
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    backend = backend or ("nccl" if use_cuda else "gloo")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        init_method = "env://"
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        rank, world_size = 0, 1
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    logger.info(
        "process group up: rank %d/%d backend %s device %s", rank, world_size, backend, device
    )
    return rank, world_size, device


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a HF causal LM (``model.model.layers`` for Llama/Qwen-style)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"cannot find decoder layers in {type(model).__name__}: expected `model.model.layers` "
            "(Llama/Qwen/Mistral-style causal LMs); use a model with that layout or fsdp=False"
        )
    return list(layers)


def _shard(model: torch.nn.Module, *, device: torch.device, param_dtype: Any) -> None:
    """FSDP2: one unit per decoder layer, then the root (embeddings, final norm, tied lm_head)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from services.learner.dist import rank_world

    mesh = init_device_mesh(device.type, (rank_world()[1],))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if param_dtype is not None and param_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32
        )
    for layer in _decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum, not mean, over ranks: losses are pre-normalised by the global denominator.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def attention_kwargs(model_dir: str | Path) -> dict[str, Any]:
    """``from_pretrained`` arguments that make transformers compute what vLLM computes.

    Attention soft-capping (Gemma-2: ``attn_logit_softcapping``) is applied by the eager
    implementation only; transformers' default, SDPA, accepts the cap and ignores it without a
    word, and the learner's log-probs then differ from the generator's by nats (measured on the
    Gemma-2 fixture: mean |Δ| 0.40, max 3.2). Such models load with eager attention.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    text_config = config.get_text_config()
    if getattr(text_config, "attn_logit_softcapping", None):
        return {"attn_implementation": "eager"}
    return {}


def _load_hf(model_dir: str | Path, *, device: torch.device, attn: str | None = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise ValueError(
            f"model directory {path} has no config.json: point the learner's model path at a "
            "local Hugging Face model directory (e.g. one written by `tether export`)"
        )
    # Master weights in fp32; mixed precision (if any) is applied by FSDP at compute time.
    # Packing's varlen kernel when asked; else what makes transformers compute what vLLM does.
    extra = {"attn_implementation": attn} if attn else attention_kwargs(path)
    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **extra)
    # Remembered so checkpoints can name the tokenizer's home for `tether export`.
    model.tether_source_dir = str(path.resolve())
    return model.to(device)


def load_policy(
    model_dir: str | Path,
    *,
    device: torch.device,
    param_dtype: torch.dtype | None = None,
    gradient_checkpointing: bool = False,
    fsdp: bool = True,
    pack_sequences: bool = False,
    lora: LoraSettings | None = None,
    seed: int = 0,
) -> Any:
    """Load the trainable policy from a local HF directory, in train mode.

    ``lora``: wrap it with a LoRA adapter (``lora.attach``, seeded with ``seed``) before
    sharding; only the adapter trains.

    ``pack_sequences``: the forward will run packed micro-batches (``packing.py``): on a CUDA
    device with flash-attn installed the model gets ``flash_attention_2`` (varlen), else
    transformers' default (``sdpa``); a probe then refuses a model that ignores the boundaries.

    ``param_dtype``: compute dtype; default bf16 on CUDA (fp32 master weights and fp32 gradient
    reduction via ``MixedPrecisionPolicy``), fp32 on CPU. ``fsdp=True`` needs an initialised
    process group (``setup_distributed``); ``fsdp=False`` returns a plain module (one process).
    """
    import torch

    if param_dtype is None:
        param_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if param_dtype != torch.float32 and not fsdp:
        raise ValueError("a non-fp32 param_dtype needs fsdp=True (mixed precision is FSDP's)")
    varlen = pack_sequences and packing.varlen_attention_available(device)
    model = _load_hf(model_dir, device=device, attn="flash_attention_2" if varlen else None)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None:
        from services.learner import lora as lora_mod

        lora_mod.attach(model, lora, seed=seed)
    if pack_sequences:
        _probe_packing(model, device=device)
    if fsdp:
        _shard(model, device=device, param_dtype=param_dtype)
    model.train()
    return model


def _probe_packing(model: Any, *, device: torch.device) -> None:
    """``packing.check_packing`` on the whole model before sharding: no collectives, and FSDP's
    lazy initialisation still happens at the first training forward (a forward before the
    optimizer exists breaks ``get_optimizer_state_dict``). On CUDA under bf16 autocast (flash-attn
    has no fp32 kernels)."""
    import contextlib

    import torch

    cuda = device.type == "cuda"
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    with ctx:
        gap = packing.check_packing(
            model,
            device=device,
            vocab_size=int(model.config.vocab_size),
            tolerance=5e-2 if cuda else 1e-3,
        )
    logger.info(
        "sequence packing on (attention %s; probe gap %.2g)",
        packing.attention_implementation(model),
        gap,
    )


def load_reference(
    model_dir: str | Path,
    *,
    device: torch.device,
    param_dtype: torch.dtype | None = None,
    fsdp: bool = True,
    pack_sequences: bool = False,
) -> Any:
    """Load a frozen reference model (KL term): no gradients, eval mode.

    ``pack_sequences``: the attention implementation as ``load_policy`` picks it (the policy's
    probe covers the reference: the same architecture).

    It is sharded exactly like the policy (FSDP2 per layer + root) so it costs 1/world_size of the
    memory per rank; its forward all-gathers one layer at a time. Call it under ``torch.no_grad()``.
    """
    import torch

    if param_dtype is None:
        param_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    varlen = pack_sequences and packing.varlen_attention_available(device)
    model = _load_hf(model_dir, device=device, attn="flash_attention_2" if varlen else None)
    model.config.use_cache = False
    model.requires_grad_(False)
    if fsdp:
        _shard(model, device=device, param_dtype=param_dtype)
    model.eval()
    return model


def token_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    with_entropy: bool = False,
    temperature: float = 1.0,
    packed: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (and entropy) of each token given the tokens before it, on response positions.

    Inputs are ``[B, T]``; ``response_mask[b, t] = 1`` marks token ``t`` as a response token.
    Returns ``logp[B, T]`` where ``logp[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` on
    response positions and 0 elsewhere (position 0 is never a response token), and ``entropy``
    of the predictive distribution for those same positions (or ``None``).

    ``temperature``: score ``softmax(logits / temperature)``, the distribution the generator
    sampled from (vLLM reports processed log-probs), so ratios compare like with like.

    ``packed`` (``packing.add_packed``'s fields): run the forward on the packed rows instead of
    the padded ``[B, T]`` batch; the outputs are the same ``[B, T]`` tensors.

    Memory: logits are computed once; only the rows that predict a response token are selected
    and upcast to fp32, and the log-prob uses ``gather - logsumexp`` (no full log-softmax copy).
    The softmax is materialised for the selected rows only when ``with_entropy``.
    """
    import torch

    if input_ids.shape != response_mask.shape or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)}, attention_mask {tuple(attention_mask.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must have the same [B, T] shape"
        )
    if response_mask.numel() and bool(response_mask[:, 0].any()):
        raise ValueError("response_mask[:, 0] must be 0: the first token has no preceding context")
    # logits[:, t] predicts token t + 1.
    pred_mask = response_mask[:, 1:].bool()
    if packed is None:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )
        logits = out.logits[:, :-1][pred_mask].float()  # [N, V]
    else:
        # the packed row position of each token that predicts a response token
        rows = packing.forward_rows(model, packed)
        logits = rows[packed["packed_index"][:, :-1][pred_mask]].float()
    if temperature != 1.0:
        # The generator's behaviour log-probs are those of the distribution it sampled from,
        # softmax(logits / T); the learner scores the same distribution.
        logits = logits / temperature
    targets = input_ids[:, 1:][pred_mask]  # [N]
    lse = torch.logsumexp(logits, dim=-1)
    selected_logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    logp = torch.zeros(input_ids.shape, dtype=torch.float32, device=logits.device)
    logp[:, 1:] = logp[:, 1:].masked_scatter(pred_mask, selected_logp)
    if not with_entropy:
        return logp, None
    probs = torch.softmax(logits, dim=-1)
    selected_entropy = lse - (probs * logits).sum(-1)
    entropy = torch.zeros_like(logp)
    entropy[:, 1:] = entropy[:, 1:].masked_scatter(pred_mask, selected_entropy)
    return logp, entropy


def _is_fsdp(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


class HostStaging:
    """Reusable host memory for repeated weight gathers (the learner's publishes).

    Two flat buffers are used in turn, so the tensors of the previous gather stay intact while the
    next one is written (the weight publisher keeps the latest publish to serve late joiners). On
    CUDA they are page-locked: the device-to-host copies then run at full bus speed and
    asynchronously, instead of faulting fresh pageable pages in every time (measured at the 3B
    shape on an H100: see bench/README.md).
    """

    def __init__(self) -> None:
        self._buffers: list[Any] = [None, None]
        self._turn = 0

    def take(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        import torch

        self._turn ^= 1
        buf = self._buffers[self._turn]
        if buf is None or buf.numel() < nbytes:
            self._buffers[self._turn] = None  # free the old one before allocating the new one
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            self._buffers[self._turn] = buf
        return buf


def full_state_dict_cpu(
    model: torch.nn.Module,
    *,
    drop_tied: bool = True,
    dtype: torch.dtype | None = None,
    staging: HostStaging | None = None,
) -> dict[str, Any]:
    """Full (unsharded) weights with Hugging Face names, on CPU, on rank 0 (``{}`` elsewhere).

    A collective under FSDP: every rank must call it. Tensors are gathered one at a time on the
    device (peak extra device memory: the largest tensor), cast to ``dtype`` there when given
    (e.g. bf16 for a weight publish: half the bytes to copy, hash and send), and copied to CPU
    on rank 0: into fresh tensors by default (checkpoints, exports), or into views of a
    ``staging`` buffer (publishes; valid until the next-but-one call with that staging). Default
    dtype: the master weights' (fp32). With ``drop_tied`` the ``lm_head.weight`` of a
    tied-embedding model is left out (HF and vLLM loaders re-tie it; vLLM's ``load_weights``
    expects it absent).
    """
    import torch
    from torch.distributed.tensor import DTensor

    from services.learner.dist import rank_world

    rank0 = rank_world()[0] == 0
    tied = drop_tied and getattr(model.config, "tie_word_embeddings", False)
    items = [(n, t) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")]

    def out_dtype(t: Any) -> Any:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    from common.weights.layout import ALIGN  # the same tensor alignment as the wire layout

    on_cuda = any(t.device.type == "cuda" for _, t in items)
    flat = None
    if staging is not None and rank0:
        offsets, total = [], 0
        for _, t in items:
            offsets.append(total)
            total += -(-t.numel() * out_dtype(t).itemsize // ALIGN) * ALIGN
        flat = staging.take(max(total, 1), pinned=on_cuda)
    state: dict[str, Any] = {}
    for i, (name, tensor) in enumerate(items):
        t = tensor.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()  # all-gather: every rank takes part, only rank 0 keeps it
        if not rank0:
            continue
        t = t.to(out_dtype(t))
        if flat is None:
            state[name] = t.to("cpu", copy=True)
            continue
        nbytes = t.numel() * t.element_size()
        dst = flat[offsets[i] : offsets[i] + nbytes].view(t.dtype).view(t.shape)
        dst.copy_(t, non_blocking=t.device.type == "cuda")
        state[name] = dst
    if flat is not None and on_cuda:
        torch.cuda.synchronize()  # the asynchronous copies into page-locked memory have landed
    return state
