"""Agents and a gym-style environment for the agent tests, importable by name
(``agent.run = "tests.agents_for_tests:..."``), written as a user writes them: against an
ordinary ``openai.AsyncOpenAI`` client."""

from __future__ import annotations

import asyncio
import time
from typing import Any

SEED = 1234


async def one_turn(client: Any, task: dict[str, Any]) -> float:
    """One chat request with a fixed seed; reward 1."""
    await client.chat.completions.create(model="policy", messages=task["messages"], seed=SEED,
                                         max_tokens=16)  # fmt: skip
    return 1.0


async def behaves_by_index(client: Any, task: dict[str, Any]) -> Any:
    """Sample k does thing k: what each episode of one prompt does to its generator."""
    k = task["sample_index"]
    reply = await client.chat.completions.create(model="p", messages=task["messages"],
                                                 max_tokens=8)  # fmt: skip
    if k == 0:
        return {"correct": 1.0, "brevity": 0.25}
    if k == 1:
        raise ValueError("the agent's own bug")
    if k == 2:
        await asyncio.sleep(60)  # past agent.timeout_s
    if k == 3:
        time.sleep(4)  # blocks the agents' loop (within agent.timeout_s), never the generator's
        return 0.5
    if k == 4:
        return "not a reward"
    if k == 5:
        return {"answer": "\\boxed{7}"}
    return None if reply else 0.0


async def blocks_past_timeout(client: Any, task: dict[str, Any]) -> float:
    """One request, then a blocking call longer than the test's agent.timeout_s."""
    await client.chat.completions.create(model="p", messages=task["messages"], max_tokens=8)
    time.sleep(3)
    return 0.5


async def no_request(client: Any, task: dict[str, Any]) -> float:
    return 1.0


class CountingEnv:
    """A gym-style environment: the model must say anything twice; reward 0.5 per step."""

    made = 0
    max_tokens = 16  # per reply: two replies and the env's turns fit the episode's budget

    def __init__(self) -> None:
        CountingEnv.made += 1
        self.steps = 0

    def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "system", "content": "Count."}, *task["messages"]]

    def step(self, message: dict[str, Any]) -> tuple[list[dict[str, Any]], float, bool]:
        assert message["role"] == "assistant"
        self.steps += 1
        return [{"role": "user", "content": f"step {self.steps} done"}], 0.5, self.steps == 2


class EndlessEnv(CountingEnv):
    def step(self, message: dict[str, Any]) -> tuple[list[dict[str, Any]], float, bool]:
        return [{"role": "user", "content": "again"}], 0.25, False
