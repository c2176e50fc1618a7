"""The learner service loop: every rank runs it. What only rank 0 does is held in three objects
by concern, which do nothing on the other ranks: ``bus_side`` (prompts out, scored groups in,
held-out rounds, acks, ``bus_side.py``), ``publishing`` (weights to the generators,
``publishing.py``) and ``step_log`` (each step's record, ``step_log.py``).

Consumes  ``<run>:scored`` through the consumer group ``learner`` (rank 0, consumer
          ``learner-0``): whole scored groups, buffered per cycle.
Produces  prompts on ``<run>:prompts`` (rank 0 owns dispatch, see ``dispatch.py``), policy
          weights to every generator (versioned broadcast with a deadline, ``common.weights``),
          checkpoints under ``<run dir>/checkpoints``, per-step metrics in ``metrics.jsonl``,
          and at the end of the run (final checkpoint and held-out round done) the run-finished
          record ``<run>:run:finished`` that stops generators and scorers (``Rank0.finish_run``).
Waits for the ``prompts_per_cycle`` scored groups of the cycle it trains next (its idle time,
          ``waiting_input``; with dynamic sampling, for every group dispatched for that cycle
          and for top-up rounds until ``prompts_per_cycle`` informative groups are in, see
          ``sampling.py``); every rank waits for rank 0's broadcast of that cycle. A position
          whose prompt or group was dead-lettered (``<run>:dead`` names it) is not waited for:
          the cycle trains without it (dynamic sampling tops up instead), in the same
          ``train_steps_per_cycle`` steps; a cycle left with fewer responses than steps stops
          the run with the reasons (``LostCycle``, exit 2).
Unblocked by scorers publishing. Its own weight publishes unblock the generators' staleness gate.

Stopping and idling across ranks (``dist.control``): at the top of each cycle rank 0 says GO
(it has the cycle's groups) or STOP, and while it waits for input it says WAITING every
``learner.keepalive_s`` (CATCH_UP at once when a generator joined since the last publish: every
rank then takes part in sending it the current weights, since a streamed publish gathers from
every rank and rank 0 keeps no copy of them); the other ranks listen in a loop. So an idle wait of any length never
runs into ``learner.collective_timeout_s``, and a SIGTERM to any rank stops every rank at the same
point (then the final checkpoint, a collective). Each exchange, training step and checkpoint is a
heartbeat (``live``): ``/healthz`` of rank 0 and of each node's first rank answers 503 when the
loop has been silent for ``learner.liveness_s``.

Versions count optimizer steps. A trajectory of version ``v`` is used in the step that turns
``t`` into ``t + 1`` only if ``t − v ≤ max_staleness`` (``common.protocol.staleness``);
otherwise it gets zero weight and is counted as dropped (the dispatcher's gate makes that rare
by construction).

Exactly once: scored entries are acknowledged only after a checkpoint that contains their
training, so a SIGKILLed learner restarts from its last checkpoint, drains its own pending
entries first and sees the same groups again; groups of cycles it has already trained are acked
as duplicates without training.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.protocol.books import LearnerBooks
from common.protocol.staleness import oldest_usable, usable
from common.telemetry.health import Liveness
from common.telemetry.metrics import PhaseTimer
from common.weights.layout import build_layout
from services.learner import gather, logprobs, lora, objective, optim
from services.learner import model as model_mod
from services.learner.bus_side import BusSide, LostCycle, NoBusSide
from services.learner.cadence import CheckpointCadence
from services.learner.checkpoint import load_checkpoint, start_checkpoint
from services.learner.cycle import (
    Sample,
    assign_advantages,
    broadcast_samples,
    extra_segments,
    mask_failed,
    mask_overlong,
    mask_refused,
    samples_from_groups,
    steps_of_cycle,
)
from services.learner.dist import CATCH_UP, FINISH, GO, STOP, WAITING, control, set_cpu_threads
from services.learner.lora import LoraSettings, adapter_disabled
from services.learner.lora import publish_state as lora_publish_state
from services.learner.publishing import NoPublishing, WeightPublishing
from services.learner.step_log import NoStepLog, StepLog, step_record
from services.learner.train_step import train_step

if TYPE_CHECKING:
    from common.data.datasets import PromptSet
    from services.learner.settings import LearnerSettings

log = logging.getLogger(__name__)

# Tests only: seconds to sleep after every optimizer step, to stand for a real model's slow
# steps: a restarted learner on the test model otherwise retrains a whole run in a second,
# before a test that kills it once per life sees it mid-run (tests/e2e/test_e2e_resources.py).
TEST_ONLY_STEP_DELAY_ENV = "TETHER_TEST_ONLY_STEP_DELAY_S"


def _test_only_step_delay() -> None:
    delay_s = float(os.environ.get(TEST_ONLY_STEP_DELAY_ENV) or 0)
    if delay_s > 0:
        time.sleep(delay_s)


class LearnerService:
    def __init__(
        self,
        settings: LearnerSettings,
        *,
        run_dir: Path,
        datasets: tuple[PromptSet, PromptSet | None] | None,
    ) -> None:
        """``datasets``: the (train, eval) prompt sets, loaded and checked before (the preflight of
        `tether learner`); rank 0 dispatches them, the other ranks may pass ``None``."""
        self.settings, self.run_dir = settings, run_dir
        self.datasets = datasets
        self.timer = PhaseTimer("learner")
        self.version = 0
        self.next_cycle = 0
        self.books = LearnerBooks()  # what became of the responses received (rank 0's count)
        self.ready = False
        self.live = Liveness(settings.learner.liveness_s)
        self._stop = False
        self.ended_early = False  # every rank: the run was asked to end early (`tether finish`)
        self.fatal: Exception | None = None  # rank 0: why the run cannot go on (LostCycle)
        self._last_word = 0.0  # time.monotonic() of rank 0's last control word
        self.cadence = CheckpointCadence(settings.learner)
        self.last_step: dict[str, Any] = {}
        self.lora = LoraSettings.of(settings.learner)  # None: full fine-tuning
        self._pending: Any = None  # a checkpoint being written (learner.async_checkpoint)
        self._pending_cycle, self._pending_acked = 0, True
        # rank 0's duties; setup_io_first gives rank 0 the real ones
        self.bus_side: BusSide | NoBusSide = NoBusSide()
        self.publishing: WeightPublishing | NoPublishing = NoPublishing()
        self.step_log: StepLog | NoStepLog = NoStepLog()

    # ------------------------------------------------------------------ set-up
    def setup_io_first(self) -> None:
        """Process group, then (rank 0) datasets, Redis and the weight store: the cheap parts
        that can fail on bad input, before the model is loaded."""
        ln = self.settings.learner
        self.rank, self.world, self.device = model_mod.setup_distributed(
            timeout_s=ln.collective_timeout_s, offload=ln.cpu_offload or ln.reference_cpu_offload
        )
        set_cpu_threads(self.device, ln.cpu_threads)
        if self.rank == 0:
            if self.datasets is None:
                raise ValueError("the learner's rank 0 dispatches the prompts: pass its datasets")
            self.bus_side = BusSide(
                self.settings, run_dir=self.run_dir, timer=self.timer, datasets=self.datasets
            )
            self.publishing = WeightPublishing(self.settings.weights, bus=self.bus_side.bus)
            self.step_log = StepLog(self.run_dir, trackers=self.bus_side.trackers)

    def setup(self) -> None:
        import torch

        if not hasattr(self, "rank"):
            self.setup_io_first()
        model_dir, tok_dir = self.settings.model_dir, self.settings.tokenizer_dir
        ln = self.settings.learner
        dtype = None if ln.dtype == "auto" else getattr(torch, ln.dtype)
        compute = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        wd = self.settings.weights.dtype
        # generators run in the compute dtype: fp32 masters would double the bytes of a publish
        self.publish_dtype = compute if wd == "auto" else getattr(torch, wd)
        if logprobs.proximal_is_current(self.settings.training):
            log.info(
                "%s: proximal log-probs come from each step's own forward pass (one optimizer "
                "step per cycle, one pass): no recompute pass",
                ln.off_policy,
            )
        self.model = model_mod.load_policy(
            model_dir,
            device=self.device,
            param_dtype=dtype,
            gradient_checkpointing=ln.gradient_checkpointing,
            pack_sequences=ln.pack_sequences,
            offload=ln.cpu_offload,
            lora=self.lora,
            seed=self.settings.run.seed,
        )
        self.ref_model = None
        if ln.kl_coef > 0 and self.lora is not None:
            self.ref_model = self.model  # the reference is the base: the adapter switched off
        elif ln.kl_coef > 0:
            self.ref_model = model_mod.load_reference(
                model_dir, device=self.device, param_dtype=dtype, pack_sequences=ln.pack_sequences,
                offload=ln.reference_cpu_offload,
            )  # fmt: skip
        if ln.router_replay != "off":
            from services.learner.router_replay import RouterReplay  # noqa: PLC0415 - loads torch

            for m in {id(x): x for x in (self.model, self.ref_model) if x is not None}.values():
                m.router_replay = RouterReplay(m)
            r = self.model.router_replay
            log.info("routing replay (%s): %d MoE layers, top-%d of %d experts", ln.router_replay,
                     r.layers, r.top_k, r.num_experts)  # fmt: skip
        if self.lora is not None:
            self._log_lora(self.lora)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.optimizer, self.scheduler = optim.for_run(
            self.settings.learner, self.settings.run, self.model
        )

    def _log_lora(self, settings: LoraSettings) -> None:
        adapter, frozen = lora.trainable_counts(self.model)
        log.info(
            "LoRA rank %d (alpha %g): %d adapter parameters train (%.3f%% of %d)%s",
            settings.rank,
            settings.alpha,
            adapter,
            100.0 * adapter / max(1, adapter + frozen),
            adapter + frozen,
            "; the KL reference is the base with the adapter off: no second copy of "
            f"{frozen * 4 / self.world / 2**20:.1f} MiB (fp32) per rank"
            if self.ref_model is not None
            else "",
        )

    def resume(self) -> None:
        extra = load_checkpoint(
            self.run_dir, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler
        )
        if extra is None:
            return
        self.version = int(extra["version"])
        self.next_cycle = int(extra["next_cycle"])
        self.books = _resumed_books(extra)
        self.bus_side.restore(extra)
        log.info("resumed at policy version %d, next cycle %d", self.version, self.next_cycle)

    # ------------------------------------------------------------------ weights, checkpoints
    def publish(self, *, catch_up: bool = False) -> None:
        """Every rank: send the current weights to the generators, streamed (rank 0 holds at
        most a window of ``weights.bucket_mb`` units, never the model: ``gather``).
        ``catch_up``: the same version again, to the generators that joined since."""
        with self.timer.phase("syncing_weights"):
            if self.lora is not None:  # adapter only (megabytes): gathered whole, sent from memory
                if not catch_up:  # (kept by the publisher: it serves late joiners itself)
                    state = lora_publish_state(self.model, dtype=self.publish_dtype)
                    self.publishing.publish_whole(state, self.version)
                return
            items = gather.publish_items(self.model)
            specs = gather.publish_specs(items, self.publish_dtype)
            session = self.publishing.begin(specs, self.version, catch_up=catch_up)
            bucket = int(self.settings.weights.bucket_mb * 2**20)
            layout = session.layout if session else build_layout(specs, self.version, bucket)
            gather.stream_publish(
                items, layout=layout, dtype=self.publish_dtype, session=session,
                device=self.device,
            )  # fmt: skip
            self.publishing.finish(session, self.version, catch_up=catch_up)

    def checkpoint(self, *, wait: bool = True) -> None:
        """Save a checkpoint (every rank). ``wait=False`` with ``learner.async_checkpoint``:
        return once the shards are copied; ``poll_checkpoint`` (between cycles) and the next
        save finish it. The trained entries are acknowledged when it is published."""
        self.finish_checkpoint()  # one save at a time (a collective: every rank is here)
        self.live.beat()
        with self.timer.phase("checkpointing"):
            extra = {
                "version": self.version,
                "next_cycle": self.next_cycle,
                "books": self.books.to_dict(),
                **self.bus_side.checkpoint_state(),
            }
            self._pending = start_checkpoint(
                self.run_dir,
                self.version,
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                extra_state=extra,
                keep_last=self.settings.learner.keep_checkpoints,
                async_save=self.settings.learner.async_checkpoint,
            )
            self._pending_cycle, self._pending_acked = self.next_cycle, False
            if wait or not self.settings.learner.async_checkpoint:
                self.finish_checkpoint()
        self.cadence.saved()
        self.live.beat()

    def finish_checkpoint(self) -> None:
        """Every rank: wait for the save in progress, if any, to be on disk and published."""
        if self._pending is None:
            return
        self._pending.wait()
        self._pending = None
        self._ack_checkpointed()

    def poll_checkpoint(self) -> None:
        """Between cycles: rank 0 publishes an asynchronous save whose files are all written
        and acknowledges what it holds, without waiting (the other ranks' part ends in the
        next ``finish_checkpoint``)."""
        if self._pending is not None and self._pending.poll() is not None:
            self._ack_checkpointed()

    def _ack_checkpointed(self) -> None:
        if not self._pending_acked:
            self.bus_side.ack_trained(self._pending_cycle)
        self._pending_acked = True

    # ------------------------------------------------------------------ training
    def _prepare(self, samples: list[Sample]) -> None:
        """The cycle's reference and proximal log-probs, then its advantages (a KL reward needs
        the reference log-probs)."""
        ln = self.settings.learner
        if ln.off_policy != "none" and not logprobs.proximal_is_current(self.settings.training):
            for s, lp in zip(
                samples,
                logprobs.recompute_logprobs(
                    self.model,
                    self.settings.training,
                    samples,
                    pad_id=self.pad_id,
                    device=self.device,
                ),
                strict=True,
            ):
                s.old_logp = lp
        if self.ref_model is not None:
            with self._reference_mode():
                ref_logp = logprobs.recompute_logprobs(
                    self.ref_model,
                    self.settings.training,
                    samples,
                    pad_id=self.pad_id,
                    device=self.device,
                )
            for s, lp in zip(samples, ref_logp, strict=True):
                s.ref_logp = lp
        filtered = assign_advantages(samples, self.settings.learner)
        failed, segments = mask_failed(samples), extra_segments(samples)
        overlong = mask_overlong(samples, self.settings.learner)
        refused = mask_refused(samples)
        self.books.add(
            agent_failed_samples=failed,
            segment_samples=segments,
            filtered_samples=filtered,
            overlong_masked_samples=overlong,
            refused_template_samples=refused,
            # every tool call of every episode counted here once (rank 0 holds the records)
            episode_tool_calls=sum(int(s.episode.get("tool_calls", 0)) for s in samples),
        )
        self.step_log.count_masked(filtered=filtered, overlong=overlong)

    def _reference_mode(self) -> AbstractContextManager[None]:
        """LoRA: the reference is the policy with its adapter off; else a model of its own."""
        return adapter_disabled(self.model) if self.lora is not None else nullcontext()

    def _apply_staleness(self, samples: list[Sample], idx: list[int]) -> int:
        oldest = oldest_usable(self.version, max_staleness=self.settings.run.max_staleness)
        dropped = 0
        for i in idx:
            self.step_log.observe_staleness(self.version - samples[i].policy_version)
            if not usable(samples[i].policy_version, oldest=oldest) and samples[i].weight > 0:
                samples[i].weight = 0.0
                dropped += 1
        self.books.add(dropped_stale_samples=dropped)
        return dropped

    def train_cycle(self, cycle: int, samples: list[Sample]) -> None:
        run, ln = self.settings.run, self.settings.learner
        with self.timer.phase("working"):
            self._prepare(samples)
        for idx in steps_of_cycle(
            len(samples),
            steps=run.train_steps_per_cycle,
            passes=run.passes_per_cycle,
            seed=run.seed,
            cycle=cycle,
        ):
            t0 = time.monotonic()
            with self.timer.phase("working"):
                dropped = self._apply_staleness(samples, idx)
                mbs = objective.rank_micro_batches(
                    ln, samples, idx, pad_id=self.pad_id, device=self.device
                )
                stats_out: list[dict[str, float]] = []
                loss_fn = objective.make_loss_fn(
                    self.settings.training,
                    denominator=objective.step_denominator(ln, samples, idx),
                    stats_out=stats_out,
                )
                st = train_step(
                    self.model,
                    self.optimizer,
                    self.scheduler,
                    mbs,
                    loss_fn,
                    grad_clip=ln.grad_clip or None,
                )
            self.version += 1
            self.live.beat()
            trained = sum(1 for i in idx if samples[i].weight > 0)  # not dropped, filtered, masked
            self.books.add(trained_samples=trained)
            self.last_step = step_record(
                version=self.version,
                cycle=cycle,
                samples=samples,
                idx=idx,
                step=st,
                stats=stats_out,
                dropped=dropped,
                trained=trained,
                seconds=time.monotonic() - t0,
            )
            self.step_log.record(self.last_step, st)
            _test_only_step_delay()
            if self.version % ln.publish_every_steps == 0:
                self.publish()
            self.bus_side.dispatch(self.version, first_cycle=self.next_cycle)
            if ln.eval_every_steps and self.version % ln.eval_every_steps == 0:
                self.bus_side.start_eval(self.version)

    # ------------------------------------------------------------------ the loop
    def _idle(self) -> None:
        """Rank 0, while it waits for input: a heartbeat, and every ``keepalive_s`` a WAITING
        word to the other ranks (which may answer that one of them is stopping). When a
        generator joined since the last publish, at once a CATCH_UP word, and every rank sends
        it the current weights (a streamed publish gathers from every rank)."""
        self.live.beat()
        due = self.publishing.catch_up_due()
        if due or time.monotonic() - self._last_word >= self.settings.learner.keepalive_s:
            self._last_word = time.monotonic()
            _, others_stopping = control(CATCH_UP if due else WAITING, self._stop, self.device)
            self._stop = self._stop or others_stopping
            if due:
                self.publish(catch_up=True)

    def _next_cycle_groups(self, cycle: int) -> tuple[bool, list | None]:
        """(go on, the cycle's scored groups on rank 0 / None on the others): rank 0 collects,
        then says GO or STOP, or FINISH at the end of a run asked to end early (``ended_early``
        then set on every rank); the others listen through its WAITING words. Every rank
        returns the same ``go on``, so all leave the loop at the same point. The one place the
        loop tells the ranks apart: the two sides of this exchange differ."""
        groups = None
        if isinstance(self.bus_side, BusSide):  # rank 0
            if not self._stop and cycle >= self.bus_side.end_cycle:
                word, stopping = control(FINISH, self._stop, self.device)
                self.ended_early = word == FINISH and not stopping
                return False, None
            if not self._stop:
                try:
                    groups = self.bus_side.collect(cycle, stop=lambda: self._stop, idle=self._idle)
                except LostCycle as exc:  # every rank stops here, then rank 0 says why
                    self.fatal, self._stop = exc, True
                if groups is not None:  # dynamic sampling's groups left out (filtered, surplus)
                    self.books.add(**self.bus_side.selection_counts)
            word, stopping = control(GO if groups is not None else STOP, self._stop, self.device)
            self._last_word = time.monotonic()
        else:
            word, stopping = self._listen()
            self.ended_early = word == FINISH and not stopping
        return word == GO and not stopping, groups

    def _listen(self) -> tuple[int, bool]:
        """A rank other than 0: follow rank 0's words (publishing with it on CATCH_UP) until
        one that is not WAITING or CATCH_UP."""
        word, stopping = WAITING, False
        while word in (WAITING, CATCH_UP):
            word, stopping = control(0, self._stop, self.device)
            self.live.beat()
            if word == CATCH_UP:
                self.publish(catch_up=True)
        return word, stopping

    def _wait_for_generators(self, n: int) -> None:
        """Rank 0, before the first dispatch: with ``run.start_with_generators``, hold the
        prompts until ``n`` generators joined the weight sync (each gets the current weights
        at once, through ``_idle``), saying every minute how many are in. The other ranks are
        in ``_listen`` meanwhile, following its words."""
        if not n or not isinstance(self.bus_side, BusSide):
            return
        t0 = last_said = time.monotonic()
        while not self._stop and self.publishing.joined() < n:
            self._idle()
            if time.monotonic() - last_said >= 60.0:
                last_said = time.monotonic()
                log.info("waiting for generators: %d of %d joined (run.start_with_generators) "
                         "after %.0f s", self.publishing.joined(), n, last_said - t0)  # fmt: skip
            time.sleep(0.2)
        log.info("%d generator(s) joined after %.1f s: dispatching", self.publishing.joined(),
                 time.monotonic() - t0)  # fmt: skip

    def _finish_run(self) -> None:
        """Every cycle trained and checkpointed: rank 0 runs the last held-out round and writes
        the run-finished record (``BusSide.finish_run``). While it waits, a generator that joins
        (restarted, or started late) gets the current weights as during a cycle: without them
        it cannot answer the round, which needs the last version. The other ranks follow rank
        0's words meanwhile (a streamed publish gathers from every rank), until its STOP."""
        if isinstance(self.bus_side, BusSide):
            self.bus_side.finish_run(self.version, stop=lambda: self._stop, idle=self._idle)
            control(STOP, self._stop, self.device)
        else:
            self._listen()

    def run(self) -> None:
        self.setup()
        self.resume()
        self.publish()
        run = self.settings.run
        self._wait_for_generators(run.start_with_generators)
        self.bus_side.begin(self.version, self.next_cycle)  # held-out round, dispatch
        self.ready = True
        self.live.beat()
        while self.next_cycle < run.num_cycles:
            cycle = self.next_cycle
            go_on, groups = self._next_cycle_groups(cycle)
            if not go_on:
                break  # every rank leaves here together
            samples = broadcast_samples(
                samples_from_groups(groups) if groups is not None else None,
                rank=self.rank,
                device=self.device,
            )
            before = self.version
            self.train_cycle(cycle, samples)
            self.next_cycle = cycle + 1
            self.bus_side.housekeep()
            self.bus_side.check_finish_request(self.next_cycle)
            due = self.cadence.due(version=self.version, before=before, device=self.device)
            if due and self.next_cycle < run.num_cycles:
                self.checkpoint(wait=False)
            self.poll_checkpoint()
        self.checkpoint()
        if self.finished:  # the last held-out round, then the record
            self._finish_run()
        self.bus_side.housekeep(every_s=0.0)
        self.publishing.close()
        self.bus_side.close()
        if self.fatal is not None:
            raise self.fatal

    def stop(self) -> None:
        self._stop = True

    @property
    def finished(self) -> bool:
        """Every cycle of the run trained, or of a run ended early all it was to train."""
        return self.next_cycle >= self.settings.run.num_cycles or self.ended_early

    def status(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "cycle": self.next_cycle,
            # the run ends before end_cycle: num_cycles, or fewer once asked to end early
            "num_cycles": self.settings.run.num_cycles,
            "end_cycle": self.bus_side.end_cycle,
            "ready": self.ready,
            "books": self.books.to_dict(),
            "last_step": self.last_step,
            "no_progress_s": self.bus_side.silent_s,
        }


def _resumed_books(extra: dict[str, Any]) -> LearnerBooks:
    """The books a checkpoint holds. Checkpoints written before the books had a type (no
    ``books``) kept the same counts as ``counters``, the stale drops as ``dropped_stale``:
    read once here, the next checkpoint holds ``books``."""
    if "books" in extra:
        return LearnerBooks.from_dict(extra["books"])
    counts = dict(extra.get("counters", {}))
    if "dropped_stale" in counts:
        counts["dropped_stale_samples"] = counts.pop("dropped_stale")
    return LearnerBooks(**counts)
