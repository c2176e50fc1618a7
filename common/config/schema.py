"""Tether's one typed configuration schema.

Sections: ``[run]`` (shared: model, namespace, the cycle knobs, staleness, lengths), ``[data]``,
``[generator]``, ``[scorer]``, ``[learner]``, ``[bus]``, ``[weights]``, ``[agent]``. Every field says its unit.
The sections are defined beside this module (``shared``: run, data, bus, weights; one module per
service: ``generator``, ``scorer``, ``learner``); the cross-field rules are in ``rules``; sources
and their precedence (lowest first) in ``load``.

The cycle vocabulary (seed 000) and its invariant::

    prompts_per_cycle × responses_per_prompt × passes_per_cycle
        = train_batch_size × train_steps_per_cycle

"responses generated per cycle (times the passes over them) = responses consumed per cycle".
One of ``train_batch_size`` / ``train_steps_per_cycle`` may be omitted and is derived.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from common.config.agent import AgentConfig
from common.config.errors import ConfigError
from common.config.generator import GeneratorConfig
from common.config.learner import LearnerConfig
from common.config.rules import apply_cycle_rules
from common.config.scorer import ScorerConfig
from common.config.shared import BusConfig, DataConfig, RunConfig, Section, WeightsConfig

__all__ = [
    "CYCLE_KEYS", "DEPRECATED_ALIASES", "RENAMED_KEYS", "SECTIONS", "ConfigError", "TetherConfig",
]  # fmt: skip

CYCLE_KEYS = (
    "prompts_per_cycle",
    "responses_per_prompt",
    "train_batch_size",
    "train_steps_per_cycle",
    "num_cycles",
    "passes_per_cycle",
    "max_staleness",
)

# slime's old names (seed 000), kept as deprecated aliases: old -> new.
DEPRECATED_ALIASES = {
    "rollout_batch_size": "prompts_per_cycle",
    "n_samples_per_prompt": "responses_per_prompt",
    "global_batch_size": "train_batch_size",
    "num_steps_per_rollout": "train_steps_per_cycle",
    "num_rollout": "num_cycles",
}

# Tether's own settings that were renamed: "section.old" -> ("section.new", why). Unlike slime's
# aliases, the old name is refused, not read: a file that still says it gets one paragraph naming
# the new key, so nobody keeps a setting whose name says something else.
RENAMED_KEYS = {
    "agent.max_turns": (
        "agent.max_requests",
        "it counts the requests one agent's episode may send the endpoint, and shared its name "
        "with generator.max_turns, the built-in tool loop's assistant turns per episode",
    ),
}

SECTIONS: dict[str, type[Section]] = {
    "run": RunConfig,
    "data": DataConfig,
    "generator": GeneratorConfig,
    "scorer": ScorerConfig,
    "learner": LearnerConfig,
    "bus": BusConfig,
    "weights": WeightsConfig,
    "agent": AgentConfig,
}


class TetherConfig(BaseModel):
    """The whole run. Cross-field rules run at load time; derived values are filled in."""

    model_config = ConfigDict(extra="forbid")

    run: RunConfig = Field(default_factory=RunConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    scorer: ScorerConfig = Field(default_factory=ScorerConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    bus: BusConfig = Field(default_factory=BusConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)

    _derived: set[str] = PrivateAttr(default_factory=set)

    @model_validator(mode="after")
    def _cross_field(self) -> TetherConfig:
        self._derived = apply_cycle_rules(self)
        return self

    # ---- derived views -------------------------------------------------------------------
    @property
    def derived(self) -> set[str]:
        """Dotted names of settings Tether derived instead of the user giving them."""
        return set(self._derived)

    @property
    def dp_world_size(self) -> int:
        return self.learner.nnodes * self.learner.nproc_per_node

    @property
    def responses_per_cycle(self) -> int:
        return self.run.prompts_per_cycle * self.run.responses_per_prompt

    @property
    def responses_per_rank_per_step(self) -> int:
        return self.run.train_batch_size // self.dp_world_size

    @property
    def grad_accumulation_steps(self) -> int | None:
        """Micro-batches per rank per optimizer step in count mode; None in token-budget mode."""
        if self.learner.micro_batch_size is None:
            return None
        return self.responses_per_rank_per_step // self.learner.micro_batch_size

    @property
    def behaviour_temperature(self) -> float:
        """The temperature the generators' behaviour log-probs are taken at, which the learner's
        own log-probs must use too (greedy sampling scores at T = 1)."""
        return self.generator.temperature if self.generator.temperature > 0 else 1.0

    def to_dict(self) -> dict[str, dict]:
        return {name: getattr(self, name).model_dump() for name in SECTIONS}
