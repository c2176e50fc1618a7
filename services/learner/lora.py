"""LoRA: the learner's policy as a frozen base model plus a peft LoRA adapter.

With ``learner.lora_rank > 0``, ``model.load_policy`` calls ``attach`` on the Hugging Face model
(on the meta device, under FSDP) before FSDP2 shards it. ``attach`` uses peft's ``inject_adapter_in_model``: the target linear
layers are wrapped in place and the model stays its own HF class, so sharding (one FSDP unit per
decoder layer), packing, gradient checkpointing and ``token_logprobs_and_entropy`` run unchanged.
Only the adapter's parameters require grad, so only they get gradients and AdamW state
(``optim.build_optimizer`` takes the trainable parameters).

- The KL reference is the same model with the adapter switched off (``adapter_disabled``): the
  base weights are the initial policy's, so no second copy of the model is loaded.
- Publishes, checkpoints and exports carry the adapter under PEFT's file names
  (``base_model.model.<module>.lora_A.weight``, ``adapter_config.json``): the names vLLM's LoRA
  loader and ``peft.PeftModel.from_pretrained`` read (``peft_name``).
- The adapter is initialised like peft's default (``lora_A`` Kaiming-uniform, ``lora_B`` zero,
  so the first policy is the base model), from a generator seeded with ``run.seed`` in module
  order: every rank draws the same whole adapter and keeps its shard of it.
- Under FSDP the adapter goes on the meta model (``attach`` with ``seed=None``), before the
  sharded start-up: no rank ever holds the whole base model (``model._load_sharded``).

peft is imported inside functions only (the ``lora`` extra): a full fine-tuning learner never
needs it.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.service.preflight import require_peft
from common.weights.adapter import adapter_update
from services.learner.dist import rank_world

if TYPE_CHECKING:
    import torch

    from common.config.learner import LearnerConfig

ADAPTER = "default"  # peft's adapter name inside the model; never on the wire or on disk
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before a module's name in its files
ALL_LINEAR = "all-linear"


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """The adapter's shape: ``[learner]`` ``lora_*`` settings."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)

    @classmethod
    def of(cls, ln: LearnerConfig) -> LoraSettings | None:
        """The settings of a LoRA run; None when ``learner.lora_rank`` is 0 (full fine-tuning)."""
        if ln.lora_rank == 0:
            return None
        return cls(
            rank=ln.lora_rank,
            alpha=ln.lora_alpha,
            dropout=ln.lora_dropout,
            target_modules=tuple(ln.lora_target_modules),
        )


def attach(model: Any, settings: LoraSettings, *, seed: int | None) -> Any:
    """Wrap ``model``'s target layers with a LoRA adapter in place (before FSDP2 shards it) and
    freeze everything else; returns the same model. ``ValueError`` when a target names no
    module of this model.

    ``seed``: initialise the adapter now (``init_adapter``, on whole tensors); ``None`` for a
    model on the meta device (the sharded start-up: the adapter's parameters have no values
    yet; ``init_adapter`` runs on the shards once they exist)."""
    require_peft()  # ConfigError naming the `lora` extra
    from peft import LoraConfig, inject_adapter_in_model

    targets: Any = list(settings.target_modules)
    if targets == [ALL_LINEAR]:
        targets = ALL_LINEAR
    # peft and vLLM type alpha as int and compute alpha / r either way; whole values stay ints
    alpha: Any = int(settings.alpha) if float(settings.alpha).is_integer() else settings.alpha
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        model = inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as exc:
        raise ValueError(
            f"learner.lora_target_modules = {list(settings.target_modules)} does not fit "
            f"{type(model).__name__}: {str(exc).splitlines()[0]}. Fix: name modules of this "
            'model (e.g. ["q_proj", "v_proj"]) or use ["all-linear"].'
        ) from None
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_param(name))
    if seed is not None:
        init_adapter(model, seed=seed)
    return model


def is_adapter_param(name: str) -> bool:
    """A parameter of the adapter (``…lora_A.default.weight``) rather than of the base model."""
    parts = name.split(".")
    return any(p.startswith("lora_") for p in parts) and ADAPTER in parts


def is_lora(model: Any) -> bool:
    """The model carries a Tether LoRA adapter (``attach`` ran on it)."""
    return ADAPTER in (getattr(model, "peft_config", None) or {})


