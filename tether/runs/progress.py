"""Live progress for `tether train`: one line every few seconds, from the services' heartbeats."""

from __future__ import annotations

import json
import logging
import time
from common.config.schema import TetherConfig
from common.protocol.run_dir import RunDir
from common.bus.client import Bus
from common.service.settings import bus_settings_for
from tether.runs.status import collect_status

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, cfg: TetherConfig, redis_url: str) -> None:
        self.cfg = cfg
        self.bus = Bus(bus_settings_for(cfg, redis_url=redis_url), service="launcher")
        self.started = time.monotonic()
        self.metrics_path = RunDir.of(cfg.run).metrics
        self._last_samples: tuple[float, int] | None = None

    def _last_eval(self) -> str:
        if not self.metrics_path.exists():
            return "-"
        acc = "-"
        for line in self.metrics_path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "eval":
                acc = f"{rec['accuracy']:.2f}@v{rec['eval_round']}"
        return acc

    def line(self) -> str:
        st = collect_status(self.bus)
        trained = st["accounting"]["trained_samples"]
        now = time.monotonic()
        rate = ""
        if self._last_samples is not None and now > self._last_samples[0]:
            rate = f"{(trained - self._last_samples[1]) / (now - self._last_samples[0]):.1f} traj/s"
        self._last_samples = (now, trained)
        ls = st.get("last_step") or {}
        q = st["streams"]
        b = st.get("bottleneck") or {}
        gens = ",".join(f"v{v}" for v in st["generator_versions"].values())
        return (
            f"[{now - self.started:5.0f}s] cycle {st['cycle']}/{self.cfg.run.num_cycles} learner v{st['learner_version']} gen {gens or '-'} | "
            f"reward {ls.get('reward_mean', float('nan')):.2f} | held-out {self._last_eval()} | {rate or '- traj/s'} | "
            f"staleness ≤{ls.get('staleness_max', '-')} | queues prompts {q['prompts']['lag']}+{q['prompts']['pending']} "
            f"groups {q['groups']['lag']}+{q['groups']['pending']} scored {q['scored']['lag']} | dead {st['dead_letters']} | "
            f"bottleneck {b.get('service', '-')} ({b.get('busy_fraction', 0):.0%} busy)"
        )

    def __call__(self) -> None:
        try:
            print(self.line(), flush=True)
        except Exception as exc:  # progress is best effort; services may still be starting
            log.debug("progress: %s", exc)

    def final(self) -> None:
        try:
            from tether.runs.status import collect_status, format_status

            print(format_status(collect_status(self.bus)), flush=True)
        except Exception as exc:
            log.debug("final status: %s", exc)
