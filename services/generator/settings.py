"""The generator's own settings: what its loop, its tool episodes and its agent runner read,
resolved once from the run's config by its main (``services.generator.main.generator_settings``),
so that below the main nothing receives the whole config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.bus.settings import BusSettings
from common.config.agent import AgentConfig
from common.config.shared import WeightsConfig
from common.engine import EngineSettings, SamplingSettings
from common.protocol import wire
from services.generator.agent.tool_loop import EpisodeSettings
from services.generator.seeds import request_seed

# the vLLM worker extension that takes weight updates in place (services/generator/worker_ext.py)
WORKER_EXT = "services.generator.worker_ext.TetherWorkerExtension"


@dataclass(frozen=True, kw_only=True)
class SamplingPlan:
    """How every prompt is sampled: the ``[generator]`` sampling settings, the run's group size
    and response length, and the run's seed that each request's own seed comes from."""

    run_seed: int
    responses_per_prompt: int
    max_response_tokens: int
    temperature: float
    top_p: float
    top_k: int  # 0 = off
    stop: tuple[str, ...]
    ignore_eos: bool
    eval_temperature: float

    def for_prompt(self, msg: wire.PromptMsg) -> SamplingSettings:
        """The prompt's sampling settings, with its own seed (``seeds.request_seed``): a training
        prompt's group, or one held-out answer at ``eval_temperature``."""
        seed = request_seed(run_seed=self.run_seed, split=msg.split, cycle=msg.cycle,
                            index=msg.index)  # fmt: skip
        if msg.split == "eval":
            return SamplingSettings(n=1, temperature=self.eval_temperature,
                                    max_tokens=self.max_response_tokens, stop=self.stop,
                                    seed=seed)  # fmt: skip
        return SamplingSettings(
            n=self.responses_per_prompt, temperature=self.temperature, top_p=self.top_p,
            top_k=max(self.top_k, 0), max_tokens=self.max_response_tokens, stop=self.stop,
            ignore_eos=self.ignore_eos, seed=seed,
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ToolLoopSettings:
    """The built-in tool loop (``generator.max_turns`` > 1): its tools and their sandbox, the
    model's tool-call format, and each episode's limits (``episode``: ``EpisodeSettings``)."""

    model_dir: str
    tools: tuple[str, ...]
    tool_format: str
    tool_prompt: str  # where the tool list goes: auto, template, system (common.chat.tool_prompt)
    workers: int
    timeout_s: float
    memory_mb: int
    isolation: Literal["auto", "namespaces", "rlimits"]
    run_dir: str  # the sandbox's scratch directories go under it, one per generator
    episode: EpisodeSettings


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """Your agent through the OpenAI-compatible endpoint (``[agent]``)."""

    agent: AgentConfig
    model_dir: str
    tool_format: str
    tool_prompt: str
    max_prompt_tokens: int
    max_response_tokens: int


@dataclass(frozen=True, kw_only=True)
class GeneratorSettings:
    bus: BusSettings
    engine: EngineSettings  # the policy's engine (its model directory checked on disk)
    tokenizer: str  # the tokenizer's directory
    liveness_s: float
    apply_chat_template: bool
    sampling: SamplingPlan
    weights: WeightsConfig
    max_prompts_in_flight: int
    tool_loop: ToolLoopSettings | None = None
    agent: AgentSettings | None = None
