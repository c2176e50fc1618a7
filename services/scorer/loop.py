"""The scorer service loop.

Consumes  ``<run>:groups`` through the consumer group ``scorers`` (several replicas share it; a
          SIGKILLed replica's entries are claimed by another after ``bus.claim_idle_s``, or
          drained by its restarted self first).
Produces  ``<run>:scored``: one ``ScoredGroup`` per group — one reward per response with its
          components — published and acked in one atomic commit, de-duplicated by group id, so
          every group is scored exactly once downstream and the learner receives whole groups.
Waits for groups; for room in the learner's backlog (back-pressure on undelivered entries).
Unblocked by generators publishing and the learner consuming.
Stops when the learner's run-finished record appears (exit code 0, ``common.service.run_end``,
          watched by ``serve_async``), or on SIGTERM/SIGINT (exit code 75).

Rule mode grades each response's extracted answer with math-verify in worker processes with a
hard timeout (``GraderPool``); solver mode sends every response of the batch to a frozen solver
LLM at once (continuous batching) and grades its answers. A group whose ground truth is missing
cannot be scored at all and goes to the dead-letter stream with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from typing import Any

from common.bus.client import Bus
from common.bus.consumer import Consumer, let_go
from common.protocol import streams, wire
from common.telemetry.health import Liveness
from common.telemetry.metrics import PhaseTimer, metric
from services.scorer.grader_pool import GraderPool
from services.scorer.grading_worker import GRADING_REASONS
from services.scorer.rewards import RewardScorer, ScoredItem, ScoreItem
from services.scorer.settings import ScorerSettings
from services.scorer.solver import Solver

log = logging.getLogger(__name__)

# Tests only: "1" turns on the GraderPool's sleep hook (an answer "__tether_test_only_sleep__:<s>"
# makes a grading worker sleep), so a test can make batches slow enough to SIGKILL mid-batch.
TEST_ONLY_SLEEP_ENV = "TETHER_TEST_ONLY_GRADER_SLEEP"


class _Metrics:
    def __init__(self) -> None:
        self.items = metric(
            "Counter",
            "tether_scorer_items_total",
            "responses scored, by grading reason (correct, wrong, timeout, error, no_answer, ...)",
            ["reason"],
            initial=GRADING_REASONS,
        )
        self.groups = metric("Counter", "tether_scorer_groups_total", "groups scored")
        self.seconds = metric(
            "Histogram",
            "tether_scorer_batch_seconds",
            "seconds to score one batch of groups",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120),
        )
        self.batch = metric(
            "Histogram",
            "tether_scorer_batch_groups",
            "groups per scoring batch",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        )
        self.reward = metric(
            "Gauge",
            "tether_scorer_reward_mean",
            "mean reward component over the last batch",
            ["component"],
        )
        self.solver_tokens = metric(
            "Counter", "tether_scorer_solver_tokens_total", "solver answer tokens generated"
        )
        self.solver_requests = metric(
            "Histogram",
            "tether_scorer_solver_batch_requests",
            "solver requests submitted together",
            buckets=(1, 4, 16, 64, 128, 256, 512, 1024),
        )
        self.solver_seconds = metric(
            "Histogram",
            "tether_scorer_solver_batch_seconds",
            "seconds for the solver to answer and grade one batch",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
        )
        self.queue_wait = metric(
            "Histogram",
            "tether_scorer_queue_wait_seconds",
            "seconds a group waited between generation and scoring",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
        )
        self.unscorable = metric(
            "Counter",
            "tether_scorer_unscorable_groups_total",
            "groups dead-lettered as unscorable",
            ["reason"],
            initial=("missing_ground_truth",),
        )


class ScorerService:
    def __init__(
        self,
        settings: ScorerSettings,
        *,
        sid: str,
        batch_groups: int = 32,
        solver_engine: Any = None,
    ) -> None:
        """``solver_engine``: a started ``GenerationEngine`` serving the solver model, shared
        instead of starting one (tests, benchmarks); the service does not shut it down."""
        self.settings, self.sid = settings, sid
        self.bus = Bus(settings.bus, service="scorer")
        self.timer = PhaseTimer("scorer")
        self.metrics = _Metrics()
        self.batch_groups = batch_groups
        self.ready = False
        self.live = Liveness(settings.liveness_s)  # a beat per read and per scored batch
        self._stop = asyncio.Event()
        self.groups_scored = 0
        self.reasons: Counter[str] = Counter()  # responses scored by this process, by reason
        self.solver: Any = None
        self.solver_engine = solver_engine

    def _build(self) -> None:
        s = self.settings
        sleep_hook = os.environ.get(TEST_ONLY_SLEEP_ENV) == "1"
        if sleep_hook:
            log.warning("%s=1: test-only grading sleep hook is ON", TEST_ONLY_SLEEP_ENV)
        self.pool = GraderPool(
            s.grader_workers, s.grader_timeout_s, test_only_sleep_hook=sleep_hook
        )
        self.rewards = RewardScorer(s.rewards, pool=self.pool)

    async def _start_solver(self) -> None:
        s = self.settings
        assert s.solver is not None and s.solver_engine_settings is not None  # solver mode
        self.solver = Solver(s.solver, pool=self.pool, engine=self.solver_engine,
                             engine_settings=s.solver_engine_settings)  # fmt: skip
        await self.solver.start()

    # ------------------------------------------------------------------ scoring
    def _items(self, group: wire.TrajectoryGroup) -> list[Any]:
        return [
            ScoreItem(
                prompt=group.prompt_text,
                response=s.response_text,
                ground_truth=group.ground_truth,
                response_tokens=len(s.response_token_ids),
                metadata=dict(group.metadata),
                tool_errors=sum(1 for c in s.tool_calls if not c.ok),
            )
            for s in group.samples
        ]

    async def score(self, groups: list[wire.TrajectoryGroup]) -> list[list[Any]]:
        """Score every response of ``groups`` in one batch; returns ScoredItems per group.

        An agent's episode that returned its own reward (``Trajectory.agent_reward``) is not
        graded: its reward is the sum of those components (reason ``agent``); one whose agent
        failed gets 0 (reason ``agent_failed``: the learner never trains it)."""
        samples = [s for g in groups for s in g.samples]
        graded = [i for i, s in enumerate(samples) if s.agent_reward is None and not s.failed]
        flat_all = [it for g in groups for it in self._items(g)]
        done = await self._grade([flat_all[i] for i in graded])
        scored: list[Any] = []
        for s in samples:
            if s.failed:
                scored.append(ScoredItem(0.0, {}, "agent_failed", None))
            elif s.agent_reward is not None:
                comps = dict(s.agent_reward)
                scored.append(ScoredItem(sum(comps.values()), comps, "agent", None))
            else:
                scored.append(None)
        for i, item in zip(graded, done, strict=True):
            scored[i] = item
        out, i = [], 0
        for g in groups:
            out.append(scored[i : i + len(g.samples)])
            i += len(g.samples)
        return out

    async def _grade(self, flat: list[Any]) -> list[Any]:
        """Rule or solver grading of ``flat`` (ScoreItems), in one batch."""
        if not flat:
            return []
        if self.solver is not None:
            before, t0 = self.solver.solver_tokens, time.monotonic()
            correctness = await self.solver.correctness(flat)
            self.metrics.solver_seconds.observe(time.monotonic() - t0)
            self.metrics.solver_tokens.inc(self.solver.solver_tokens - before)
            self.metrics.solver_requests.observe(len(flat) * self.solver.s.samples)
            scored = await asyncio.to_thread(self.rewards.compose, flat, correctness)
        else:
            scored = await asyncio.to_thread(self.rewards.score_items, flat)
        return list(scored)

    def _scored_group(
        self, group: wire.TrajectoryGroup, items: list[Any], seconds: float
    ) -> wire.ScoredGroup:
        return wire.ScoredGroup(
            group=group,
            rewards=[float(it.reward) for it in items],
            components=[{k: float(v) for k, v in it.components.items()} for it in items],
            reasons=[
                it.reason if it.reason not in ("correct", "wrong", "agent") else "" for it in items
            ],  # fmt: skip
            scorer_id=self.sid,
            score_seconds=seconds,
        )

    async def _process(self, consumer, deliveries: list) -> None:
        good: list[Any] = []
        bad: list[Any] = []
        for d in deliveries:
            g: wire.TrajectoryGroup = d.msg
            # an agent's episodes that returned their own rewards need no ground truth
            graded = any(s.agent_reward is None and not s.failed for s in g.samples)
            no_truth = not (g.ground_truth or "").strip()
            (bad if g.split == "train" and graded and no_truth else good).append(d)
        for d in bad:
            self.metrics.unscorable.labels("missing_ground_truth").inc()
            await asyncio.to_thread(
                consumer.dead_letter,
                d,
                "unscorable",
                f"group {d.msg.group_id} has no ground truth; rule and solver rewards need one",
            )
        if not good:
            return
        t0 = time.monotonic()
        with self.timer.phase("working"):
            scored = await self.score([d.msg for d in good])
        seconds = time.monotonic() - t0
        msgs = [
            self._scored_group(d.msg, items, seconds) for d, items in zip(good, scored, strict=True)
        ]
        with self.timer.phase("blocked_backpressure"):
            await asyncio.to_thread(
                self.bus.wait_for_capacity, streams.SCORED, streams.LEARNER, count_pending=False
            )
        await asyncio.to_thread(
            consumer.commit,
            good,
            publish=[(streams.SCORED, m) for m in msgs],
            dedupe_ids=[m.group.group_id for m in msgs],
        )
        self._observe(msgs, scored, seconds)

    def _observe(
        self, msgs: list[wire.ScoredGroup], scored: list[list[Any]], seconds: float
    ) -> None:
        now = time.time()
        self.metrics.seconds.observe(seconds)
        self.metrics.batch.observe(len(msgs))
        self.metrics.groups.inc(len(msgs))
        self.groups_scored += len(msgs)
        sums: dict[str, float] = {}
        n = 0
        for m, items in zip(msgs, scored, strict=True):
            self.metrics.queue_wait.observe(max(0.0, now - m.group.created_at - seconds))
            for comps, item in zip(m.components, items, strict=True):
                self.metrics.items.labels(item.reason).inc()
                self.reasons[item.reason] += 1
                n += 1
                for k, v in comps.items():
                    sums[k] = sums.get(k, 0.0) + v
        for k, v in sums.items():
            self.metrics.reward.labels(k).set(v / max(n, 1))

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        self._build()
        await asyncio.to_thread(self.pool.wait_ready)
        if self.settings.mode == "solver":
            await self._start_solver()
        consumer = Consumer(self.bus, streams.GROUPS, streams.SCORERS, self.sid)
        # The learner's group, at id 0: scored groups published before the learner starts wait
        # for it, and back-pressure has a group to measure.
        await asyncio.to_thread(self.bus.ensure_group, streams.SCORED, streams.LEARNER)
        self.ready = True
        log.info(
            "scorer %s ready (mode %s, %d grading workers)",
            self.sid,
            self.settings.mode,
            self.settings.grader_workers,
        )
        try:
            while not self._stop.is_set():
                self.live.beat()
                with self.timer.phase("waiting_input"):
                    deliveries = await asyncio.to_thread(
                        consumer.read, self.batch_groups, self.settings.bus.block_ms
                    )
                if deliveries:
                    await self._process(consumer, deliveries)
        finally:
            if self._stop.is_set():  # stopped on purpose: what it held is not at fault
                await asyncio.to_thread(let_go, consumer)
            self.pool.close()
            if self.solver is not None:
                self.solver.shutdown()

    def stop(self) -> None:
        self._stop.set()

    def status(self) -> dict[str, Any]:
        """The heartbeat's fields: groups scored, readiness, mode, and ``reasons``: the
        responses this process scored by grading reason since it started (``tether status``
        sums them over the scorers; the same counts as ``tether_scorer_items_total``)."""
        return {"groups": self.groups_scored, "ready": self.ready, "mode": self.settings.mode,
                "reasons": dict(sorted(self.reasons.items()))}  # fmt: skip
