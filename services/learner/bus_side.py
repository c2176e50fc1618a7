"""The learner's side of the bus: prompts out (through the dispatcher, ``dispatch.py``), scored
groups in (collected per cycle, with dynamic sampling's top-ups, ``sampling.py``), held-out
rounds (``evaluation.py``), the positions lost to the dead-letter stream, the acknowledgement of
trained entries after each checkpoint, and the streams' housekeeping.

Rank 0 holds a ``BusSide``; every other rank holds a ``NoBusSide``, which does nothing, so the
loop calls both the same way. The weights go out through ``publishing.py`` and each step's
record through ``step_log.py``, split the same way."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.bus.client import Bus
from common.bus.consumer import Consumer
from common.bus.dead_letters import DeadLetters
from common.protocol import streams, wire
from common.protocol.run_dir import RunDir
from common.service import run_end
from common.service.preflight import check_server
from common.telemetry.metrics import PhaseTimer
from common.telemetry.trackers import Trackers
from services.learner import sampling
from services.learner.dispatch import Dispatcher
from services.learner.evaluation import HeldOut
from services.learner.metrics import LearnerMetrics
from services.learner.watchdog import Watchdog

if TYPE_CHECKING:
    from common.data.datasets import PromptSet
    from services.learner.settings import LearnerSettings

log = logging.getLogger(__name__)


class BusSide:
    """Rank 0's traffic with the bus. ``trackers``: the run's TensorBoard / W&B writers, shared
    with the step log (default: its own); ``close()`` closes them."""

    def __init__(
        self,
        settings: LearnerSettings,
        *,
        run_dir: Path,
        timer: PhaseTimer,
        datasets: tuple[PromptSet, PromptSet | None],
        trackers: Trackers | None = None,
    ) -> None:
        self.settings, self.run_dir, self.timer = settings, run_dir, timer
        run = settings.run
        self.metrics = LearnerMetrics()
        self.metrics.generators_configured.set(settings.generators)
        steps = run.train_steps_per_cycle
        assert steps is not None  # derived at load
        self.metrics.final_version.set(run.num_cycles * steps)
        train, eval_set = datasets
        self.bus = Bus(settings.bus, service="learner")
        # the learner holds scored entries pending until a checkpoint covers their training: it
        # neither claims (it would take its own entries back and ack them as duplicates) nor
        # counts strikes (its restarts must never dead-letter its own data; common.bus.strikes)
        self.consumer = Consumer(
            self.bus, streams.SCORED, streams.LEARNER, streams.LEARNER_CONSUMER,
            claims=False, track_strikes=False,
        )  # fmt: skip
        self.bus.ensure_group(streams.PROMPTS, streams.GENERATORS)
        self.bus.ensure_group(streams.GROUPS, streams.SCORERS)
        self.dispatcher = Dispatcher(settings, self.bus, train, eval_set)
        self.dead = DeadLetters(self.bus)  # positions whose prompt or group was dead-lettered
        self.buffer: dict[int, dict[str, Any]] = defaultdict(dict)  # cycle -> group id -> delivery
        self.trained_deliveries: list[Any] = []
        self.metrics_path = RunDir(run_dir).metrics
        self.trackers = trackers if trackers is not None else Trackers(settings.trackers, run_dir)
        self.held_out = HeldOut(
            self.dispatcher,
            self.dead,
            accuracy_gauge=self.metrics.eval_accuracy,
            metrics_path=self.metrics_path,
            trackers=self.trackers,
        )
        self._last_housekeeping = 0.0
        self.watchdog = Watchdog(
            self.bus, self.metrics, no_progress_s=settings.learner.no_progress_s
        )
        self.selection_counts: dict[str, int] = {}  # of the last collect (dynamic sampling)

    # ------------------------------------------------------------------ state
    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "dispatched_through": self.dispatcher.dispatched_through,
            "dispatch": self.dispatcher.state(),
            "eval_history": self.eval_history[-50:],
        }

    def restore(self, extra: dict[str, Any]) -> None:
        self.dispatcher.dispatched_through = int(extra.get("dispatched_through", -1))
        self.dispatcher.dispatched_before = max(  # also after this checkpoint was written
            self.dispatcher.dispatched_through, int(self.bus.get(streams.DISPATCHED_THROUGH) or -1)
        )
        self.dispatcher.restore(extra.get("dispatch"))
        self.held_out.history = list(extra.get("eval_history", []))

    def ack_trained(self, next_cycle: int) -> None:
        """Acknowledge the scored entries of every cycle below ``next_cycle``: the checkpoint
        just written holds their training. Entries of a cycle collected but not yet trained stay
        pending, so a crash before the checkpoint that holds them delivers them again."""
        done = [d for d in self.trained_deliveries if d.msg.group.cycle < next_cycle]
        self.trained_deliveries = [
            d for d in self.trained_deliveries if d.msg.group.cycle >= next_cycle
        ]
        self.consumer.ack(done)

    def housekeep(self, *, every_s: float = 30.0) -> None:
        """Bound Redis memory over a long run: trim each stream to the entries some consumer
        group still has to read or acknowledge, and forget dedupe ids older than the bus's
        retention. Runs at most every ``every_s`` seconds; a failure is logged, never fatal."""
        now = time.monotonic()
        if now - self._last_housekeeping < every_s:
            return
        self._last_housekeeping = now
        try:
            trimmed = {
                s: self.bus.trim_acked(s) for s in (streams.PROMPTS, streams.GROUPS, streams.SCORED)
            }
            keep = self.bus.done_retention_s()
            pruned = sum(
                self.bus.prune_done(g, keep) for g in (streams.GENERATORS, streams.SCORERS)
            )
        except Exception as exc:  # noqa: BLE001 - housekeeping must not stop training
            log.warning("bus housekeeping failed (will retry): %s", exc)
            return
        for stream, n in trimmed.items():
            self.metrics.trimmed.labels(stream).inc(n)
        if any(trimmed.values()) or pruned:
            log.debug("bus housekeeping: trimmed %s, forgot %d dedupe ids", trimmed, pruned)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, version: int, *, first_cycle: int) -> None:
        self.dispatcher.dispatch_ready(version, first_cycle=first_cycle)

    # ------------------------------------------------------------------ collecting
    def _take(self, d: Any, next_cycle: int) -> None:
        """Buffer a cycle's scored group (pending until a checkpoint holds its training); ack an
        evaluation group, and a duplicate: of a cycle trained already, or of a position here
        (a position dispatched again by the watchdog comes under a new group id)."""
        sg: wire.ScoredGroup = d.msg
        g = sg.group
        self.watchdog.progressed()
        if g.split == "eval":
            self.held_out.result(g.cycle, sg)
            self.consumer.ack([d])
        elif g.cycle < next_cycle or g.index in self._indices(g.cycle):
            self.metrics.duplicates.inc()
            self.consumer.ack([d])
        else:
            self.buffer[g.cycle][g.group_id] = d

    def _indices(self, cycle: int) -> set[int]:
        return {d.msg.group.index for d in self.buffer[cycle].values()}

    def collect(
        self, cycle: int, *, stop: Callable[[], bool], idle: Callable[[], None] = lambda: None
    ) -> list[wire.ScoredGroup] | None:
        """Block until the cycle's ``prompts_per_cycle`` groups are here (None when stopping);
        a position whose prompt or group was dead-lettered is not waited for (``_check_lost``).
        ``idle`` runs before every blocking read (the heartbeat and the other ranks' keepalive).
        With dynamic sampling: until every dispatched group is here and ``prompts_per_cycle``
        of them are informative, topping up as ``sampling.py`` says; ``selection_counts`` then
        holds the responses filtered and surplus among the groups not returned."""
        if self.dispatcher.dynamic:
            return self._collect_dynamic(cycle, stop=stop, idle=idle)
        need = self.settings.run.prompts_per_cycle
        positions = set(range(cycle * need, cycle * need + need))
        with self.watchdog.waiting(), self.timer.phase("waiting_input"):
            while awaited := self._awaited(cycle, positions):
                idle()
                if stop():
                    return None
                self._read(cycle)
                self._recover(cycle, awaited)
        self._check_lost(cycle, positions, len(self.buffer[cycle]))
        deliveries = list(self.buffer.pop(cycle).values())
        self.trained_deliveries += deliveries
        return [d.msg for d in deliveries]

    def _read(self, cycle: int) -> None:
        for d in self.consumer.read(64, self.settings.bus.block_ms):
            self._take(d, cycle)
        if self.dead.poll():
            self.watchdog.progressed()
            self.held_out.check_all()

    def _recover(self, cycle: int, awaited: set[int]) -> None:
        """Dispatch again the positions the watchdog found nowhere (``watchdog.py``)."""
        lost = self.watchdog.check(cycle=cycle, awaited=awaited - self._indices(cycle))
        if lost:
            self.dispatcher.redispatch(cycle, lost)
            self.metrics.redispatched.inc(len(lost))

    def _awaited(self, cycle: int, positions: set[int]) -> set[int]:
        """The positions of ``cycle`` still to come: neither here nor dead-lettered."""
        here = {d.msg.group.index for d in self.buffer[cycle].values()}
        return positions - here - set(self.dead.of("train", cycle))

    def _check_lost(self, cycle: int, positions: set[int], groups: int) -> None:
        """Say which of the cycle's positions never came (dead-lettered: their prompt could not
        be encoded, their group could not be scored, or an entry made its consumer fail
        ``bus.max_deliveries`` times); the cycle trains without them. A cycle left with fewer
        responses than optimizer steps cannot train: stop with the reasons."""
        here = {d.msg.group.index for d in self.buffer[cycle].values()}
        lost = {g: r for g, r in self.dead.of("train", cycle).items() if g in positions - here}
        self.dead.forget("train", cycle)
        if not lost:
            return
        self.metrics.lost.inc(len(lost))
        reasons = ", ".join(sorted({r for r in lost.values()}))
        log.warning(
            "cycle %d: %d group(s) at position(s) %s were dead-lettered (%s) and never came; "
            "the cycle trains without them (`tether bus inspect` shows the entries)",
            cycle,
            len(lost),
            sorted(lost)[:8],
            reasons,
        )
        steps = self.settings.run.train_steps_per_cycle
        if groups * self.settings.run.responses_per_prompt < steps:
            raise LostCycle(
                f"cycle {cycle}: {len(lost)} of its prompts or groups were dead-lettered "
                f"({reasons}), which leaves {groups} group(s), too few for its {steps} "
                "optimizer step(s). Look at the dead letters with `tether bus inspect`: "
                "unencodable_prompt means prompts longer than the generator's context "
                "(run.max_prompt_tokens / generator.max_model_len), unscorable means the "
                "scorer rejected the ground truth."
            )

    def _collect_dynamic(
        self, cycle: int, *, stop: Callable[[], bool], idle: Callable[[], None]
    ) -> list[wire.ScoredGroup] | None:
        need, n = self.settings.run.prompts_per_cycle, self.settings.run.responses_per_prompt
        with self.watchdog.waiting(), self.timer.phase("waiting_input"):
            while True:
                expected = self.dispatcher.positions(cycle)
                here = {d.msg.group.index: d.msg for d in self.buffer[cycle].values()}
                expected = {
                    g for g in expected if g in here or g not in self.dead.of("train", cycle)
                }
                if not expected <= set(here):
                    idle()
                    if stop():
                        return None
                    self._read(cycle)
                    self._recover(cycle, expected - set(here))
                    continue
                sel = sampling.select([here[g] for g in expected], need, fill=False)
                missing = need - len(sel.chosen)
                if missing == 0 or not self.dispatcher.top_up(
                    cycle, missing, filtered=len(sel.filtered), examined=len(expected)
                ):
                    break
        # groups at positions this replay did not dispatch (none unless the run diverged)
        # are examined too, so that every received group is accounted for
        sel = sampling.select([d.msg for d in self.buffer[cycle].values()], need, fill=True)
        self.dispatcher.observe(
            filtered=sum(1 for g in here.values() if not sampling.informative(g.rewards)),
            examined=len(here),
        )
        self.selection_counts = {
            "filtered_samples": len(sel.filtered) * n,
            "surplus_samples": len(sel.surplus) * n,
        }
        self.metrics.filtered.inc(len(sel.filtered) * n)
        self.metrics.filter_rate.set(self.dispatcher.filter_rate or 0.0)
        if sel.informative < need:
            log.warning(
                "cycle %d: only %d of %d groups carry signal after %d extra prompts (the cap, "
                "learner.max_extra_prompts_per_cycle); the rest train at weight 0",
                cycle,
                sel.informative,
                need,
                self.dispatcher.extra_used(cycle),
            )
        self._check_lost(cycle, self.dispatcher.positions(cycle), len(sel.chosen))
        self.dispatcher.forget(cycle)
        self.trained_deliveries += list(self.buffer.pop(cycle).values())
        return sel.chosen

    # ------------------------------------------------------------------ the run's start and end
    def begin(self, version: int, next_cycle: int) -> None:
        """Held-out accuracy before training (or at resume), then dispatch from
        ``next_cycle``. A run resumed below its end voids an earlier end (``num_cycles`` raised
        under the same run name), unless that end was an early one at ``next_cycle`` (`tether
        finish`): the run stays finished there."""
        early = (self._ended_before() or {}).get("ended_early_at_cycle")
        if isinstance(early, int) and next_cycle >= early:
            self.dispatcher.end_cycle = next_cycle
            return  # nothing to evaluate or dispatch: finish_run says so
        if next_cycle < self.settings.run.num_cycles:
            run_end.clear(self.bus)
        elif self._ended_before():
            return  # nothing to evaluate or dispatch: finish_run says so
        self.start_eval(version)
        self.dispatch(version, first_cycle=next_cycle)

    def finish_run(
        self, version: int, *, stop: Callable[[], bool], idle: Callable[[], None] = lambda: None
    ) -> None:
        """Every cycle is trained and checkpointed: the last held-out round, then the
        run-finished record, on which generators and scorers stop by themselves (exit 0).

        A learner restarted after an earlier process of it wrote the record (killed while it
        exited) finds the generators and scorers gone: it does not run the last round again
        (nobody would answer it; it waited ``finish_evals``' 300 s for nothing). The earlier
        process recorded that round in ``metrics.jsonl`` before it wrote the record."""
        ended = self._ended_before()
        if ended:
            log.info("the run was already finished by an earlier learner process (%s): the last "
                     "held-out round is in metrics.jsonl; not running it again", ended)  # fmt: skip
        else:
            self.start_eval(version)
            self.finish_evals(timeout_s=300.0, stop=stop, idle=idle)
        run_end.mark_finished(self.bus, num_cycles=self.settings.run.num_cycles, version=version,
                              ended_early_at_cycle=self.end_cycle if self.ended_early else None)  # fmt: skip

    # ------------------------------------------------------------------ ending early
    @property
    def end_cycle(self) -> int:
        """The run ends before this cycle: ``run.num_cycles``, or fewer once asked to end early."""
        return self.dispatcher.end_cycle

    @property
    def ended_early(self) -> bool:
        return self.dispatcher.end_cycle < self.settings.run.num_cycles

    def check_finish_request(self, next_cycle: int) -> None:
        """Once a cycle: an operator's `tether finish` (``run_end.request_finish``) ends the run
        after the cycles dispatched so far, so that every prompt sent out is trained, filtered
        or dropped as stale (the books stay whole). Redis trouble delays the check only."""
        if self.ended_early:
            return
        try:
            asked = run_end.finish_requested(self.bus)
        except Exception as exc:  # noqa: BLE001 - the loop's own reads meet it too
            log.warning("could not check for a request to end the run early: %s", exc)
            return
        if asked:
            d = self.dispatcher
            end = max(d.dispatched_through + 1, d.dispatched_before + 1, next_cycle)
            self.dispatcher.end_cycle = min(end, self.settings.run.num_cycles)
            log.info("asked to end the run early (tether finish): no new cycle is dispatched; "
                     "the run ends after cycle %d of %d, once the cycles dispatched are trained",
                     self.end_cycle, self.settings.run.num_cycles)  # fmt: skip

    def _ended_before(self) -> dict[str, Any] | None:
        return run_end.finished(self.bus, num_cycles=self.settings.run.num_cycles)

    # ------------------------------------------------------------------ evaluation
    @property
    def eval_history(self) -> list[dict[str, Any]]:
        return self.held_out.history

    def start_eval(self, version: int) -> None:
        self.held_out.start(version)

    def finish_evals(
        self, *, timeout_s: float, stop: Callable[[], bool] = lambda: False,
        idle: Callable[[], None] = lambda: None,
    ) -> None:  # fmt: skip
        """Wait for the outstanding evaluation rounds, at most ``timeout_s`` and not after
        ``stop()`` (SIGTERM: the final checkpoint is already written); ``idle()`` between reads
        (the loop's: heartbeats, keep-alive words, catch-up publishes to generators that join)."""
        deadline = time.monotonic() + timeout_s
        while self.held_out.outstanding() and time.monotonic() < deadline and not stop():
            idle()
            for d in self.consumer.read(64, 500):
                self._take(d, 1 << 30)
            if self.dead.poll():
                self.held_out.check_all()

    def check_server(self) -> None:
        """At start: refuse a Redis whose ``maxmemory-policy`` can evict Tether's keys (exit 2,
        ``common.service.preflight.check_server``)."""
        check_server(self.bus)

    @property
    def silent_s(self) -> float:
        """Seconds rank 0 has waited for a cycle's groups without progress (``watchdog.py``)."""
        return self.watchdog.silent_s

    def close(self) -> None:
        self.trackers.close()


class NoBusSide:
    """The bus side of a rank other than 0: the data reaches it by broadcast from rank 0
    (``cycle.broadcast_samples``), so it dispatches, collects and acknowledges nothing."""

    selection_counts: dict[str, int] = {}
    silent_s = 0.0
    end_cycle: int | None = None  # where the run ends is rank 0's to know (its heartbeat says)

    def check_server(self) -> None:
        pass

    def checkpoint_state(self) -> dict[str, Any]:
        return {}

    def restore(self, extra: dict[str, Any]) -> None:
        pass

    def ack_trained(self, next_cycle: int) -> None:
        pass

    def housekeep(self, *, every_s: float = 30.0) -> None:
        pass

    def check_finish_request(self, next_cycle: int) -> None:
        pass

    def dispatch(self, version: int, *, first_cycle: int) -> None:
        pass

    def begin(self, version: int, next_cycle: int) -> None:
        pass

    def finish_run(
        self, version: int, *, stop: Callable[[], bool], idle: Callable[[], None] = lambda: None
    ) -> None:
        pass

    def start_eval(self, version: int) -> None:
        pass

    def finish_evals(
        self, *, timeout_s: float, stop: Callable[[], bool] = lambda: False,
        idle: Callable[[], None] = lambda: None,
    ) -> None:  # fmt: skip
        pass

    def close(self) -> None:
        pass


class LostCycle(RuntimeError):
    """A cycle cannot train: too many of its prompts or groups were dead-lettered."""
