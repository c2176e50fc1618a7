"""The generator's side of the weight broadcast (``common.weights``), run inside its vLLM engine
through the worker extension (``worker_ext.py``).

It joins the learner's weight group at start and receives the current version before the
generator takes a prompt. An update is applied in flight: the engine pauses (requests keep their
state), the worker receives and verifies every tensor, loads them, the version label advances,
the engine resumes; tokens sampled after it carry the new version. A failed update leaves the
previous complete version loaded and is counted; the follower rejoins and gets the next one, and
rejoins when the learner drops it or restarts elsewhere (a new address in Redis).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from common.config.shared import WeightsConfig
from common.protocol import streams
from common.telemetry.metrics import PhaseTimer

log = logging.getLogger(__name__)


class WeightFollower:
    """Keeps one engine on the learner's newest weights. ``version`` is the policy version the
    engine runs (None before the first), ``changed`` is set (and replaced) whenever it moves,
    ``updating`` is true while an update pauses the engine (since ``updating_since``)."""

    def __init__(
        self,
        engine: Any,
        *,
        settings: WeightsConfig,
        bus: Any,
        sid: str,
        timer: PhaseTimer,
        metrics: Any,
        stopped: asyncio.Event,
    ) -> None:
        self.engine, self.settings, self.bus, self.sid = engine, settings, bus, sid
        self.timer, self.metrics, self.stopped = timer, metrics, stopped
        self.version: int | None = None
        self.updating = False
        self.updating_since: float | None = None  # time.monotonic() of the update's start
        self.changed = asyncio.Event()
        self.joined_addr: str | None = None

    async def _address(self) -> tuple[str, int]:
        w = self.settings
        if w.port:
            return w.host, w.port
        with self.timer.phase("waiting_input"):
            while not self.stopped.is_set():
                addr = await asyncio.to_thread(self.bus.get, streams.WEIGHTS_ADDR)
                if addr:
                    host, _, port = addr.rpartition(":")
                    return host, int(port)
                await asyncio.sleep(0.5)
        raise asyncio.CancelledError

    async def join_and_receive(self) -> None:
        """(Re)join the weight group and receive the current weights before generating."""
        host, port = await self._address()
        self.joined_addr = f"{host}:{port}"
        timeout = self.settings.timeout_s
        res = await self.engine.collective_rpc("tether_join", args=(host, port, self.sid, timeout))
        log.info(
            "joined weight sync at %s:%d as %s (epoch %s)", host, port, self.sid, res[0]["epoch"]
        )
        if res[0]["behind"]:  # else the learner holds nothing newer: no update is coming
            await self.apply_update(wait_s=timeout)

    async def apply_update(self, *, wait_s: float | None = None) -> bool:
        """Pause, receive + verify + load a unit at a time, relabel, resume. Returns True when a
        new version loaded. An update that failed after part of it loaded (``mixed``) leaves
        the engine paused: it rejoins and takes the whole current version before it generates
        again (no token is sampled from two versions' weights)."""
        self.updating = True
        t0 = self.updating_since = time.monotonic()
        res: dict = {"ok": False, "error": "no answer", "mixed": False}
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
                    if not res.get("mixed"):
                        await self.engine.resume()
        finally:
            self.updating, self.updating_since = False, None
        if not res["ok"]:
            self.metrics.update_failures.inc()
            if res.get("mixed"):
                log.error("weight update failed part-way (%s): engine paused until the whole "
                          "current version loads", res["error"])  # fmt: skip
                self.version = None
                await self.join_until_done()  # its update resumes the engine once it loads
                return self.version is not None
            log.warning("weight update failed, still on version %s: %s", self.version, res["error"])
            return False
        self.version = int(res["version"])
        self.metrics.version.set(self.version)
        self.metrics.update_seconds.observe(time.monotonic() - t0)
        self.metrics.update_bytes.inc(res["bytes"])
        await asyncio.to_thread(self.bus.set, streams.generator_version(self.sid), self.version)
        log.info(
            "now on policy version %d (%s, %.2f MB in %.2f s)",
            self.version,
            "adapter" if res.get("adapter") else "weights",
            res["bytes"] / 1e6,
            time.monotonic() - t0,
        )
        self.changed.set()
        self.changed = asyncio.Event()
        return True

    async def watch(self) -> None:
        """Take updates as they come; rejoin when dropped.

        The learner announces a publish in Redis (``weights:publishing``) before it sends, so
        the cheap check is a GET here; the worker-side poll (an RPC into the engine core, which
        keeps vLLM's message queue busy) runs only when a newer version is announced, and every
        few seconds as a safety net (it also notices that the learner dropped us)."""
        last_rpc = 0.0
        while not self.stopped.is_set():
            await asyncio.sleep(0.2)
            announced, addr = await asyncio.to_thread(
                lambda: (
                    self.bus.get(streams.WEIGHTS_PUBLISHING),
                    self.bus.get(streams.WEIGHTS_ADDR),
                )
            )
            moved = (
                addr is not None and not self.settings.port and addr != (self.joined_addr or addr)
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
                    await self.join_and_receive()
                except Exception as exc:  # the learner may be restarting: try again later
                    log.warning("rejoin failed (%s); retrying", exc)
                    await asyncio.sleep(2.0)
            elif poll["pending"] is not None:
                await self.apply_update()
            elif newer:
                last_rpc = 0.0  # announced but not yet pending in the store: look again soon

    async def join_until_done(self) -> None:
        """The first join: retried until it works or the service stops, as a rejoin is — the
        address in Redis can be a dead learner's until its restarted successor writes its own."""
        while not self.stopped.is_set():
            try:
                await self.join_and_receive()
                return
            except Exception as exc:  # noqa: BLE001 - a dead or restarting learner: try again
                log.warning("joining the learner's weight sync failed (%s); retrying in 2 s", exc)
                await asyncio.sleep(2.0)
        raise asyncio.CancelledError
