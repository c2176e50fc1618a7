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

import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.ports import free_port
from services.learner import lora as lora_mod
from services.learner import packing, shard_loading
from services.learner.dist import rank_world

if TYPE_CHECKING:
    import torch

    from services.learner.lora import LoraSettings

logger = logging.getLogger(__name__)


def process_group_backend(device_type: str, device_backend: str, *, offload: bool) -> str:
    """The default process group's backend string.

    NCCL (``device_backend`` on CUDA) refuses host tensors. With ``learner.cpu_offload`` (or
    ``reference_cpu_offload``) the parameter shards, their gradients and AdamW's state live in
    host memory, and collectives outside FSDP's own all-gather / reduce-scatter take tensors
    made from them (the gradient norm's all-reduce, a step's loss sum, a checkpoint's
    agreement): the group then gets a gloo backend for host tensors beside the device's
    (``cpu:gloo,cuda:nccl``, as torchtitan does), and each tensor goes to the backend of its
    device. Without offload, or with a CPU device (gloo carries both), the device's backend
    alone.
    """
    if device_type == "cpu" or device_backend == "gloo" or not offload:
        return device_backend
    return f"cpu:gloo,{device_type}:{device_backend}"


def setup_distributed(
    backend: str | None = None, *, timeout_s: float = 1800.0, offload: bool = False
) -> tuple[int, int, torch.device]:
    """Join (or create) the default process group; returns ``(rank, world_size, device)``.

    Under ``torchrun`` the ``RANK``/``WORLD_SIZE``/``MASTER_*`` variables are used. Without them a
    one-rank group on a free loopback port is created, so the same learner code runs as a plain
    ``python`` process. ``backend`` (the device's) defaults to ``nccl`` when CUDA is available,
    else ``gloo``; ``offload``: host tensors get a gloo backend of their own
    (``process_group_backend``). Calling it again returns the existing group's values.
    """
    import torch
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    backend = process_group_backend(
        device.type, backend or ("nccl" if use_cuda else "gloo"), offload=offload
    )
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


def _shard(
    model: torch.nn.Module,
    *,
    device: torch.device,
    param_dtype: Any,
    offload: bool = False,
    mesh: Any = None,
) -> None:
    """FSDP2: one unit per decoder layer, then the root (embeddings, final norm, tied lm_head).
    ``offload``: ``CPUOffloadPolicy`` (shards, gradients and optimizer state in host memory;
    each unit's parameters go to the device for its forward and backward only). ``mesh``: the
    device mesh (default: every rank of the default group; a fake-tensor run builds it before
    entering fake mode, ``bench/memory_scale.py``)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
    )

    mesh = mesh or init_device_mesh(device.type, (rank_world()[1],))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
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


def _attn(model_dir: Path, *, device: torch.device, pack_sequences: bool) -> dict[str, Any]:
    """Packing's varlen kernel when asked and installed; else what makes transformers compute
    what vLLM does (``attention_kwargs``)."""
    if pack_sequences and packing.varlen_attention_available(device):
        return {"attn_implementation": "flash_attention_2"}
    return attention_kwargs(model_dir)


def _checked_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise ValueError(
            f"model directory {path} has no config.json: point the learner's model path at a "
            "local Hugging Face model directory (e.g. one written by `tether export`)"
        )
    return path


def _load_whole(path: Path, *, device: torch.device, attn: dict[str, Any]) -> Any:
    """One process, no sharding (``fsdp=False``): ``from_pretrained``, fp32 master weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **attn)
    return model.to(device)


def _load_sharded(
    path: Path,
    *,
    device: torch.device,
    attn: dict[str, Any],
    param_dtype: Any,
    prepare: Callable[[Any], None],
    offload: bool = False,
    not_in_files: Callable[[str], bool] | None = None,
) -> Any:
    """Meta device -> ``prepare`` (on meta parameters) -> FSDP2 -> each rank reads its shards
    (``shard_loading``): no rank ever holds the whole model. With ``offload`` the shards stay
    in host memory (FSDP2's ``CPUOffloadPolicy``) and only the buffers go to ``device``.
    ``not_in_files``: parameters ``prepare`` added (a LoRA adapter's), left for the caller to
    set (``shard_loading.load_shards``)."""
    import torch

    model = shard_loading.build_on_meta(path, attn=attn)
    prepare(model)
    _shard(model, device=device, param_dtype=param_dtype, offload=offload)
    cpu = offload and device.type != "cpu"
    shard_loading.load_shards(
        model, path, device=torch.device("cpu") if cpu else device, not_in_files=not_in_files
    )
    if cpu:
        for module in model.modules():  # rotary frequencies etc. are used where compute runs
            for name, buf in list(module.named_buffers(recurse=False)):
                module.register_buffer(
                    name, buf.to(device), persistent=name not in module._non_persistent_buffers_set
                )
    return model


