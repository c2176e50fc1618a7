"""The generator's sampling loop: prompts from the bus in, one trajectory group per prompt out.

For each prompt it waits for fresh enough weights and for room downstream, has the prompt's
responses sampled, and publishes them with the prompt's ack. How a response is sampled is the
one thing that varies: one turn each, by the engine here (``single_turn_trajectories``); or an
episode each, run by the ``agent`` package (``services/generator/agent/``): the built-in tool
loop with ``generator.max_turns > 1`` (``agent.tool_loop.start_runner``), your agent code through
the OpenAI-compatible endpoint with ``[agent]`` (``agent.runner.start_agents``). Either is an
object with ``run_prompt`` and ``close`` that this loop calls per prompt and at the end.

Consumes  ``<run>:prompts`` through the consumer group ``generators`` (the learner dispatches).
Produces  ``<run>:groups``: one ``TrajectoryGroup`` per prompt (all its responses, each with
          per-token behaviour log-probs and versions; an episode's segments with
          ``generator.max_turns > 1`` or ``[agent]``), published together with the ack of the
          prompt (exactly once per prompt id).
Waits for a prompt; for weights at least ``prompt.min_policy_version`` (the staleness gate: it
          never samples a trajectory the learner would have to drop); for room in the scorers'
          backlog (back-pressure); for the learner's weight store before its first sample; an
          episode also for its own tool calls (the sandbox; other episodes go on meanwhile),
          an agent's episode for its agent code (``agent.timeout_s`` at most).
Unblocked by the learner dispatching, the learner publishing weights, the scorers consuming,
          the tools answering.
Stops when the learner's run-finished record appears (exit code 0, ``common.service.run_end``,
          watched by ``serve_async``), or on SIGTERM/SIGINT (exit code 75).

Health (``common.telemetry.health``): the loop beats ``loop`` at least once a second and
``_watch_engine`` beats ``engine`` whenever vLLM's engine-core process answers a cheap call (a
weight update counts as progress until its deadline); ``/healthz`` turns 503 when either is
silent for ``generator.liveness_s``, and ``/readyz`` with it.

Weights (``weights.py``): the generator joins the learner's weight group at start and receives
the current version before it generates anything; updates are applied in flight, so tokens
sampled after one carry the new version (``Trajectory.token_versions``, ``trajectories.py``); a
trajectory's ``policy_version`` is the version of its oldest sampled token — the one staleness
is judged by (for an episode, over all its assistant turns).

Versions never go backwards within an episode. A learner restarted from a checkpoint older than
the last version it published sends its (lower) version; the engine loads it like any update,
and a response (or an episode's later turn) in flight would then carry versions such as 294
then 292: two timelines of training in one episode, which no staleness rule can judge (the
scorers dead-lettered such groups as ``bad_value``). Such a prompt is generated again, whole, on
the weights now loaded (``trajectories.RolledBack``,
``tether_generator_regenerated_prompts_total``). A group finished on the lost timeline before
the roll-back keeps its honest version: the restarted learner, on the same checkpoint and the
same batches, trains on it as on any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from common.bus.client import Bus
from common.bus.consumer import Consumer, let_go
from common.data.model_paths import moe_routing_shape
from common.data.prompts import encode_prompt, prompt_of
from common.engine import GenerationEngine
from common.protocol import streams, wire
from common.protocol.routing import RoutingShape
from common.protocol.staleness import usable
from common.telemetry.health import Liveness
from common.telemetry.metrics import PhaseTimer, metric
from services.generator.agent.runner import start_agents
from services.generator.agent.tool_loop import start_runner
from services.generator.claims import ClaimKeeper
from services.generator.settings import GeneratorSettings
from services.generator.trajectories import (
    RolledBack,
    check_episodes_order,
    check_samples_order,
    single_turn_trajectories,
    split_routing,
    to_group,
)
from services.generator.weights import WeightFollower

log = logging.getLogger(__name__)

ENGINE_PING_EVERY_S = 2.0  # how often the engine-core process is asked a cheap question
ENGINE_PING_TIMEOUT_S = 10.0  # an answer later than this is no answer
MAX_REGENERATIONS = 3  # a prompt whose versions went back is generated again at most this often


class _Metrics:
    def __init__(self) -> None:
        self.tokens = metric(
            "Counter", "tether_generator_tokens_total", "response tokens generated"
        )
        self.groups = metric(
            "Counter",
            "tether_generator_groups_total",
            "groups published",
            ["split"],
            initial=("train", "eval"),
        )
        self.in_flight = metric(
            "Gauge", "tether_generator_prompts_in_flight", "prompts taken but not yet published"
        )
        self.version = metric(
            "Gauge", "tether_generator_policy_version", "policy version the engine runs"
        )
        self.update_seconds = metric(
            "Histogram",
            "tether_generator_weight_update_seconds",
            "seconds per in-flight weight update",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.update_bytes = metric(
            "Counter", "tether_generator_weight_update_bytes_total", "bytes of weights received"
        )
        self.update_failures = metric(
            "Counter",
            "tether_generator_weight_update_failures_total",
            "failed weight updates (previous version kept)",
        )
        self.staleness_wait = metric(
            "Counter",
            "tether_generator_staleness_wait_seconds_total",
            "seconds prompts waited for newer weights",
        )
        self.regenerated = metric(
            "Counter",
            "tether_generator_regenerated_prompts_total",
            "prompts generated again because the policy version went back mid-generation (a "
            "learner restarted from an older checkpoint than its last publish)",
        )
        self.tokens_per_s = metric(
            "Gauge",
            "tether_generator_tokens_per_second",
            "response tokens per second over the last status interval",
        )


class GeneratorService:
    def __init__(self, settings: GeneratorSettings, *, sid: str) -> None:
        self.settings, self.sid = settings, sid
        self.bus = Bus(settings.bus, service="generator")
        self.timer = PhaseTimer("generator")
        self.metrics = _Metrics()
        self._joined = False  # the first join returned (with weights, or none published yet)
        self.live = Liveness(settings.liveness_s)
        self._stop = asyncio.Event()
        self.weights: WeightFollower | None = None  # once the engine runs
        self._waiting_staleness = 0
        self._waiting_backpressure = 0
        self._held: set[str] = set()  # prompt entry ids taken and not yet committed
        self.tokens_generated = 0
        self.groups_published = 0
        # an EpisodeRunner (generator.max_turns > 1) or an AgentRunner ([agent]): run_prompt, close
        self.episodes: Any = None
        self.tool_schemas: list[dict[str, Any]] | None = None
        # routing replay (learner.router_replay): the model's RoutingShape, and each request's
        # prompt routing until its group is made
        self.routing: Any = None
        self._prompt_routing: dict[str, Any] = {}

    # ------------------------------------------------------------------ start-up
    async def _start_engine(self) -> None:
        settings = self.settings.engine
        if settings.return_routed_experts:
            shape = moe_routing_shape(settings.model)
            assert shape is not None, "preflight refuses router_replay for a dense model"
            self.routing = RoutingShape(*shape)
        self.engine = GenerationEngine(settings)
        await self.engine.start()
        if settings.max_lora_rank:  # a LoRA learner publishes adapters: this vLLM must take them
            problem = (await self.engine.collective_rpc("tether_check_lora"))[0]
            if problem:
                raise RuntimeError(f"generator.max_lora_rank = {settings.max_lora_rank}: {problem}")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.settings.tokenizer)
        if self.settings.agent is not None:  # your agent's code, through the endpoint
            self.episodes = await start_agents(
                self.settings.agent, engine=self.engine, tokenizer=self.tokenizer,
                version=lambda: int(self.version or 0),
            )  # fmt: skip
        elif self.settings.tool_loop is not None:  # generator.max_turns > 1
            self.episodes = await start_runner(
                self.settings.tool_loop, engine=self.engine, tokenizer=self.tokenizer,
                generator_id=self.sid,
            )  # fmt: skip
            self.tool_schemas = [s.schema() for s in self.episodes.sandbox.specs.values()]
            # the runner's: with generator.tool_prompt = system it writes the tool list into
            # the system message, and the prompts must be what its episodes continue
            self.tokenizer = self.episodes.tokenizer
            self.episodes.routing = self.routing  # each episode's routing (replay on)
        self.weights = WeightFollower(
            self.engine,
            settings=self.settings.weights,
            bus=self.bus,
            sid=self.sid,
            timer=self.timer,
            metrics=self.metrics,
            stopped=self._stop,
        )

    @property
    def ready(self) -> bool:
        """``/readyz``: joined and running weights. A first receive that times out (a learner
        still starting, slower than ``weights.timeout_s``) leaves the generator joined without
        weights: it takes prompts and holds them at the staleness gate, but is not ready until
        a version arrives."""
        return self._joined and self.version is not None

    @property
    def version(self) -> int | None:
        """The policy version the engine runs (None before the first weights arrive)."""
        return self.weights.version if self.weights is not None else None

    # ------------------------------------------------------------------ one prompt
    def _prompt_ids(self, msg: wire.PromptMsg) -> list[int]:
        """What vLLM receives: the loader's encoding (``encode_prompt``), which the learner's
        length check counted, so the two cannot differ. ValueError when it cannot be encoded."""
        return encode_prompt(
            self.tokenizer,
            prompt_of(msg),
            apply_chat_template=self.settings.apply_chat_template,
            tools=self.tool_schemas,
        )

    def _sampling(self, msg: wire.PromptMsg):
        """The prompt's sampling settings, with its own seed (``SamplingPlan.for_prompt``)."""
        return self.settings.sampling.for_prompt(msg)

    async def _gate(self, need: int) -> None:
        """The staleness gate: wait until the engine runs weights >= ``need``."""
        assert self.weights is not None, "the engine runs before prompts are taken"
        if usable(self.weights.version, oldest=need):
            return
        self._waiting_staleness += 1
        t0 = time.monotonic()
        try:
            while not usable(self.weights.version, oldest=need):
                await self.weights.changed.wait()
        finally:
            self._waiting_staleness -= 1
            self.metrics.staleness_wait.inc(time.monotonic() - t0)

    async def _sample(
        self, msg: wire.PromptMsg, ids: list[int], *, request_id: str
    ) -> list[wire.Trajectory]:
        """The prompt's responses: episodes (``self.episodes``: the built-in tool loop or
        your agent's, ``agent/``) or one turn each. A response the engine reports no version spans
        for is labelled with the version the engine ran when the request was submitted: the
        oldest that can have sampled any of its tokens (read after generation, an in-flight
        update would make it look newer than it is). Versions that go backwards inside a
        response raise ``RolledBack``."""
        started, version = time.time(), self.version
        sampling = self._sampling(msg)
        if self.episodes is not None:
            episodes = await self.episodes.run_prompt(
                msg, ids, sampling, request_id=request_id, version=int(version or 0),
                started=started,
            )  # fmt: skip
            check_episodes_order(episodes)
            taken = getattr(self.episodes, "prompt_routing", {}).pop(request_id, None)
            if taken is not None:  # the tool loop's (your agent's episodes carry none yet)
                self._prompt_routing[request_id] = taken
            return episodes
        samples = await self.engine.generate_group(ids, sampling, request_id=request_id)
        check_samples_order(samples)
        if self.routing is not None and samples:  # the prompt ran once: any sample's is it
            self._prompt_routing[request_id] = split_routing(
                self.routing, samples[0].routed_experts, len(ids), 0)[0]  # fmt: skip
        return single_turn_trajectories(msg, samples, started=started, version=version,
                                        prompt_len=len(ids), routing=self.routing)  # fmt: skip

    async def _handle(self, consumer, d) -> None:
        self._held.add(d.entry_id)
        try:
            await self._generate_and_commit(consumer, d)
        finally:
            self._held.discard(d.entry_id)

    async def _generate_and_commit(self, consumer, d) -> None:
        msg: wire.PromptMsg = d.msg
        try:
            ids = self._prompt_ids(msg)
        except ValueError as exc:  # e.g. a chat list with data.apply_chat_template = false
            await asyncio.to_thread(consumer.dead_letter, d, "unencodable_prompt", str(exc))
            return
        for attempt in range(MAX_REGENERATIONS + 1):
            await self._gate(msg.min_policy_version)  # again after a roll-back
            request_id = f"{msg.prompt_id}@{self.sid}@{d.deliveries}" + f".{attempt}" * bool(
                attempt
            )
            try:
                trajectories = await self._sample(msg, ids, request_id=request_id)
                break
            except RolledBack as back:
                if attempt == MAX_REGENERATIONS:
                    raise
                self.metrics.regenerated.inc()
                log.warning(
                    "prompt %s: the policy version went back during its generation (%s: the "
                    "learner restarted from an older checkpoint); generating it again on the "
                    "weights now loaded, so that its versions never go backwards",
                    msg.prompt_id, back,
                )  # fmt: skip
        group = to_group(msg, ids, trajectories, generator_id=self.sid, routing=self.routing,
                         prompt_routing=self._prompt_routing.pop(request_id, None))  # fmt: skip
        self._waiting_backpressure += 1
        try:
            await asyncio.to_thread(self.bus.wait_for_capacity, streams.GROUPS, streams.SCORERS)
        finally:
            self._waiting_backpressure -= 1
        # the commit also adds to the run-long count per generator id (a restart continues it)
        await asyncio.to_thread(
            consumer.commit,
            [d],
            publish=[(streams.GROUPS, group)],
            dedupe_ids=[group.group_id],
            count_as=streams.generated_field(self.sid, msg.split),
        )
        n_tokens = sum(t.num_sampled for t in trajectories)
        self.tokens_generated += n_tokens
        self.groups_published += 1
        self.metrics.tokens.inc(n_tokens)
        self.metrics.groups.labels(msg.split).inc()

    # ------------------------------------------------------------------ the loop
    def _classify(self, in_flight: int) -> str:
        if self.weights is not None and self.weights.updating:
            return "syncing_weights"
        if self.engine.num_unfinished_requests() > 0:
            return "working"
        if self._waiting_staleness:
            return "blocked_staleness"
        if self._waiting_backpressure:
            return "blocked_backpressure"
        return "waiting_input" if in_flight == 0 else "working"

    async def _sample_phases(self, tasks: set) -> None:
        last_t, last_tokens = time.monotonic(), 0
        rate_t = last_t
        while not self._stop.is_set():
            await asyncio.sleep(0.1)
            now = time.monotonic()
            self.timer.add(self._classify(len(tasks)), now - last_t)
            last_t = now
            self.metrics.in_flight.set(len(tasks))
            if now - rate_t >= 5.0:
                self.metrics.tokens_per_s.set(
                    (self.tokens_generated - last_tokens) / (now - rate_t)
                )
                last_tokens, rate_t = self.tokens_generated, now

    async def _keep_claims(self, consumer) -> None:
        """Reset the idle time of the prompts this generator still works on, every third of
        ``bus.claim_idle_s``: a live generator keeps its prompts however long it takes (the
        staleness gate, long responses), so only a dead one's are taken over by its peers; but
        not while it is cut off from the weights (``services.generator.claims``).

        Only entries the group still lists as ours are touched, and only when idle for half a
        period at least: an entry a peer claimed a moment ago (idle ~0) is never taken back.
        While the claims lapse the generator takes no prompts (they would wait at the staleness
        gate for a version it cannot get, until a peer took them over) and its consumer no idle
        entries (``Consumer.lapsing``: its own XAUTOCLAIM would claim back what it lets lapse,
        before a peer could); the first version it loads ends that."""
        assert self.weights is not None
        period_s = max(0.5, self.settings.bus.claim_idle_ms / 3000)
        keeper = ClaimKeeper(period_s)
        while not self._stop.is_set():
            if consumer.lapsing:  # a version loaded ends it at once, not a period later
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.weights.changed.wait(), timeout=period_s)
            else:
                await asyncio.sleep(period_s)
            held = set(self._held)
            try:
                learner = await asyncio.to_thread(self.bus.get, streams.LEARNER_VERSION)
                keep = keeper.keep(time.monotonic(), self.weights.version,
                                   int(learner) if learner else None)  # fmt: skip
                if keep == consumer.lapsing:  # the state changes
                    consumer.lapsing = not keep
                    if consumer.lapsing:
                        log.warning(
                            "behind the learner's v%s for %.0f s on v%s (cut off from its weight "
                            "store?): letting the claims on the %d prompt(s) it holds lapse, so "
                            "that a peer takes them over after bus.claim_idle_s; taking no "
                            "prompts until a version loads", learner,
                            time.monotonic() - (keeper.behind_since or 0), self.weights.version,
                            len(held),
                        )  # fmt: skip
                    else:
                        log.info("weights loaded (v%s): keeping the claims and taking prompts "
                                 "again", self.weights.version)  # fmt: skip
                if keep and held:
                    await asyncio.to_thread(
                        consumer.refresh_claims, held, min_idle_ms=int(period_s * 500)
                    )
            except Exception as exc:  # best effort: the commit's dedupe covers a lost race
                log.warning("could not refresh the claim on %d prompts: %s", len(held), exc)

    async def _watch_engine(self) -> None:
        """Beat ``engine`` while the engine-core process answers ``is_paused`` within
        ``ENGINE_PING_TIMEOUT_S``. A weight update in progress counts as progress until its
        deadline (``weights.timeout_s`` plus a margin); a transfer stuck past it, or a stopped or
        wedged engine core, stops the beats."""
        assert self.weights is not None
        deadline_s = self.settings.weights.timeout_s + 30.0
        while not self._stop.is_set():
            since = self.weights.updating_since
            if since is not None:
                if time.monotonic() - since <= deadline_s:
                    self.live.beat("engine")
            else:
                try:
                    await asyncio.wait_for(self.engine.ping(), timeout=ENGINE_PING_TIMEOUT_S)
                    self.live.beat("engine")
                except Exception as exc:  # a timeout or a dead engine: no beat, /healthz says so
                    log.warning("the vLLM engine did not answer: %r", exc)
            await asyncio.sleep(ENGINE_PING_EVERY_S)

    async def run(self) -> None:
        await self._start_engine()
        assert self.weights is not None
        await self.weights.join_until_done()
        self._joined = True
        self.bus.ensure_group(streams.GROUPS, streams.SCORERS)  # back-pressure reads its backlog
        consumer = Consumer(self.bus, streams.PROMPTS, streams.GENERATORS, self.sid)
        tasks: set[asyncio.Task] = set()
        helpers = [
            asyncio.create_task(c)
            for c in (
                self.weights.watch(),
                self._sample_phases(tasks),
                self._keep_claims(consumer),
                self._watch_engine(),
            )
        ]
        limit = self.settings.max_prompts_in_flight
        log.info("generator %s ready on version %s; taking prompts", self.sid, self.version)
        try:
            while not self._stop.is_set():
                self.live.beat("loop")
                for h in helpers:
                    if h.done() and not h.cancelled() and h.exception() is not None:
                        raise RuntimeError(f"generator background task failed: {h.exception()!r}")
                for t in [t for t in tasks if t.done()]:
                    tasks.discard(t)
                    if t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                room = limit - len(tasks)
                if consumer.lapsing:  # cut off from the weights (``_keep_claims``)
                    await asyncio.sleep(self.settings.bus.block_ms / 1000)
                    continue
                if room <= 0:
                    await asyncio.wait(tasks, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                    continue
                block = 50 if tasks else self.settings.bus.block_ms
                deliveries = await asyncio.to_thread(consumer.read, room, block)
                for d in deliveries:
                    tasks.add(asyncio.create_task(self._handle(consumer, d)))
                if tasks and not deliveries:
                    await asyncio.sleep(0.02)
        finally:
            for h in helpers:
                h.cancel()
            for t in tasks:
                t.cancel()
            if self.episodes is not None:
                await self.episodes.close()
            if self._stop.is_set():  # stopped on purpose: what it held is not at fault
                await asyncio.to_thread(let_go, consumer)

    def stop(self) -> None:
        self._stop.set()

    def status(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "tokens": self.tokens_generated,
            "groups": self.groups_published,
            "ready": self.ready,
        }