def _lora_layers(model: Any) -> list[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    return sorted(
        ((n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)), key=lambda x: x[0]
    )


def initial_adapter(model: Any, *, seed: int) -> dict[str, Any]:
    """peft's default LoRA init, reproducible: ``lora_A`` Kaiming-uniform (a = √5, like an
    ``nn.Linear``), ``lora_B`` zero, drawn from one generator in module-name order; whole
    tensors (a DTensor's shape is the whole parameter's), by parameter name, fp32 on CPU."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for name, layer in _lora_layers(model):
        a = layer.lora_A[ADAPTER].weight
        fresh = torch.empty(tuple(a.shape), dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=gen)
        out[f"{name}.lora_A.{ADAPTER}.weight"] = fresh
        b = layer.lora_B[ADAPTER].weight
        out[f"{name}.lora_B.{ADAPTER}.weight"] = torch.zeros(tuple(b.shape))
    return out


def init_adapter(model: Any, *, seed: int) -> None:
    """Set the adapter to ``initial_adapter``: in place on whole tensors, or, on a sharded
    model (FSDP2 DTensors), each rank its shard of the same whole tensors (every rank draws
    them all: the adapter is small)."""
    import torch
    from torch.distributed.tensor import DTensor

    state = initial_adapter(model, seed=seed)
    params = dict(adapter_params(model))
    if any(isinstance(p, DTensor) for p in params.values()):
        _set_whole(model, state)
        return
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value.to(params[name].dtype))


@contextlib.contextmanager
def adapter_disabled(model: Any) -> Iterator[None]:
    """The base model: every LoRA layer computes its base layer alone inside the block (the KL
    reference; peft's ``disable_adapter``, on the layers of an injected model). Forward only:
    peft clears the adapter's ``requires_grad`` meanwhile and sets it again on exit."""
    layers = [layer for _, layer in _lora_layers(model)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def peft_name(fqn: str) -> str:
    """The file name of an adapter parameter: ``model.layers.0.mlp.up_proj.lora_A.default.weight``
    -> ``base_model.model.model.layers.0.mlp.up_proj.lora_A.weight`` (PEFT's
    ``adapter_model.safetensors``, which vLLM's LoRA loader reads too)."""
    parts = fqn.split(".")
    kept = [
        p
        for i, p in enumerate(parts)
        if not (p == ADAPTER and i and parts[i - 1].startswith("lora_"))
    ]
    return PEFT_PREFIX + ".".join(kept)


def adapter_params(model: Any) -> list[tuple[str, Any]]:
    """``(fully qualified name, parameter)`` of every adapter parameter, in name order."""
    return sorted(
        ((n, p) for n, p in model.named_parameters() if is_adapter_param(n)), key=lambda x: x[0]
    )


def adapter_state(model: Any, *, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The whole adapter on CPU under PEFT's file names, on rank 0 (``{}`` on the others).

    A collective under FSDP (each sharded parameter is all-gathered): every rank calls it.
    ``dtype``: cast floating tensors (a publish in the generators' dtype); default fp32."""
    from torch.distributed.tensor import DTensor

    rank0 = rank_world()[0] == 0
    state: dict[str, Any] = {}
    for fqn, param in adapter_params(model):
        t = param.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        if rank0:
            t = t.to(dtype) if dtype is not None and t.is_floating_point() else t
            state[peft_name(fqn)] = t.to("cpu", copy=True)
    return state


def load_adapter_state(model: Any, state: dict[str, Any]) -> None:
    """Put a saved adapter (PEFT names, whole tensors, on every rank) into the model's adapter
    parameters (each rank keeps its shard); ``ValueError`` when the names or shapes differ from
    this model's adapter (another rank, other target modules)."""
    params = dict(adapter_params(model))
    by_file = {peft_name(fqn): fqn for fqn in params}
    if set(by_file) != set(state):
        missing = sorted(set(by_file) - set(state))[:3]
        extra = sorted(set(state) - set(by_file))[:3]
        raise ValueError(
            f"the saved adapter does not fit this model's adapter (missing {missing}, "
            f"unexpected {extra}): resume with the run's learner.lora_rank and "
            "lora_target_modules"
        )
    for name, tensor in state.items():
        shape = tuple(params[by_file[name]].shape)
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"the saved adapter's {name} has shape {tuple(tensor.shape)}, this model's "
                f"{shape}: resume with the run's learner.lora_rank"
            )
    _set_whole(model, {by_file[name]: tensor for name, tensor in state.items()})


def _set_whole(model: Any, full: dict[str, Any]) -> None:
    """Whole adapter tensors (by parameter name, the same on every rank) into the adapter's
    parameters; under FSDP each rank keeps its shard. Not a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # a forward without backward leaves the root unsharded
        if isinstance(module, FSDPModule):
            module.reshard()
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))


def adapter_config(model: Any, *, base_model: str = "") -> dict[str, Any]:
    """The adapter's ``adapter_config.json`` (peft's own fields; ``target_modules`` as the
    module names peft resolved, e.g. ``q_proj``, not "all-linear"), JSON-ready."""
    config = model.peft_config[ADAPTER]
    doc = config.to_dict()
    resolved = sorted({n.rsplit(".", 1)[-1] for n, _ in _lora_layers(model)})
    doc["target_modules"] = resolved
    doc["base_model_name_or_path"] = base_model or doc.get("base_model_name_or_path") or ""
    doc["inference_mode"] = True
    return json.loads(json.dumps(doc, default=_jsonable))


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset | tuple):
        return sorted(value) if isinstance(value, set | frozenset) else list(value)
    if hasattr(value, "value"):  # enums (peft_type, task_type)
        return value.value
    return str(value)


def trainable_counts(model: Any) -> tuple[int, int]:
    """(adapter parameters, frozen base parameters), whole-model counts."""
    adapter = frozen = 0
    for name, param in model.named_parameters():
        n = _global_numel(param)
        if is_adapter_param(name):
            adapter += n
        else:
            frozen += n
    return adapter, frozen


def _global_numel(param: Any) -> int:
    shape: Sequence[int] = param.shape  # a DTensor's shape is the whole tensor's
    return math.prod(shape)


def publish_state(model: Any, *, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """What an adapter-only publish sends (``common.weights.adapter``): the adapter's tensors
    and its config, on rank 0 (``{}`` elsewhere). A collective under FSDP."""
    state = adapter_state(model, dtype=dtype)
    if not state:
        return {}
    return adapter_update(state, adapter_config(model, base_model=_source_dir(model)))


def _source_dir(model: Any) -> str:
    return str(getattr(model, "tether_source_dir", "") or "")
