"""The generator service loop.

Consumes  ``<run>:prompts`` through the consumer group ``generators`` (the learner dispatches).
Produces  ``<run>:groups``: one ``TrajectoryGroup`` per prompt (all its responses, each with
          per-token behaviour log-probs and the policy version spans that produced it),
          published together with the ack of the prompt (exactly once per prompt id).
Waits for a prompt; for weights at least ``prompt.min_policy_version`` (the staleness gate: it
          never samples a trajectory the learner would have to drop); for room in the scorers'
          backlog (back-pressure); for the learner's weight store before its first sample.
Unblocked by the learner dispatching, the learner publishing weights, the scorers consuming.

Weights: the generator joins the learner's weight group at start and receives the current
version before it generates anything. An update is applied in flight: the engine pauses
(requests keep their state), the worker receives and verifies every tensor, loads them, the
version label advances, the engine resumes. Tokens sampled after the update carry the new
version (``Trajectory.version_spans``); a trajectory's ``policy_version`` is the version of its
first token, the oldest — the one staleness is judged by. A failed update leaves the previous
complete version loaded and is counted; the generator rejoins and gets the next one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from common.bus.settings import bus_settings_for
from common.config.schema import TetherConfig
from common.protocol import streams, wire
from common.protocol.staleness import usable
from common.telemetry.metrics import PhaseTimer, metric

log = logging.getLogger(__name__)

WORKER_EXT = "services.generator.worker_ext.TetherWorkerExtension"


class _Metrics:
    def __init__(self) -> None:
        m = metric
        self.tokens = m("Counter", "tether_generator_tokens_total", "response tokens generated")
        self.groups = m("Counter", "tether_generator_groups_total", "groups published", ["split"])
        self.in_flight = m(
            "Gauge", "tether_generator_prompts_in_flight", "prompts taken but not yet published"
        )
        self.version = m(
            "Gauge", "tether_generator_policy_version", "policy version the engine runs"
        )
        self.update_seconds = m(
            "Histogram",
            "tether_generator_weight_update_seconds",
            "seconds per in-flight weight update",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.update_bytes = m(
            "Counter", "tether_generator_weight_update_bytes_total", "bytes of weights received"
        )
        self.update_failures = m(
            "Counter",
            "tether_generator_weight_update_failures_total",
            "failed weight updates (previous version kept)",
        )
        self.staleness_wait = m(
            "Counter",
            "tether_generator_staleness_wait_seconds_total",
            "seconds prompts waited for newer weights",
        )
        self.tokens_per_s = m(
            "Gauge",
            "tether_generator_tokens_per_second",
            "response tokens per second over the last status interval",
        )


class GeneratorService:
    def __init__(self, cfg: TetherConfig, *, sid: str, redis_url: str | None = None) -> None:
        from common.bus.client import Bus

        self.cfg, self.sid = cfg, sid
        self.bus = Bus(bus_settings_for(cfg, redis_url=redis_url), service="generator")
        self.timer = PhaseTimer("generator")
        self.metrics = _Metrics()
        self.version: int | None = None
        self.ready = False
        self._version_changed = asyncio.Event()
        self._updating = False
        self._stop = asyncio.Event()
        self._waiting_staleness = 0
        self._waiting_backpressure = 0
        self._held: set[str] = set()  # prompt entry ids taken and not yet committed
        self.tokens_generated = 0
        self.groups_published = 0

    # ------------------------------------------------------------------ start-up
    async def _start_engine(self) -> None:
        from services.generator.engine import EngineSettings, GenerationEngine

        g, run = self.cfg.generator, self.cfg.run
        from common.data.model_paths import policy_paths

        model_dir, tok_dir = policy_paths(self.cfg)
        dtype = (
            g.dtype if g.dtype != "auto" else "float32" if g.gpus_per_replica == 0 else "bfloat16"
        )
        self.engine = GenerationEngine(
            EngineSettings(
                model=model_dir,
                tokenizer=tok_dir,
                dtype=dtype,
                max_model_len=run.max_prompt_tokens + run.max_response_tokens,
                gpu_memory_utilization=g.gpu_memory_utilization,
                kv_cache_gib=g.kv_cache_gib,
                enforce_eager=g.enforce_eager,
                max_num_seqs=g.max_num_seqs,
                seed=run.seed,
                tensor_parallel_size=g.tensor_parallel_size,
                worker_extension_cls=WORKER_EXT,
            )
        )
        await self.engine.start()
        from common.data.model_paths import policy_tokenizer

        self.tokenizer = policy_tokenizer(self.cfg)

    async def _weight_address(self) -> tuple[str, int]:
        w = self.cfg.weights
        if w.port:
            return w.host, w.port
        with self.timer.phase("waiting_input"):
            while not self._stop.is_set():
                addr = await asyncio.to_thread(self.bus.get, streams.WEIGHTS_ADDR)
                if addr:
                    host, _, port = addr.rpartition(":")
                    return host, int(port)
                await asyncio.sleep(0.5)
        raise asyncio.CancelledError

    async def _join_and_receive(self) -> None:
        """(Re)join the weight group and receive the current weights before generating."""
        host, port = await self._weight_address()
        self._joined_addr = f"{host}:{port}"
        timeout = self.cfg.weights.timeout_s
        res = await self.engine.collective_rpc("tether_join", args=(host, port, self.sid, timeout))
        log.info(
            "joined weight sync at %s:%d as %s (epoch %s)", host, port, self.sid, res[0]["epoch"]
        )
        await self._apply_update(wait_s=timeout)

    async def _apply_update(self, *, wait_s: float | None = None) -> bool:
        """Pause, receive + verify + load, relabel, resume. Returns True when a new version loaded."""
        self._updating = True
        t0 = time.monotonic()
        try:
            with self.timer.phase("syncing_weights"):
                await self.engine.pause(mode="keep", clear_cache=True)
                try:
                    res = (
                        await self.engine.collective_rpc(
                            "tether_receive_update", kwargs={"wait_s": wait_s}
                        )
                    )[0]
                    if res["ok"]:
                        await self.engine.set_weight_version(res["version"])
                finally:
                    await self.engine.resume()
        finally:
            self._updating = False
        if not res["ok"]:
            self.metrics.update_failures.inc()
            log.warning("weight update failed, still on version %s: %s", self.version, res["error"])
            return False
        self.version = int(res["version"])
        self.metrics.version.set(self.version)
        self.metrics.update_seconds.observe(time.monotonic() - t0)
        self.metrics.update_bytes.inc(res["bytes"])
        await asyncio.to_thread(self.bus.set, streams.generator_version(self.sid), self.version)
        log.info(
            "now on policy version %d (%.1f MB in %.2f s)",
            self.version,
            res["bytes"] / 1e6,
            time.monotonic() - t0,
        )
        self._version_changed.set()
        self._version_changed = asyncio.Event()
        return True

    async def _watch_weights(self) -> None:
        """Take updates as they come; rejoin when dropped.

        The learner announces a publish in Redis (``weights:publishing``) before it sends, so
        the cheap check is a GET here; the worker-side poll (an RPC into the engine core, which
        keeps vLLM's message queue busy) runs only when a newer version is announced, and every
        few seconds as a safety net (it also notices that the learner dropped us)."""
        last_rpc = 0.0
        while not self._stop.is_set():
            await asyncio.sleep(0.2)
            announced, addr = await asyncio.to_thread(
                lambda: (
                    self.bus.get(streams.WEIGHTS_PUBLISHING),
                    self.bus.get(streams.WEIGHTS_ADDR),
                )
            )
            moved = (
                addr is not None
                and not self.cfg.weights.port
                and addr != getattr(self, "_joined_addr", addr)
            )
            newer = announced is not None and (
                self.version is None or int(announced) > self.version
            )
            if not (moved or newer) and time.monotonic() - last_rpc < 5.0:
                continue
            last_rpc = time.monotonic()
            try:
                poll = (await self.engine.collective_rpc("tether_poll"))[0]
            except Exception as exc:  # noqa: BLE001 - the engine answers errors; this is transport
                poll = {"error": f"poll failed: {exc}", "pending": None}
            if moved:
                poll = {
                    "error": f"the learner's weight store moved to {addr} (learner restarted)",
                    "pending": None,
                }
            if poll["error"]:
                log.warning("weight sync: %s — rejoining", poll["error"])
                try:
                    await self._join_and_receive()
                except Exception as exc:  # the learner may be restarting: try again later
                    log.warning("rejoin failed (%s); retrying", exc)
                    await asyncio.sleep(2.0)
            elif poll["pending"] is not None:
                await self._apply_update()
            elif newer:
                last_rpc = 0.0  # announced but not yet pending in the store: look again soon

    # ------------------------------------------------------------------ one prompt
    def _prompt_ids(self, msg: wire.PromptMsg) -> list[int]:
        """What vLLM receives: the loader's encoding (``encode_prompt``), which the learner's
        length check counted, so the two cannot differ. ValueError when it cannot be encoded."""
        from common.data.prompts import encode_prompt, prompt_of

        return encode_prompt(
            self.tokenizer, prompt_of(msg), apply_chat_template=self.cfg.data.apply_chat_template
        )

    def _sampling(self, split: str):
        from services.generator.engine import SamplingSettings

        g, run = self.cfg.generator, self.cfg.run
        if split == "eval":
            return SamplingSettings(
                n=1,
                temperature=g.eval_temperature,
                max_tokens=run.max_response_tokens,
                stop=tuple(g.stop),
            )
        return SamplingSettings(
            n=run.responses_per_prompt,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=max(g.top_k, 0),
            max_tokens=run.max_response_tokens,
            stop=tuple(g.stop),
            ignore_eos=g.ignore_eos,
        )

    async def _gate(self, need: int) -> None:
        """The staleness gate: wait until the engine runs weights >= ``need``."""
        if usable(self.version, oldest=need):
            return
        self._waiting_staleness += 1
        t0 = time.monotonic()
        try:
            while not usable(self.version, oldest=need):
                await self._version_changed.wait()
        finally:
            self._waiting_staleness -= 1
            self.metrics.staleness_wait.inc(time.monotonic() - t0)

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
        await self._gate(msg.min_policy_version)
        started = time.time()
        samples = await self.engine.generate_group(
            ids, self._sampling(msg.split), request_id=f"{msg.prompt_id}@{self.sid}@{d.deliveries}"
        )
        group = self._to_group(msg, ids, samples, started)
        self._waiting_backpressure += 1
        try:
            await asyncio.to_thread(self.bus.wait_for_capacity, streams.GROUPS, streams.SCORERS)
        finally:
            self._waiting_backpressure -= 1
        await asyncio.to_thread(
            consumer.commit, [d], publish=[(streams.GROUPS, group)], dedupe_ids=[group.group_id]
        )
        n_tokens = sum(len(s.token_ids) for s in samples)
        self.tokens_generated += n_tokens
        self.groups_published += 1
        self.metrics.tokens.inc(n_tokens)
        self.metrics.groups.labels(msg.split).inc()

    def _to_group(
        self, msg: wire.PromptMsg, ids: list[int], samples: list[Any], started: float
    ) -> wire.TrajectoryGroup:
        import numpy as np

        trajectories = []
        for i, s in enumerate(samples):
            spans = [
                (int(start), int(v))
                for v, start, _end in s.weight_versions
                if str(v).lstrip("-").isdigit()
            ]
            if not spans:
                spans = [(0, int(self.version or 0))]
            trajectories.append(
                wire.Trajectory(
                    sample_id=f"{msg.prompt_id}/{i}",
                    sample_index=i,
                    response_token_ids=np.asarray(s.token_ids, dtype=np.uint32),
                    behaviour_logprobs=np.asarray(s.logprobs, dtype=np.float32),
                    policy_version=min(v for _, v in spans),
                    version_spans=spans,
                    finish_reason=s.finish_reason,
                    response_text=s.text,
                    timings={"generate_s": s.seconds, "queued_s": started - msg.created_at},
                )
            )
        return wire.TrajectoryGroup(
            group_id=msg.prompt_id,
            prompt_id=msg.prompt_id,
            cycle=msg.cycle,
            index=msg.index,
            split=msg.split,
            prompt_token_ids=np.asarray(ids, dtype=np.uint32),
            prompt_text=msg.text or (msg.messages[-1]["content"] if msg.messages else ""),
            ground_truth=msg.ground_truth,
            metadata=msg.metadata,
            generator_id=self.sid,
            samples=trajectories,
        )

    # ------------------------------------------------------------------ the loop
    def _classify(self, in_flight: int) -> str:
        if self._updating:
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

    async def _keep_claims(self) -> None:
        """Reset the idle time of the prompts this generator still works on, every third of
        ``bus.claim_idle_s``: a live generator keeps its prompts however long it takes (the
        staleness gate, long responses), so only a dead one's are taken over by its peers.

        Only entries the group still lists as ours are touched, and only when idle for half a
        period at least: an entry a peer claimed a moment ago (idle ~0) is never taken back."""
        period_s = max(0.5, self.cfg.bus.claim_idle_s / 3)
        key = self.bus.key(streams.PROMPTS)
        while not self._stop.is_set():
            await asyncio.sleep(period_s)
            held = set(self._held)
            if held:
                try:
                    await asyncio.to_thread(self._touch, key, held, int(period_s * 500))
                except Exception as exc:  # best effort: the commit's dedupe covers a lost race
                    log.warning("could not refresh the claim on %d prompts: %s", len(held), exc)

    def _touch(self, key: str, held: set[str], min_idle_ms: int) -> None:
        r = self.bus.redis
        rows = self.bus.call(
            lambda: r.xpending_range(key, streams.GENERATORS, "-", "+", 10_000, self.sid),
            what="XPENDING",
        )
        ours = [row["message_id"] for row in rows if row["message_id"].decode() in held]
        if ours:
            self.bus.call(
                lambda: r.xclaim(key, streams.GENERATORS, self.sid, min_idle_ms, ours, justid=True),
                what="XCLAIM",
            )

    async def _join_until_done(self) -> None:
        """The first join: retried until it works or the service stops, as a rejoin is — the
        address in Redis can be a dead learner's until its restarted successor writes its own."""
        while not self._stop.is_set():
            try:
                await self._join_and_receive()
                return
            except Exception as exc:  # noqa: BLE001 - a dead or restarting learner: try again
                log.warning("joining the learner's weight sync failed (%s); retrying in 2 s", exc)
                await asyncio.sleep(2.0)
        raise asyncio.CancelledError

    async def run(self) -> None:
        await self._start_engine()
        await self._join_until_done()
        self.ready = True
        self.bus.ensure_group(streams.GROUPS, streams.SCORERS)  # back-pressure reads its backlog
        consumer = self.bus.consumer(streams.PROMPTS, streams.GENERATORS, self.sid)
        tasks: set[asyncio.Task] = set()
        helpers = [
            asyncio.create_task(c)
            for c in (self._watch_weights(), self._sample_phases(tasks), self._keep_claims())
        ]
        limit = self.cfg.generator.max_prompts_in_flight
        log.info("generator %s ready on version %s; taking prompts", self.sid, self.version)
        try:
            while not self._stop.is_set():
                for h in helpers:
                    if h.done() and not h.cancelled() and h.exception() is not None:
                        raise RuntimeError(f"generator background task failed: {h.exception()!r}")
                for t in [t for t in tasks if t.done()]:
                    tasks.discard(t)
                    if t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                room = limit - len(tasks)
                if room <= 0:
                    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    continue
                block = 50 if tasks else self.cfg.bus.block_ms
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

    def stop(self) -> None:
        self._stop.set()

    def status(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "tokens": self.tokens_generated,
            "groups": self.groups_published,
            "ready": self.ready,
        }
