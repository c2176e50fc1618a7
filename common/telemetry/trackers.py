"""Experiment trackers the learner writes per-step metrics to: TensorBoard event files in the run
directory and Weights & Biases when configured (``learner.trackers``).

Both are imported only when configured. A tracker the user asked for but that is not installed
is a config error named at start-up (exit 2, before Redis or any model starts), not a silent
no-op: ``common.service.settings.require_trackers`` is one of the preflight checks
(``common.service.preflight``) of `tether train` and `tether learner`. W&B honours its own
environment (``WANDB_API_KEY``, ``WANDB_MODE``, ``WANDB_DIR``); ``learner.wandb_mode =
"offline"`` writes the run under ``<run dir>/wandb/`` for a later ``wandb sync``, with no network.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

INSTALL_HINTS = {  # how to install each tracker's package
    "tensorboard": "pip install tensorboard",
    "wandb": "pip install wandb   (or: pip install 'tether-rl[tracking]')",
}


@dataclass(frozen=True)
class TrackerSettings:
    """Which trackers to write to, and the W&B run's names (``common.service.settings``)."""

    names: tuple[str, ...] = ()  # "tensorboard", "wandb"
    run_name: str = "tether"
    wandb_project: str = "tether"
    wandb_entity: str | None = None
    wandb_mode: Literal["online", "offline"] = "online"
    config: dict[str, Any] = field(default_factory=dict)  # the run's config, shown in W&B


class Trackers:
    """Fan-out of ``log(metrics, step)`` to every configured tracker."""

    def __init__(self, settings: TrackerSettings, run_dir: Path) -> None:
        self._tb: Any = None
        self._wandb: Any = None
        names = set(settings.names)
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if "wandb" in names:
            import wandb

            (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(
                project=settings.wandb_project,
                entity=settings.wandb_entity,
                name=settings.run_name,
                mode=settings.wandb_mode,
                dir=str(run_dir),
                config=settings.config,
                resume="allow",
                id=_wandb_run_id(run_dir),
            )
            # Evaluations finish after later training steps: plot everything against the policy
            # version instead of W&B's own (strictly increasing) step counter.
            self._wandb.define_metric("policy_version")
            self._wandb.define_metric("*", step_metric="policy_version")
            log.info("W&B run %s (%s mode)", self._wandb.id, settings.wandb_mode)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({**metrics, "policy_version": step})

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _wandb_run_id(run_dir: Path) -> str:
    """One W&B run per Tether run directory, so ``tether train --resume`` continues it."""
    path = run_dir / "wandb" / "tether_run_id"
    if path.exists():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:12]
    path.write_text(run_id)
    return run_id
