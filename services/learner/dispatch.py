"""Prompt dispatch, owned by the learner (rank 0).

The learner knows the cycle and the policy version, so it decides what is generated and when:

- Cycle ``c`` draws prompts at sampler positions ``c·P … c·P + P − 1`` (P = prompts_per_cycle)
  of the deterministic order ``PromptSet.order(seed, epoch)``; position ``g`` is epoch
  ``g // N``, offset ``g % N``. The position is a pure function of the cycle, so resuming at
  cycle ``c`` resumes the data exactly, and prompt ids (``c<cycle>/<position>/<record id>``) are
  the same every time a cycle is dispatched — re-dispatch after a crash is de-duplicated by the
  generators.
- Staleness gate (the rule is ``common.protocol.staleness``): cycle ``c`` is trained by
  optimizer steps ``c·S … c·S + S − 1`` (S = train_steps_per_cycle); a trajectory of version
  ``v`` may be used by step ``t`` only while ``t − v ≤ max_staleness``. So cycle ``c`` needs
  weights ``≥ c·S + S − 1 − max_staleness`` (``min_policy_version``), which every prompt
  carries, and it is dispatched as soon as the learner's version reaches it: generation
  overlaps training by exactly what the bound allows and never produces data the learner would
  have to drop.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from common.protocol import streams, wire
from common.protocol.staleness import min_policy_version, usable
from common.telemetry.metrics import metric

if TYPE_CHECKING:
    from common.bus.client import Bus
    from common.config.schema import TetherConfig
    from common.data.datasets import PromptSet

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(
        self, cfg: TetherConfig, bus: Bus, train: PromptSet, eval_set: PromptSet | None
    ) -> None:
        self.cfg, self.bus, self.train, self.eval_set = cfg, bus, train, eval_set
        self.dispatched_through = -1  # highest cycle dispatched by this process
        self.prompts_dispatched = metric(
            "Counter",
            "tether_learner_prompts_dispatched_total",
            "prompts handed to generators",
            ["split"],
            initial=("train", "eval"),
        )

    def records_of(self, cycle: int) -> list[tuple[int, Any]]:
        p, n = self.cfg.run.prompts_per_cycle, len(self.train)
        out = []
        for k in range(p):
            g = cycle * p + k
            epoch, offset = divmod(g, n)
            order = (
                self.train.order(self.cfg.run.seed, epoch)
                if self.cfg.data.shuffle
                else list(range(n))
            )
            out.append((g, self.train[order[offset]]))
        return out

    def _prompt(
        self, record, *, prompt_id: str, cycle: int, index: int, split: str, min_version: int
    ) -> wire.PromptMsg:
        return wire.PromptMsg(
            prompt_id=prompt_id,
            cycle=cycle,
            index=index,
            split=split,
            text=record.text,
            messages=record.messages,
            ground_truth=record.ground_truth,
            metadata={
                k: v
                for k, v in record.metadata.items()
                if isinstance(v, (str, int, float, bool)) or v is None
            },
            min_policy_version=min_version,
            created_at=time.time(),
        )

    def dispatch_ready(self, version: int, *, first_cycle: int) -> list[int]:
        """Dispatch every not-yet-dispatched cycle whose weights exist; returns those cycles."""
        run = self.cfg.run
        assert run.train_steps_per_cycle is not None and run.max_staleness is not None
        done = []
        c = max(self.dispatched_through + 1, first_cycle)
        while c < run.num_cycles:
            need = min_policy_version(
                c, steps_per_cycle=run.train_steps_per_cycle, max_staleness=run.max_staleness
            )
            if not usable(version, oldest=need):
                break
            for g, record in self.records_of(c):
                msg = self._prompt(
                    record,
                    prompt_id=f"c{c}/{g}/{record.prompt_id}",
                    cycle=c,
                    index=g,
                    split="train",
                    min_version=need,
                )
                self.bus.publish(streams.PROMPTS, msg)
            self.prompts_dispatched.labels("train").inc(run.prompts_per_cycle)
            self.dispatched_through = c
            done.append(c)
            log.info(
                "dispatched cycle %d (%d prompts, needs weights >= v%d)",
                c,
                run.prompts_per_cycle,
                need,
            )
            c += 1
        return done

    def dispatch_eval(self, round_id: int, version: int) -> int:
        """Send the held-out set (greedy by default) for evaluation of weights >= ``version``."""
        if self.eval_set is None:
            return 0
        for i, record in enumerate(self.eval_set):
            msg = self._prompt(
                record,
                prompt_id=f"eval{round_id}/{i}/{record.prompt_id}",
                cycle=round_id,
                index=i,
                split="eval",
                min_version=version,
            )
            self.bus.publish(streams.PROMPTS, msg)
        self.prompts_dispatched.labels("eval").inc(len(self.eval_set))
        return len(self.eval_set)
