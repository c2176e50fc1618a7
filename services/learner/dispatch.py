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
- With ``learner.dynamic_sampling`` (``sampling.py``) a cycle gets extra prompts and top-up
  rounds, so positions come from a cursor instead: each round takes the next ``count``
  positions. The cursor, the rounds of every untrained cycle and the filter rate are part of
  the checkpoint (``state`` / ``restore``), which keeps the order deterministic on resume.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from common.protocol import streams, wire
from common.protocol.staleness import min_policy_version, usable
from common.telemetry.metrics import metric
from services.learner import sampling

if TYPE_CHECKING:
    from common.bus.client import Bus
    from common.data.datasets import PromptSet
    from services.learner.settings import LearnerSettings

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(
        self, settings: LearnerSettings, bus: Bus, train: PromptSet, eval_set: PromptSet | None
    ) -> None:
        self.settings, self.bus, self.train, self.eval_set = settings, bus, train, eval_set
        self.dispatched_through = -1  # highest cycle dispatched by this process
        # ... or by the run's learner processes before it (``restore``): a restart dispatches
        # again from its checkpoint's cycle, below what the process before it may have reached
        self.dispatched_before = -1
        # the run ends before this cycle: run.num_cycles, or fewer once asked to end early
        self.end_cycle = settings.run.num_cycles
        self.dynamic = settings.learner.dynamic_sampling
        self.cursor = 0  # next sampler position (dynamic sampling)
        self.rounds: dict[int, list[tuple[int, int]]] = {}  # cycle -> [(first position, count)]
        self.filter_rate: float | None = None  # smoothed share of equal-reward groups
        self.redispatches: dict[int, int] = {}  # cycle -> times positions were dispatched again
        self.prompts_dispatched = metric(
            "Counter",
            "tether_learner_prompts_dispatched_total",
            "prompts handed to generators",
            ["split"],
            initial=("train", "eval"),
        )
        self.extra_prompts = metric(
            "Counter",
            "tether_learner_extra_prompts_total",
            "prompts dispatched beyond prompts_per_cycle by dynamic sampling",
        )

    def records_of(self, cycle: int) -> list[tuple[int, Any]]:
        p = self.settings.run.prompts_per_cycle
        return self.records_at(cycle * p, p)

    def records_at(self, start: int, count: int) -> list[tuple[int, Any]]:
        """(position, record) for sampler positions ``start … start + count − 1``."""
        n = len(self.train)
        out = []
        for g in range(start, start + count):
            epoch, offset = divmod(g, n)
            order = (
                self.train.order(self.settings.run.seed, epoch)
                if self.settings.shuffle
                else list(range(n))
            )
            out.append((g, self.train[order[offset]]))
        return out

    # ------------------------------------------------------------------ dynamic sampling
    def positions(self, cycle: int) -> set[int]:
        """Every sampler position dispatched for ``cycle`` (all rounds)."""
        return {
            g for start, count in self.rounds.get(cycle, []) for g in range(start, start + count)
        }

    def extra_used(self, cycle: int) -> int:
        return sum(c for _, c in self.rounds.get(cycle, [])) - self.settings.run.prompts_per_cycle

    def top_up(self, cycle: int, missing: int, *, filtered: int, examined: int) -> int:
        """Dispatch a top-up round for ``missing`` informative groups, sized by the filter rate
        including this cycle's groups so far (``filtered`` of ``examined``); returns its size
        (0 when the cycle's cap on extra prompts is spent)."""
        cap = self.settings.learner.max_extra_prompts_per_cycle or 0
        rate = sampling.next_filter_rate(self.filter_rate, filtered=filtered, examined=examined)
        count = sampling.top_up_size(missing, rate or 0.0, cap_left=cap - self.extra_used(cycle))
        if count:
            self._dispatch_round(cycle, count)
            log.info(
                "cycle %d: %d informative group(s) missing, %d more prompts", cycle, missing, count
            )
        return count

    def observe(self, *, filtered: int, examined: int) -> None:
        self.filter_rate = sampling.next_filter_rate(
            self.filter_rate, filtered=filtered, examined=examined
        )

    def forget(self, cycle: int) -> None:
        self.rounds.pop(cycle, None)

    def state(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "rounds": {str(c): [list(r) for r in rs] for c, rs in self.rounds.items()},
            "filter_rate": self.filter_rate,
        }

    def restore(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.cursor = int(state["cursor"])
        self.rounds = {
            int(c): [(int(a), int(b)) for a, b in rs] for c, rs in state["rounds"].items()
        }
        self.filter_rate = state["filter_rate"]

    def _min_version(self, cycle: int) -> int:
        """The oldest weights ``cycle``'s prompts may be generated with (the staleness rule)."""
        run = self.settings.run
        assert run.train_steps_per_cycle is not None and run.max_staleness is not None
        return min_policy_version(
            cycle, steps_per_cycle=run.train_steps_per_cycle, max_staleness=run.max_staleness
        )

    def _publish_train(self, cycle: int, records: list[tuple[int, Any]], *, suffix: str) -> None:
        """Publish ``records`` (position, record) as ``cycle``'s training prompts, with ids
        ``c<cycle>/<position>/<record id><suffix>``."""
        prompts = [(g, f"c{cycle}/{g}/{record.prompt_id}{suffix}", record) for g, record in records]
        self._publish("train", cycle, prompts, min_version=self._min_version(cycle))

    def _publish(
        self, split: str, cycle: int, prompts: list[tuple[int, str, Any]], *, min_version: int
    ) -> None:
        """Publish ``prompts`` (index, prompt id, record) of ``split`` and count them."""
        for index, prompt_id, record in prompts:
            msg = self._prompt(
                record,
                prompt_id=prompt_id,
                cycle=cycle,
                index=index,
                split=split,
                min_version=min_version,
            )
            self.bus.publish(streams.PROMPTS, msg)
        self.prompts_dispatched.labels(split).inc(len(prompts))

    def _dispatch_round(self, cycle: int, count: int) -> None:
        start = self.cursor if self.dynamic else cycle * self.settings.run.prompts_per_cycle
        self._publish_train(cycle, self.records_at(start, count), suffix="")
        if self.dynamic:
            self.cursor = start + count
            self.rounds.setdefault(cycle, []).append((start, count))
            after = self.extra_used(cycle)
            self.extra_prompts.inc(max(0, after) - max(0, after - count))

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
        run = self.settings.run
        done = []
        c = max(self.dispatched_through + 1, first_cycle)
        while c < self.end_cycle:
            need = self._min_version(c)
            if not usable(version, oldest=need):
                break
            p = run.prompts_per_cycle
            extra = 0
            if self.dynamic:
                cap = self.settings.learner.max_extra_prompts_per_cycle or 0
                extra = sampling.extra_prompts(p, self.filter_rate or 0.0, cap)
            self._dispatch_round(c, p + extra)
            self.dispatched_through = c
            if c > self.dispatched_before:
                self.bus.set(streams.DISPATCHED_THROUGH, c)
                self.dispatched_before = c
            done.append(c)
            log.info(
                "dispatched cycle %d (%d prompts + %d extra, needs weights >= v%d)",
                c,
                p,
                extra,
                need,
            )
            c += 1
        return done

    def redispatch(self, cycle: int, positions: set[int]) -> None:
        """Dispatch ``positions`` of ``cycle`` again: their prompts and groups vanished from
        Redis (``watchdog.py``). New prompt ids (``…/r<n>``), so that a generator whose dedupe
        set survived generates them; the learner keeps one group per position."""
        self.redispatches[cycle] = attempt = self.redispatches.get(cycle, 0) + 1
        records = [self.records_at(g, 1)[0] for g in sorted(positions)]
        self._publish_train(cycle, records, suffix=f"/r{attempt}")

    def dispatch_eval(self, round_id: int, version: int, *, tag: str) -> int:
        """Send the held-out set (greedy by default) for evaluation of weights >= ``version``;
        ``tag`` names the learner process that runs the round (``evaluation.py``)."""
        if self.eval_set is None:
            return 0
        prompts = [
            (i, f"eval{round_id}.{tag}/{i}/{record.prompt_id}", record)
            for i, record in enumerate(self.eval_set)
        ]
        self._publish("eval", round_id, prompts, min_version=version)
        return len(prompts)
