"""AdamW, the LR schedule (warm-up then constant or cosine to a floor), gradient-norm clipping.

The schedule is a ``torch.optim.lr_scheduler.LambdaLR`` driven by ``WarmupDecaySchedule``, a plain
object whose attributes are JSON-able, so ``scheduler.state_dict()`` can be written as JSON by the
checkpoint code and restored exactly (the next LR after a resume equals the uninterrupted run's).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from common.config.learner import LearnerConfig
    from common.config.shared import RunConfig

DECAY_KINDS = ("constant", "cosine")


class WarmupDecaySchedule:
    """LR multiplier for the optimizer step with 0-based index ``step``.

    Warm-up: ``(step + 1) / warmup_steps`` for ``step < warmup_steps`` (the first step already
    has a non-zero LR; the multiplier reaches 1.0 at ``step = warmup_steps - 1``).
    Then ``constant`` stays at 1.0; ``cosine`` goes from 1.0 at ``step = warmup_steps`` down to
    ``min_lr_ratio`` at ``step = total_steps`` and stays there afterwards.
    """

    def __init__(
        self, *, warmup_steps: int, total_steps: int | None, decay: str, min_lr_ratio: float
    ) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.decay = decay
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        assert self.total_steps is not None
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (
            1.0 + math.cos(math.pi * progress)
        )


def build_schedule(
    *,
    warmup_steps: int | None = None,
    warmup_ratio: float | None = None,
    total_steps: int | None = None,
    decay: str = "constant",
    min_lr_ratio: float = 0.0,
) -> WarmupDecaySchedule:
    """Validate the schedule settings (``ValueError`` naming the setting) and build the multiplier.

    Give at most one of ``warmup_steps`` / ``warmup_ratio`` (a fraction of ``total_steps``).
    """
    if decay not in DECAY_KINDS:
        raise ValueError(f"lr decay {decay!r} is not one of {DECAY_KINDS}")
    if warmup_steps is not None and warmup_ratio is not None:
        raise ValueError("set either lr warmup_steps or warmup_ratio, not both")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if total_steps is not None and total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    needs_total = decay == "cosine" or warmup_ratio is not None
    if needs_total and total_steps is None:
        raise ValueError(
            "cosine decay and warmup_ratio need total_steps (the run's optimizer steps)"
        )
    if warmup_ratio is not None:
        if not 0.0 <= warmup_ratio <= 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1], got {warmup_ratio}")
        assert total_steps is not None
        warmup_steps = round(warmup_ratio * total_steps)
    warmup_steps = warmup_steps or 0
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    return WarmupDecaySchedule(
        warmup_steps=warmup_steps, total_steps=total_steps, decay=decay, min_lr_ratio=min_lr_ratio
    )


def build_optimizer(
    model: torch.nn.Module,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decay_1d_params: bool = False,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (FSDP2 DTensor shards work as plain tensors here).

    Biases and norm weights (1-D parameters) get no weight decay unless ``decay_1d_params``.
    The multi-tensor step when its temporary stays under ``FOREACH_MAX_TEMPORARY_BYTES``, else
    the step parameter by parameter.
    """
    import torch

    if lr <= 0:
        raise ValueError(f"learning rate must be > 0, got {lr}")
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 or decay_1d_params else no_decay).append(param)
    groups: list[dict[str, Any]] = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    foreach = foreach_temporary_bytes(decay + no_decay) <= FOREACH_MAX_TEMPORARY_BYTES
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=foreach)


# AdamW's multi-tensor ("foreach") step makes a temporary of every parameter's fp32 size at once
# (the square root of the second moments): 4P/R bytes, +15.3 GiB per rank at 32B on 8 ranks,
# which tips a model that fits into one that does not (bench/results/memory_scale.json). Above
# this, the step goes parameter by parameter (its temporary: one parameter's shard); the
# arithmetic is the same, and the few hundred extra kernel launches cost milliseconds.
FOREACH_MAX_TEMPORARY_BYTES = 1 << 30


def foreach_temporary_bytes(params: list[Any]) -> int:
    """The bytes of the foreach step's temporary: the fp32 size of this rank's shards."""
    total = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * 4
    return total


def build_scheduler(
    optimizer: torch.optim.Optimizer, schedule: WarmupDecaySchedule
) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` over every param group; step it once after each optimizer step."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=schedule)


def for_run(ln: LearnerConfig, run: RunConfig, model: Any) -> tuple[Any, Any]:
    """The run's (AdamW, LR scheduler) from ``[learner]``: the schedule spans every optimizer
    step of the run (``num_cycles × train_steps_per_cycle``); ``warmup_steps`` wins over
    ``warmup_ratio``."""
    schedule = build_schedule(
        warmup_steps=ln.warmup_steps or None,
        warmup_ratio=ln.warmup_ratio if not ln.warmup_steps and ln.warmup_ratio else None,
        total_steps=run.num_cycles * run.train_steps_per_cycle,
        decay=ln.lr_schedule,
        min_lr_ratio=ln.min_lr_ratio,
    )
    betas = (float(ln.adam_betas[0]), float(ln.adam_betas[1]))
    optimizer = build_optimizer(model, lr=ln.lr, betas=betas, weight_decay=ln.weight_decay)
    return optimizer, build_scheduler(optimizer, schedule)


def clip_grad_norm(parameters: Any, max_norm: float | None) -> float:
    """Total L2 norm of all gradients (before clipping); clips in place when ``max_norm``.

    Works with FSDP2: the norm of DTensor gradient shards is reduced across ranks (``full_tensor``)
    so every rank sees the same total norm and applies the same scale. Non-finite norms are
    returned as-is and the gradients are left unscaled (the caller decides to skip the step).
    """
    import torch
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    total_norm = float(total)
    if max_norm is not None and math.isfinite(total_norm):
        scale = max_norm / (total_norm + 1e-6)
        if scale < 1.0:
            torch._foreach_mul_(grads, scale)
    return total_norm
