"""The generator's agent episodes (``[agent]``): for each prompt, ``responses_per_prompt``
episodes of your agent code (``code``), each talking to the generator's OpenAI-compatible
endpoint (``endpoint``) through a client scoped to its episode, recorded token in, token out
(``episodes``), and published as the prompt's group.

Consumes a prompt (its ids, messages, ground truth); produces its trajectories (one per segment
of each episode), each carrying the agent's reward, its answer for the scorer, or its error.
Waits for the agents (an episode ends when its code returns, raises or runs past
``agent.timeout_s``). Unblocked by the agent code's requests being answered by vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from common.chat.tool_calls import ToolFormat, ToolFormatError
from common.chat.tool_prompt import for_model
from common.chat.turns import end_of_turn_ids
from common.data.prompts import prompt_of
from common.protocol import wire
from services.generator.agent.code import AgentLoop, load_agent, reward_of
from services.generator.agent.endpoint import AgentEndpoint
from services.generator.agent.episodes import AgentEpisode, EpisodeTable
from services.generator.agent.gym import MaxRequestsReached
from services.generator.agent.openai_api import Sampling
from services.generator.agent.turns import AgentMetrics, AgentTurns, TurnLimits

if TYPE_CHECKING:
    from services.generator.settings import AgentSettings

log = logging.getLogger(__name__)
LOGGED_TRACEBACKS = 5  # agent errors logged with their traceback; later ones in one line


class AgentRunner:
    def __init__(
        self, *, settings: AgentSettings, engine: Any, tokenizer: Any, version: Callable[[], int],
        tool_format: Any, end_ids: set[int], agent: Any = None,
    ) -> None:  # fmt: skip
        a = settings.agent
        self.settings, self.timeout_s = settings, a.timeout_s
        self.metrics = AgentMetrics()
        self.table = EpisodeTable()
        self.turns = AgentTurns(
            engine=engine, tokenizer=tokenizer, tool_format=tool_format, end_ids=end_ids,
            limits=TurnLimits(
                max_requests=a.max_requests, max_tokens_per_request=a.max_tokens_per_request,
                max_response_tokens=settings.max_response_tokens,
                max_model_len=settings.max_prompt_tokens + settings.max_response_tokens,
                max_messages=a.max_messages,
            ),
            version=version, metrics=self.metrics,
        )  # fmt: skip
        self.endpoint = AgentEndpoint(table=self.table, turns=self.turns, port=a.port,
                                      max_request_bytes=a.max_request_bytes, metrics=self.metrics)  # fmt: skip
        self.agent = agent if agent is not None else load_agent(a)
        blocked = self.metrics.blocked
        self.loop = AgentLoop(on_blocked=lambda episode, where, seconds: blocked.inc())
        self.errors_logged = 0

    async def start(self) -> None:
        await self.endpoint.start()
        self.loop.start()

    async def close(self) -> None:
        for ep in list(self.table.open.values()):
            self.table.end(ep)
        self.loop.stop()
        await self.endpoint.close()

    # ------------------------------------------------------------------ one prompt
    async def run_prompt(
        self, msg: wire.PromptMsg, ids: list[int], sampling: Any, *, request_id: str,
        version: int, started: float,
    ) -> list[wire.Trajectory]:  # fmt: skip
        """The ``sampling.n`` episodes of ``msg`` (run concurrently), as its group's
        trajectories."""
        prompt = prompt_of(msg)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        how = Sampling(temperature=sampling.temperature, top_p=sampling.top_p,
                       top_k=sampling.top_k, stop=tuple(sampling.stop))  # fmt: skip
        out = await asyncio.gather(*(
            self._episode(msg, i, prompt, messages, ids, how, f"{request_id}/s{i}", version,
                          started)
            for i in range(sampling.n)
        ))  # fmt: skip
        return [t for trajectories in out for t in trajectories]

    async def _episode(
        self, msg: wire.PromptMsg, i: int, prompt: Any, messages: list[dict[str, Any]],
        ids: list[int], how: Sampling, request_prefix: str, version: int, started: float,
    ) -> list[wire.Trajectory]:  # fmt: skip
        ep = self.table.start(sampling=how, prompt_ids=ids, prompt_messages=messages,
                              request_prefix=request_prefix, version_at_start=version)  # fmt: skip
        task = {
            "prompt": prompt, "messages": [dict(m) for m in messages],
            "ground_truth": msg.ground_truth, "metadata": dict(msg.metadata), "split": msg.split,
            "prompt_id": msg.prompt_id, "sample_index": i, "episode_id": ep.episode_id,
            "base_url": self.endpoint.base_url(ep.episode_id), "api_key": self.endpoint.token,
        }  # fmt: skip
        t0 = time.monotonic()
        finish, error, reward, answer = await self._run_agent(ep, task)
        self.table.end(ep)
        if finish == "stop" and not ep.segments:
            finish, error = "agent_error", "the agent made no request to the endpoint"
        if finish == "stop":
            last = ep.segments[-1].last_finish
            if last == "tool_calls":  # its calls never answered: cut if out of requests
                last = "max_turns" if ep.turns >= self.settings.agent.max_requests else "stop"
            finish = ep.cut or last
        self.metrics.episodes.labels(finish).inc()
        text = answer if answer is not None else ep.last_text()
        return ep.trajectories(
            sample_id=f"{msg.prompt_id}/{i}", sample_index=i, finish=finish, final_text=text,
            agent_reward=reward, error=error,
            timings={"queued_s": started - msg.created_at, "agent_s": time.monotonic() - t0},
        )  # fmt: skip

    async def _run_agent(self, ep: AgentEpisode, task: dict[str, Any]):
        """(finish, error, reward components, answer) of one episode's agent code."""
        work = self.loop.submit(self._call(task))
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(work), self.timeout_s)
            reward, answer = reward_of(result)
            return "stop", "", reward, answer
        except MaxRequestsReached as cut:  # a gym environment not done in agent.max_requests
            return "max_turns", "", {"agent": cut.reward}, None
        except TimeoutError:
            work.cancel()
            why = f"the agent ran past agent.timeout_s = {self.timeout_s:g} s"
            log.warning("episode %s: %s", ep.episode_id, why)
            return "agent_timeout", why, None, None
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"[:1000]
            self.errors_logged += 1
            log.warning("episode %s: the agent failed: %s", ep.episode_id, why,
                        exc_info=self.errors_logged <= LOGGED_TRACEBACKS)  # fmt: skip
            return "agent_error", why, None, None

    async def _call(self, task: dict[str, Any]) -> Any:
        """Runs on the agents' loop: a client for this episode, then the agent."""
        import openai

        current = asyncio.current_task()
        if current is not None:  # the name the blocking-agent warning gives
            current.set_name(f"episode {task['episode_id']} (prompt {task['prompt_id']})")
        client = openai.AsyncOpenAI(base_url=task["base_url"], api_key=task["api_key"],
                                    max_retries=0, timeout=self.timeout_s)  # fmt: skip
        try:
            return await self.agent(client, task)
        finally:
            await client.close()


async def start_agents(settings: AgentSettings, *, engine: Any, tokenizer: Any,
                       version: Callable[[], int]) -> AgentRunner:  # fmt: skip
    """The runner of the agent ``settings`` names, its endpoint started. The tool-call format
    comes from the model's family (``generator.tool_format``); a model without one answers
    requests that offer tools with a 400."""
    model_dir = settings.model_dir
    fmt: ToolFormat | None
    try:
        tokenizer, fmt = for_model(tokenizer, model_dir=model_dir,
                                   format_setting=settings.tool_format, mode=settings.tool_prompt)  # fmt: skip
    except ToolFormatError as exc:
        log.warning("agent endpoint: no tool calls for this model (%s)", exc)
        fmt = None
    runner = AgentRunner(settings=settings, engine=engine, tokenizer=tokenizer, version=version,
                         tool_format=fmt, end_ids=end_of_turn_ids(tokenizer, model_dir))  # fmt: skip
    await runner.start()
    return runner
