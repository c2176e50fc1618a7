"""One optimizer step: forward/backward over micro-batches, clip, AdamW step, LR step, zero grad.

The loss callback is the algorithm (``services.learner.losses``); this module only drives it.

Normalisation contract: ``loss_fn`` returns a loss that is ALREADY divided by the whole step's
denominator (all micro-batches on all ranks: tokens, sequences, ...). Micro-batch losses are
therefore summed — never divided by the number of micro-batches — and FSDP sums (not averages)
gradients over ranks (see ``model.load_policy``). The gradient then does not depend on how a batch
was split into micro-batches or ranks.

Under FSDP every rank must run the same number of micro-batches (each backward is a collective):
the caller pads a short rank with zero-weight micro-batches (real tokens, all-zero loss weights),
whose loss is an exact 0 that still runs forward and backward.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.learner.dist import global_sum
from services.learner.optim import clip_grad_norm

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# loss_fn(model, micro_batch) -> loss, or (loss, {metric name: float-able value}).
LossFn = Callable[[Any, Mapping[str, Any]], Any]


@dataclass
class StepStats:
    """What one optimizer step did. ``loss`` is the global loss (summed over ranks)."""

    loss: float
    grad_norm: float
    lr: float
    num_micro_batches: int
    forward_backward_seconds: float
    optimizer_seconds: float
    skipped: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


def _split_loss(result: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    if isinstance(result, tuple):
        loss, metrics = result
        return loss, dict(metrics)
    return result, {}


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    micro_batches: Sequence[Mapping[str, Any]],
    loss_fn: LossFn,
    *,
    grad_clip: float | None,
    skip_non_finite: bool = True,
) -> StepStats:
    """Run one optimizer step over ``micro_batches`` (this rank's share) and return its stats.

    ``grad_clip``: max total gradient L2 norm, or ``None`` for no clipping (the norm is still
    measured). With ``skip_non_finite`` a NaN/inf gradient norm skips the optimizer update (the
    scheduler still steps so the LR stays aligned with the step count) and sets ``skipped``.
    """
    import torch

    if not micro_batches:
        raise ValueError(
            "train_step got no micro-batches; pad this rank with a zero-weight micro-batch so "
            "every rank runs the same number of forward/backward passes"
        )
    model.train()
    lr = float(optimizer.param_groups[0]["lr"])
    loss_sum = 0.0
    metrics: dict[str, float] = {}
    t0 = time.perf_counter()
    for micro_batch in micro_batches:
        loss, mb_metrics = _split_loss(loss_fn(model, micro_batch))
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            raise ValueError(
                "loss_fn must return a scalar tensor computed from the model's forward pass "
                "(multiply by zero weights for padding micro-batches; do not return a constant)"
            )
        loss.backward()
        loss_sum += float(loss.detach())
        for key, value in mb_metrics.items():
            metrics[key] = metrics.get(key, 0.0) + float(value)
    t1 = time.perf_counter()
    grad_norm = clip_grad_norm(model.parameters(), grad_clip)
    skipped = skip_non_finite and not torch.isfinite(torch.tensor(grad_norm))
    if skipped:
        logger.warning("non-finite gradient norm %s: skipping this optimizer update", grad_norm)
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    t2 = time.perf_counter()
    return StepStats(
        loss=global_sum(loss_sum, next(model.parameters()).device),
        grad_norm=grad_norm,
        lr=lr,
        num_micro_batches=len(micro_batches),
        forward_backward_seconds=t1 - t0,
        optimizer_seconds=t2 - t1,
        skipped=bool(skipped),
        metrics=metrics,
    )