def _default_dtype(device: torch.device, param_dtype: Any) -> Any:
    import torch

    if param_dtype is not None:
        return param_dtype
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_policy(
    model_dir: str | Path,
    *,
    device: torch.device,
    param_dtype: torch.dtype | None = None,
    gradient_checkpointing: bool = False,
    fsdp: bool = True,
    pack_sequences: bool = False,
    offload: bool = False,
    lora: LoraSettings | None = None,
    seed: int = 0,
) -> Any:
    """Load the trainable policy from a local HF directory, in train mode.

    ``fsdp=True`` (needs ``setup_distributed``): sharded start-up (``_load_sharded``); every rank
    holds only its shards from the start. ``fsdp=False``: a plain module in one process.

    ``lora``: wrap the model with a LoRA adapter (``lora.attach``) before it is sharded (under
    FSDP on the meta model, then the sharded start-up: no rank holds the whole base model) and
    initialise it from ``seed``; only the adapter trains.

    ``pack_sequences``: the forward will run packed micro-batches (``packing.py``): on a CUDA
    device with flash-attn installed the model gets ``flash_attention_2`` (varlen), else
    transformers' default (``sdpa``); a probe then refuses a model that ignores the boundaries.

    ``param_dtype``: compute dtype; default bf16 on CUDA (fp32 master weights and fp32 gradient
    reduction via ``MixedPrecisionPolicy``), fp32 on CPU. ``offload``: FSDP2 CPU offload of the
    parameters, their gradients and so the optimizer state (``learner.cpu_offload``).
    """
    import torch

    param_dtype = _default_dtype(device, param_dtype)
    if param_dtype != torch.float32 and not fsdp:
        raise ValueError("a non-fp32 param_dtype needs fsdp=True (mixed precision is FSDP's)")
    if offload and not fsdp:
        raise ValueError("offload needs fsdp=True (CPU offload is FSDP2's)")
    path = _checked_dir(model_dir)
    attn = _attn(path, device=device, pack_sequences=pack_sequences)

    def prepare(model: Any) -> None:
        model.config.use_cache = False
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )

    if fsdp:

        def prepare_with_adapter(model: Any) -> None:
            prepare(model)
            if lora is not None:  # on the meta model: the adapter's values come after loading
                lora_mod.attach(model, lora, seed=None)

        model = _load_sharded(
            path, device=device, attn=attn, param_dtype=param_dtype,
            prepare=prepare_with_adapter, offload=offload,
            not_in_files=lora_mod.is_adapter_param if lora is not None else None,
        )  # fmt: skip
        if lora is not None:
            lora_mod.init_adapter(model, seed=seed)  # every rank the same, each keeps its shard
    else:
        model = _load_whole(path, device=device, attn=attn)
        prepare(model)
        if lora is not None:
            lora_mod.attach(model, lora, seed=seed)  # on whole tensors
    model.tether_source_dir = str(path.resolve())  # the tokenizer's home for `tether export`
    if pack_sequences:
        _probe_packing(model, device=device)
    model.train()
    return model


def _probe_packing(model: Any, *, device: torch.device) -> None:
    """``packing.check_packing`` (a no-grad forward; under FSDP a collective every rank runs).
    Then every FSDP unit is resharded: the root unit keeps its parameters gathered after a
    forward (for the backward it expects), and an optimizer built then would hold the gathered
    tensors instead of the shards. On CUDA under bf16 autocast (flash-attn has no fp32
    kernels)."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    cuda = device.type == "cuda"
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    with ctx:
        gap = packing.check_packing(
            model,
            device=device,
            vocab_size=int(model.config.vocab_size),
            tolerance=5e-2 if cuda else 1e-3,
        )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
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
    offload: bool = False,
) -> Any:
    """Load a frozen reference model (KL term): no gradients, eval mode.

    ``pack_sequences``: the attention implementation as ``load_policy`` picks it (the policy's
    probe covers the reference: the same architecture).

    It is sharded exactly like the policy (FSDP2 per layer + root, the same sharded start-up) so
    it costs 1/world_size of the memory per rank; its forward all-gathers one layer at a time.
    Call it under ``torch.no_grad()``.
    """
    path = _checked_dir(model_dir)
    attn = _attn(path, device=device, pack_sequences=pack_sequences)

    def prepare(model: Any) -> None:
        model.config.use_cache = False
        model.requires_grad_(False)

    if fsdp:
        model = _load_sharded(
            path, device=device, attn=attn, param_dtype=_default_dtype(device, param_dtype),
            prepare=prepare, offload=offload,
        )  # fmt: skip
        model.requires_grad_(False)  # the loaded shards are new Parameter objects
    else:
        model = _load_whole(path, device=device, attn=attn)
        prepare(model)
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
    routing: torch.Tensor | None = None,
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

    ``routing`` (``[B, T, layers, top_k]`` expert ids, -1 = not recorded): route every MoE layer
    by it (``router_replay``; the model must have it installed, ``model.router_replay``), or
    by the model's own routers when it is None or the model has no replay installed.

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
    replay = getattr(model, "router_replay", None)
    if routing is not None and replay is not None:
        from services.learner.router_replay import flat_routing  # noqa: PLC0415 - loads torch

        with replay.replaying(flat_routing(routing, attention_mask, packed)):
            return token_logprobs_and_entropy(
                model, input_ids, attention_mask, response_mask, position_ids=position_ids,
                with_entropy=with_entropy, temperature=temperature, packed=packed,
            )  # fmt: skip
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
