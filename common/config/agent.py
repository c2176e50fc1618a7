"""``[agent]``: your own agent code, run by the generators against their OpenAI-compatible
endpoint (README "Bring your own agent").

At most one of ``run`` and ``gym_env`` names the agent; with none, the
generator samples itself (single-turn, or the built-in tool loop of ``generator.max_turns``).
The endpoint listens on 127.0.0.1 only (the agent code runs inside the generator's process),
on ``port``, and answers only requests that carry the run's token and an open episode's id."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from common.config.errors import ConfigError
from common.config.shared import DERIVED, Section

if TYPE_CHECKING:
    from common.config.rules import TetherConfig


class AgentConfig(Section):
    run: str = Field(
        "",
        description="your agent: package.module:function or path/file.py:function, an `async def "
        "run(client, task)` returning a reward (float), reward components (dict of floats), "
        '{"answer": text} or None (the scorer grades the answer, or the last reply); or a class '
        "with that method (made once per generator, no arguments). `client` is an "
        "openai.AsyncOpenAI pointed at the endpoint for this episode",
    )
    gym_env: str = Field(
        "",
        description="a gym-style environment instead: package.module:Class (or a factory), made "
        "once per episode with no arguments; reset(task) -> messages and step(message) -> "
        "(messages, reward, done), plain or async; Tether's own agent loop drives it through the "
        "endpoint",
    )
    timeout_s: float = Field(
        300.0,
        gt=0.0,
        description="seconds one episode's agent code may run (its requests included); past it "
        "the episode ends as agent_timeout: recorded, counted, not trained",
    )
    max_requests: int = Field(
        16,
        ge=1,
        description="requests (assistant turns) one episode may send the endpoint; the next one "
        "gets a 400 and the episode ends as max_turns. Not generator.max_turns, the built-in "
        "tool loop's turns",
    )
    port: int = Field(
        0, ge=0, le=65535, description="the endpoint's port on 127.0.0.1; 0 = a free one"
    )
    max_request_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="largest request body in bytes (413 beyond)"
    )
    max_messages: int = Field(512, ge=1, description="messages in one chat request (400 beyond)")
    max_tokens_per_request: int = Field(
        DERIVED,
        ge=1,
        description="largest max_tokens a request may ask (400 beyond); derived: "
        "run.max_response_tokens. A request is also bounded by what is left of its episode's "
        "run.max_response_tokens",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.run or self.gym_env)


def agent_rules(cfg: TetherConfig, derived: set[str]) -> None:
    """``[agent]``'s cross-field rules: one agent at most; the built-in tool loop off when an
    agent runs the episodes; ``max_tokens_per_request`` derived from and bounded by
    ``run.max_response_tokens``."""
    a, g, run = cfg.agent, cfg.generator, cfg.run
    if a.max_tokens_per_request is None:
        a.max_tokens_per_request = run.max_response_tokens
        derived.add("agent.max_tokens_per_request")
    elif a.max_tokens_per_request > run.max_response_tokens:
        raise ConfigError(
            f"agent.max_tokens_per_request = {a.max_tokens_per_request} exceeds "
            f"run.max_response_tokens = {run.max_response_tokens}, the most an episode may "
            "generate. Fix: lower it, raise run.max_response_tokens, or leave it out."
        )
    named = [k for k in ("run", "gym_env") if getattr(a, k)]
    if len(named) > 1:
        raise ConfigError(
            f"agent.{' and agent.'.join(named)} are both set: an episode runs one agent. Fix: keep "
            "one of them."
        )
    if named and (g.max_turns > 1 or g.tools):
        raise ConfigError(
            f"agent.{named[0]} runs the episodes, and generator.max_turns = {g.max_turns} / "
            f"generator.tools = {g.tools} configure the built-in tool loop, which then does not "
            "run. Fix: leave generator.max_turns = 1 and generator.tools empty (your agent calls "
            "its own tools), or remove the agent setting."
        )
