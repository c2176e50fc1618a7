"""The generator's OpenAI-compatible endpoint for agents' episodes, on the generator's own
asyncio loop (aiohttp, which vLLM already brings).

Routes, per episode (``base_url`` = ``http://127.0.0.1:<port>/tether/<episode id>/v1``):
``POST …/chat/completions``, ``POST …/completions`` (non-streaming), ``GET …/models``.

Safety, in the order a request meets it:

- it listens on 127.0.0.1 only: the agent code runs inside the generator's process;
- ``Authorization: Bearer <token>``: a token made at random when the generator starts (the
  ``openai`` client Tether hands the agent carries it); otherwise 401;
- a body over ``agent.max_request_bytes`` gets 413 (from its ``Content-Length``, or while it is
  read); a body that is not JSON, or not a request this endpoint offers, 400 (``openai_api``);
- an unknown episode gets 404, one that has ended 409 (nothing is recorded into a published
  trajectory);
- a client that disconnects cancels its request: vLLM aborts it and nothing is recorded, so the
  episode is as it was before the request (handler cancellation);
- whatever goes wrong inside one request is answered 500 for that request alone: no other
  episode, and not the generator, is touched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from typing import Any

from aiohttp import web

from services.generator.agent.episodes import EpisodeTable
from services.generator.agent.openai_api import ApiError
from services.generator.agent.turns import AgentMetrics, AgentTurns, answered

log = logging.getLogger(__name__)
HOST = "127.0.0.1"
OUTCOMES = {400: "bad_request", 401: "unauthorized", 404: "unknown_episode",
            409: "finished_episode", 413: "too_large"}  # fmt: skip


class AgentEndpoint:
    def __init__(
        self, *, table: EpisodeTable, turns: AgentTurns, port: int, max_request_bytes: int,
        metrics: AgentMetrics, token: str | None = None,
    ) -> None:  # fmt: skip
        self.table, self.turns, self.metrics = table, turns, metrics
        self.max_bytes = max_request_bytes
        self.token = token or secrets.token_urlsafe(32)
        self._port_wanted = port
        self.port = 0
        self._runner: Any = None

    def base_url(self, episode_id: str) -> str:
        return f"http://{HOST}:{self.port}/tether/{episode_id}/v1"

    async def start(self) -> None:
        # client_max_size bounds what aiohttp reads; the body is read here, so over-size
        # requests are answered in OpenAI's error shape
        app = web.Application(client_max_size=self.max_bytes)
        app.router.add_post("/tether/{episode}/v1/chat/completions", self._chat)
        app.router.add_post("/tether/{episode}/v1/completions", self._completion)
        app.router.add_get("/tether/{episode}/v1/models", self._models)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, self._port_wanted, reuse_address=True)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        log.info("agent endpoint on http://%s:%d/tether/<episode>/v1", HOST, self.port)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ handlers
    async def _chat(self, request: Any) -> Any:
        return await self._answer(request, self.turns.chat)

    async def _completion(self, request: Any) -> Any:
        return await self._answer(request, self.turns.complete)

    async def _models(self, request: Any) -> Any:
        try:
            self._authorize(request)
            self.table.get(request.match_info["episode"])
        except ApiError as err:
            return self._error(err)
        return web.json_response({"object": "list", "data": [
            {"id": "tether-policy", "object": "model", "owned_by": "tether"}]})  # fmt: skip

    async def _answer(self, request: Any, turn: Any) -> Any:
        try:
            self._authorize(request)
            ep = self.table.get(request.match_info["episode"])
            body = await self._body(request)
            try:
                reply = await answered(ep, turn(ep, body))
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    self.metrics.requests.labels("cancelled").inc()
                    raise  # the client went away: vLLM aborts, nothing was recorded
                raise ApiError(409, f"episode {ep.episode_id} ended during this request",
                               code="episode_finished") from None  # fmt: skip
        except ApiError as err:
            return self._error(err)
        except Exception as exc:  # this request alone fails; the generator goes on
            log.exception("agent endpoint: a request failed")
            self.metrics.requests.labels("error").inc()
            return web.json_response(ApiError(500, f"internal error: {exc!r}"[:300],
                                              code="internal").body(), status=500)  # fmt: skip
        self.metrics.requests.labels("ok").inc()
        return web.json_response(reply)

    def _authorize(self, request: Any) -> None:
        given = request.headers.get("Authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            raise ApiError(401, "missing or wrong token: use the client Tether handed to your "
                           "agent (its api_key is this run's token)", code="unauthorized")  # fmt: skip

    async def _body(self, request: Any) -> Any:
        if request.content_length is not None and request.content_length > self.max_bytes:
            raise _too_large(request.content_length, self.max_bytes)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(None, self.max_bytes) from None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise ApiError(400, f"the body is not JSON: {exc}"[:300], code="invalid_json") from None

    def _error(self, err: ApiError) -> Any:
        self.metrics.requests.labels(OUTCOMES.get(err.status, "error")).inc()
        return web.json_response(err.body(), status=err.status)


def _too_large(size: int | None, cap: int) -> ApiError:
    got = f"{size} bytes" if size is not None else "more"
    return ApiError(413, f"the body is {got}; this run accepts at most {cap} bytes "
                    "(agent.max_request_bytes)", code="request_too_large")  # fmt: skip
