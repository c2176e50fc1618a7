"""The run directory, ``<run.run_dir>/<run.name>/``: who writes what, in one place.

``config.toml`` (the resolved config; the launcher), ``logs/`` (one file per service; the
launcher), ``redis/`` (the embedded server's data and ``server.conf``), ``metrics.jsonl``,
``tensorboard/``, ``wandb/`` and ``checkpoints/`` (the learner), ``tools/`` (a generator's tool
sandbox without namespaces), ``status.json`` (the last status
snapshot) and ``report.html`` (the launcher, at the end of a run), ``assets/`` and
``demo_result.json`` (``tether demo``).
The learner writes half of it and the launcher, ``tether status`` and ``tether report`` read it,
so the names live here, below both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunDir:
    root: Path

    @classmethod
    def of(cls, run: Any) -> RunDir:
        """The run directory a config's ``[run]`` section names (``run_dir`` / ``name``)."""
        return cls(Path(run.run_dir) / run.name)

    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def tool_scratch(self, generator_id: str) -> Path:
        """Scratch directories of a generator's tool sandbox when it runs without namespaces
        (with them, each worker's /work is a tmpfs of its own)."""
        return self.root / "tools" / generator_id

    @property
    def redis(self) -> Path:
        return self.root / "redis"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def wandb(self) -> Path:
        return self.root / "wandb"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def status_snapshot(self) -> Path:
        return self.root / "status.json"

    @property
    def report(self) -> Path:
        return self.root / "report.html"

    @property
    def assets(self) -> Path:
        return self.root / "assets"

    @property
    def demo_result(self) -> Path:
        return self.root / "demo_result.json"
