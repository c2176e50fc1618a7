"""What only rank 0 of the learner does: the bus (scored groups in, prompts out through the
dispatcher), the weight publisher, held-out evaluation (``evaluation.py``), per-step metrics
(Prometheus series in ``rank0_metrics.py``, ``metrics.jsonl``, TensorBoard, W&B), the positions
lost to the dead-letter stream, and the acknowledgement of trained entries after each
checkpoint, housekeeping of the streams included. Other ranks have none of it (``None``)."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.bus.dead_letters import DeadLetters
from common.bus.settings import bus_settings_for
from common.config.schema import TetherConfig
from common.ports import free_port
from common.protocol import streams, wire
from common.protocol.run_dir import RunDir
from common.telemetry.metrics import PhaseTimer
from common.telemetry.trackers import Trackers
from services.learner.evaluation import HeldOut, append_jsonl
from services.learner.rank0_metrics import Rank0Metrics

if TYPE_CHECKING:
    from common.data.datasets import PromptSet

log = logging.getLogger(__name__)


class Rank0:
    def __init__(
        self,
        cfg: TetherConfig,
        *,
        run_dir: Path,
        redis_url: str | None,
        timer: PhaseTimer,
        datasets: tuple[PromptSet, PromptSet | None] | None = None,
    ) -> None:
        from common.bus.client import Bus
        from services.learner.data import load_datasets
        from services.learner.dispatch import Dispatcher

        self.cfg, self.run_dir, self.timer = cfg, run_dir, timer
        self.metrics = Rank0Metrics()
        self.metrics.generators_configured.set(cfg.generator.replicas)
        train, eval_set = datasets if datasets is not None else load_datasets(cfg)
        self.bus = Bus(bus_settings_for(cfg, redis_url=redis_url), service="learner")
        self.consumer = self.bus.consumer(streams.SCORED, streams.LEARNER, streams.LEARNER_CONSUMER)
        self.bus.ensure_group(streams.PROMPTS, streams.GENERATORS)
        self.bus.ensure_group(streams.GROUPS, streams.SCORERS)
        self.dispatcher = Dispatcher(cfg, self.bus, train, eval_set)
        self.dead = DeadLetters(self.bus)  # positions whose prompt or group was dead-lettered
        self.buffer: dict[int, dict[str, Any]] = defaultdict(dict)  # cycle -> group id -> delivery
        self.trained_deliveries: list[Any] = []
        self.publisher = self._start_publisher()
        self.metrics_path = RunDir(run_dir).metrics
        self.trackers = Trackers(cfg, run_dir)
        self.held_out = HeldOut(
            self.dispatcher,
            self.dead,
            accuracy_gauge=self.metrics.eval_accuracy,
            metrics_path=self.metrics_path,
            trackers=self.trackers,
        )
        self._last_housekeeping = 0.0
        self.selection_counts: dict[str, int] = {}  # of the last collect (dynamic sampling)

    def _start_publisher(self):
        from common.weights.publisher import WeightPublisher

        w = self.cfg.weights
        # auto = gloo: host memory over TCP works for every placement (a generator on the
        # learner's own GPU too); nccl is opt-in (see WeightsConfig.backend)
        backend = w.backend if w.backend != "auto" else "gloo"
        pub = WeightPublisher(
            w.host,
            w.port or free_port(),
            backend=backend,
            timeout_s=w.timeout_s,
            bucket_bytes=int(w.bucket_mb * 2**20),
            fanout=w.fanout,
            chunk_bytes=int(w.chunk_mb * 2**20),
        )
        self.bus.set(streams.WEIGHTS_ADDR, f"{w.host}:{pub.port}")
        log.info("weight store on %s:%d", w.host, pub.port)
        return pub

    # ------------------------------------------------------------------ state
    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "dispatched_through": self.dispatcher.dispatched_through,
            "dispatch": self.dispatcher.state(),
            "eval_history": self.eval_history[-50:],
        }

    def restore(self, extra: dict[str, Any]) -> None:
        self.dispatcher.dispatched_through = int(extra.get("dispatched_through", -1))
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

    # ------------------------------------------------------------------ dispatch and weights
    def dispatch(self, version: int, *, first_cycle: int) -> None:
        self.dispatcher.dispatch_ready(version, first_cycle=first_cycle)

    def begin_publish(self, specs: list, version: int) -> Any:
        """Announce ``version`` and start its streamed publish (``common.weights.publisher``):
        every learner rank then gathers the units it asks for (``gather.stream_publish``)."""
        self.bus.set(streams.WEIGHTS_PUBLISHING, version)  # generators watch this key
        return self.publisher.begin(specs, version)

    def catch_up_due(self) -> bool:
        """A generator joined since the last publish and waits for the current weights."""
        return bool(self.publisher.behind())

    def begin_catch_up(self) -> Any:
        """The latest version again, to the generators that joined since (``None``: none)."""
        return self.publisher.begin_catch_up()

    def finish_publish(self, session: Any, version: int, *, catch_up: bool = False) -> None:
        report = session.close()
        if not catch_up:
            self.bus.set(streams.WEIGHTS_EPOCH, report.epoch)
            self.bus.set(streams.LEARNER_VERSION, version)
            self.metrics.version.set(version)
        bad = {k: v for k, v in report.per_member.items() if v != "ok"}
        log.info(
            "%s v%d (%.1f MB in %.2f s; %.1f MB out of this rank, chain epoch %d) "
            "to %d generator(s)%s",
            "caught up" if catch_up else "published",
            version,
            report.bytes / 1e6,
            report.seconds,
            report.root_bytes / 1e6,
            report.epoch,
            len(report.per_member),
            f"; failed: {bad}" if bad else "",
        )

    # ------------------------------------------------------------------ collecting
    def _take(self, d: Any, next_cycle: int) -> None:
        sg: wire.ScoredGroup = d.msg
        g = sg.group
        if g.split == "eval":
            self.held_out.result(g.cycle, sg)
            self.consumer.ack([d])
        elif g.cycle < next_cycle or g.group_id in self.buffer[g.cycle]:
            self.metrics.duplicates.inc()
            self.consumer.ack([d])
        else:
            self.buffer[g.cycle][g.group_id] = d

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
        need = self.cfg.run.prompts_per_cycle
        positions = set(range(cycle * need, cycle * need + need))
        with self.timer.phase("waiting_input"):
            while self._awaited(cycle, positions):
                idle()
                if stop():
                    return None
                self._read(cycle)
        self._check_lost(cycle, positions, len(self.buffer[cycle]))
        deliveries = list(self.buffer.pop(cycle).values())
        self.trained_deliveries += deliveries
        return [d.msg for d in deliveries]

    def _read(self, cycle: int) -> None:
        for d in self.consumer.read(64, self.cfg.bus.block_ms):
            self._take(d, cycle)
        if self.dead.poll():
            self.held_out.check_all()

    def _awaited(self, cycle: int, positions: set[int]) -> set[int]:
        """The positions of ``cycle`` still to come: neither here nor dead-lettered."""
        here = {d.msg.group.index for d in self.buffer[cycle].values()}
        return positions - here - set(self.dead.of("train", cycle))

    def _check_lost(self, cycle: int, positions: set[int], groups: int) -> None:
        """Say which of the cycle's positions never came (dead-lettered: their prompt could not
        be encoded, their group could not be scored, or an entry was delivered more than
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
        steps = self.cfg.run.train_steps_per_cycle or 1
        if groups * self.cfg.run.responses_per_prompt < steps:
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
        from services.learner import sampling

        need, n = self.cfg.run.prompts_per_cycle, self.cfg.run.responses_per_prompt
        with self.timer.phase("waiting_input"):
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

    # ------------------------------------------------------------------ evaluation
    @property
    def eval_history(self) -> list[dict[str, Any]]:
        return self.held_out.history

    def start_eval(self, version: int) -> None:
        self.held_out.start(version)

    def finish_evals(self, *, timeout_s: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Wait for the outstanding evaluation rounds, at most ``timeout_s`` and not after
        ``stop()`` (SIGTERM: the final checkpoint is already written)."""
        deadline = time.monotonic() + timeout_s
        while self.held_out.outstanding() and time.monotonic() < deadline and not stop():
            for d in self.consumer.read(64, 500):
                self._take(d, 1 << 30)
            if self.dead.poll():
                self.held_out.check_all()

    # ------------------------------------------------------------------ metrics
    def record_step(self, rec: dict[str, Any], st: Any) -> None:
        m = self.metrics
        m.steps.inc()
        m.version.set(rec["step"])
        m.tokens.inc(rec["response_tokens"])
        # responses that carried weight: not dropped for staleness, filtered or masked over-long
        m.trained.inc(rec["trained_samples"])
        m.dropped.inc(rec["dropped_stale"])
        m.step_seconds.labels("forward_backward").inc(st.forward_backward_seconds)
        m.step_seconds.labels("optimizer").inc(st.optimizer_seconds)
        m.last_step_time.set(time.time())
        scalars = {
            k: v
            for k, v in rec.items()
            if isinstance(v, (int, float)) and k not in ("step", "cycle")
        }
        for k, v in scalars.items():
            m.step.labels(k).set(v)
        self.trackers.log({f"train/{k}": v for k, v in scalars.items()}, rec["step"])
        append_jsonl(self.metrics_path, {"kind": "step", "time": time.time(), **rec})
        log.info(
            "step %d (cycle %d): loss %.4f reward %.3f grad %.3f lr %.2e staleness ≤ %d, %.1f s",
            rec["step"],
            rec["cycle"],
            rec["loss"],
            rec["reward_mean"],
            rec["grad_norm"],
            rec["lr"],
            rec["staleness_max"],
            rec["seconds"],
        )

    def count_masked(self, *, filtered: int, overlong: int) -> None:
        self.metrics.filtered.inc(filtered)
        self.metrics.overlong.inc(overlong)

    def close(self) -> None:
        self.publisher.close()
        self.trackers.close()


class LostCycle(RuntimeError):
    """A cycle cannot train: too many of its prompts or groups were dead-lettered."""
