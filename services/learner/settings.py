"""The learner's own settings: what its loop, its bus side, its dispatcher, its objective and its
publishing read, resolved once from the run's config by its main
(``services.learner.main.learner_settings``), so that below the main nothing receives the whole
config. The ``[run]``, ``[learner]`` and ``[weights]`` sections go in whole (the learner reads
most of their fields); from the other sections only the values the learner uses."""

from __future__ import annotations

from dataclasses import dataclass

from common.bus.settings import BusSettings
from common.config.learner import LearnerConfig
from common.config.shared import RunConfig, WeightsConfig
from common.telemetry.trackers import TrackerSettings


@dataclass(frozen=True, kw_only=True)
class LearnerSettings:
    run: RunConfig  # cycles, batch shape, staleness, seed, the run's name
    weights: WeightsConfig  # the weight store's address, backend, buckets, deadline, dtype
    bus: BusSettings
    trackers: TrackerSettings
    model_dir: str  # the policy's directory, checked on disk
    tokenizer_dir: str
    training: TrainingSettings  # what a cycle's math reads
    generators: int  # generator.replicas: the generators the run expects (an alert's threshold)
    shuffle: bool  # data.shuffle: the train prompts in a new order every epoch

    @property
    def learner(self) -> LearnerConfig:
        return self.training.learner


@dataclass(frozen=True, kw_only=True)
class TrainingSettings:
    """What a cycle's math reads (the recompute passes, the objective): the ``[learner]``
    section, how a cycle's data is trained, and the behaviour log-probs' temperature."""

    learner: LearnerConfig
    train_steps_per_cycle: int
    passes_per_cycle: int
    # the temperature the generators' behaviour log-probs are taken at (greedy scores at T = 1)
    behaviour_temperature: float
