"""What only rank 0 of the learner does: the bus (scored groups in, prompts out through the
dispatcher), the weight publisher, held-out evaluation, per-step metrics (Prometheus,
``metrics.jsonl``, TensorBoard, W&B) and the acknowledgement of trained entries after each
checkpoint, housekeeping of the streams included. Other ranks have none of it (``None``)."""

from __future__ import annotations

import json
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
from common.telemetry.metrics import PhaseTimer, metric
from common.telemetry.trackers import Trackers

if TYPE_CHECKING:
    from common.data.datasets import PromptSet

log = logging.getLogger(__name__)


class _Metrics:
    def __init__(self) -> None:
        self.version = metric(
            "Gauge", "tether_learner_policy_version", "policy version (optimizer steps done)"
        )
        self.steps = metric("Counter", "tether_learner_steps_total", "optimizer steps")
        self.generators_configured = metric(
            "Gauge",
            "tether_learner_generators_configured",
            "generator.replicas: the generators this run expects (the TetherGeneratorsMissing alert)",
        )
        self.step = metric(
            "Gauge", "tether_learner_step_value", "per-step training figures", ["name"]
        )
        self.trained = metric(
            "Counter", "tether_learner_trained_samples_total", "responses trained on"
        )
        self.dropped = metric(
            "Counter", "tether_learner_dropped_stale_total", "responses dropped for staleness"
        )
        self.lost = metric(
            "Counter",
            "tether_learner_lost_groups_total",
            "a cycle's groups that never came (their prompt or group was dead-lettered); the cycle "
            "trained without them",
        )
        self.duplicates = metric(
            "Counter",
            "tether_learner_duplicate_groups_total",
            "scored groups received again after training (acked, not trained)",
        )
        self.filtered = metric(
            "Counter",
            "tether_learner_filtered_samples_total",
            "responses of equal-reward groups left out of training (no signal)",
        )
        self.overlong = metric(
            "Counter",
            "tether_learner_overlong_masked_samples_total",
            "responses cut off at max_response_tokens and masked from the loss",
        )
        self.filter_rate = metric(
            "Gauge",
            "tether_learner_dynamic_sampling_filter_rate",
            "smoothed share of equal-reward groups that steers dynamic sampling's extra prompts",
        )
        self.staleness = metric(
            "Histogram",
            "tether_learner_staleness_steps",
            "optimizer steps between a trajectory's policy and the learner's",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32),
        )
        self.trimmed = metric(
            "Counter",
            "tether_learner_stream_trimmed_entries_total",
            "stream entries trimmed after every consumer group acknowledged them",
            ["stream"],
            initial=(streams.PROMPTS, streams.GROUPS, streams.SCORED),
        )
        self.eval_accuracy = metric(
            "Gauge",
            "tether_learner_eval_accuracy",
            "held-out accuracy of the last finished evaluation",
        )
        self.step_seconds = metric(
            "Counter",
            "tether_learner_step_seconds_total",
            "seconds per part of the optimizer step",
            ["part"],
            initial=("forward_backward", "optimizer"),
        )
        self.tokens = metric("Counter", "tether_learner_tokens_total", "response tokens trained on")
        self.last_step_time = metric(
            "Gauge",
            "tether_learner_last_step_timestamp_seconds",
            "unix time of the last optimizer step",
        )


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
        self.metrics = _Metrics()
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
        self.evals: dict[int, dict[str, Any]] = {}  # round -> {"expected", "results"}
        self.eval_history: list[dict[str, Any]] = []
        self.publisher = self._start_publisher()
        self.metrics_path = RunDir(run_dir).metrics
        self.trackers = Trackers(cfg, run_dir)
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
        self.eval_history = list(extra.get("eval_history", []))

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

    def publish_weights(self, state: dict[str, Any], version: int) -> None:
        self.bus.set(
            streams.WEIGHTS_PUBLISHING, version
        )  # generators watch this key, not the store
        report = self.publisher.publish(state.items(), version)
        self.bus.set(streams.WEIGHTS_EPOCH, report.epoch)
        self.bus.set(streams.LEARNER_VERSION, version)
        self.metrics.version.set(version)
        bad = {k: v for k, v in report.per_member.items() if v != "ok"}
        log.info(
            "published v%d (%.1f MB in %.2f s; %.1f MB out of this rank, chain epoch %d) "
            "to %d generator(s)%s",
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
            self._eval_result(g.cycle, sg)
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
        deliveries = list(self.buffer.pop(cycle).values())
        self._check_lost(cycle, positions, len(deliveries))
        self.trained_deliveries += deliveries
        return [d.msg for d in deliveries]

    def _read(self, cycle: int) -> None:
        for d in self.consumer.read(64, self.cfg.bus.block_ms):
            self._take(d, cycle)
        if self.dead.poll():
            for round_id in list(self.evals):
                self._maybe_finish_eval(round_id)

    def _awaited(self, cycle: int, positions: set[int]) -> set[int]:
        """The positions of ``cycle`` still to come: neither here nor dead-lettered."""
        here = {d.msg.group.index for d in self.buffer[cycle].values()}
        return positions - here - set(self.dead.of("train", cycle))

    def _check_lost(self, cycle: int, positions: set[int], groups: int) -> None:
        """Say which of the cycle's positions never came (dead-lettered: their prompt could not
        be encoded, their group could not be scored, or an entry was delivered more than
        ``bus.max_deliveries`` times); the cycle trains without them. A cycle left with fewer
        responses than optimizer steps cannot train: stop with the reasons."""
        here = {d.msg.group.index for d in self.buffer.get(cycle, {}).values()}
        lost = {g: r for g, r in self.dead.of("train", cycle).items() if g in positions}
        lost = {g: r for g, r in lost.items() if g not in here}
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
    def start_eval(self, version: int) -> None:
        if version in self.evals or self.dispatcher.eval_set is None:
            return
        n = self.dispatcher.dispatch_eval(version, version)
        self.evals[version] = {"expected": n, "results": [], "started": time.time()}

    def _eval_result(self, round_id: int, sg: wire.ScoredGroup) -> None:
        ev = self.evals.get(round_id)
        if ev is None:
            return  # from before a restart: its round is gone
        ev["results"].append(sg)
        self._maybe_finish_eval(round_id)

    def _maybe_finish_eval(self, round_id: int) -> None:
        """Record the round once every held-out prompt has come back or been dead-lettered
        (``lost``: the accuracy is over the ``n`` that came back)."""
        ev = self.evals.get(round_id)
        lost = len(self.dead.of("eval", round_id))
        if ev is None or ev.get("done") or len(ev["results"]) + lost < ev["expected"]:
            return
        ev["done"] = True
        self.dead.forget("eval", round_id)
        if not ev["results"]:
            log.warning("held-out round v%d: all %d prompts were dead-lettered", round_id, lost)
            return
        correct = [c.get("correct", 0.0) > 0 for r in ev["results"] for c in r.components]
        versions = sorted({t.policy_version for r in ev["results"] for t in r.group.samples})
        acc = sum(correct) / max(len(correct), 1)
        rec = {
            "eval_round": round_id,
            "accuracy": acc,
            "n": len(correct),
            "lost": lost,
            "policy_versions": versions,
            "seconds": time.time() - ev["started"],
            "time": time.time(),
        }
        self.eval_history.append(rec)
        self.metrics.eval_accuracy.set(acc)
        _append_jsonl(self.metrics_path, {"kind": "eval", **rec})
        self.trackers.log({"eval/accuracy": acc}, round_id)
        log.info(
            "held-out accuracy at v%d: %.3f (%d prompts%s)",
            round_id,
            acc,
            len(correct),
            f", {lost} dead-lettered" if lost else "",
        )

    def finish_evals(self, *, timeout_s: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Wait for the outstanding evaluation rounds, at most ``timeout_s`` and not after
        ``stop()`` (SIGTERM: the final checkpoint is already written)."""
        deadline = time.monotonic() + timeout_s
        while (
            any(not e.get("done") for e in self.evals.values())
            and time.monotonic() < deadline
            and not stop()
        ):
            for d in self.consumer.read(64, 500):
                self._take(d, 1 << 30)
            if self.dead.poll():
                for round_id in list(self.evals):
                    self._maybe_finish_eval(round_id)

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
        _append_jsonl(self.metrics_path, {"kind": "step", "time": time.time(), **rec})
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


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


class LostCycle(RuntimeError):
    """A cycle cannot train: too many of its prompts or groups were dead-lettered."""
