"""The learner's settings for tests that build its parts without a model on disk."""

from __future__ import annotations

from typing import Any

from common.bus.settings import BusSettings
from common.service.settings import bus_settings_for, tracker_settings
from services.learner.main import training_settings
from services.learner.settings import LearnerSettings


def learner_settings_without_model(cfg: Any) -> Any:
    """``services.learner.main.learner_settings`` of ``cfg`` with no policy directory checked
    (no model is loaded) and, without a Redis URL in ``cfg``, a bus that is never reached, for
    tests of what the learner does around the model: its dispatch, its books, its bus side."""
    bus = bus_settings_for(cfg) if cfg.run.redis_url else BusSettings(url="redis://127.0.0.1:1/0")
    return LearnerSettings(
        run=cfg.run, weights=cfg.weights, bus=bus, trackers=tracker_settings(cfg),
        model_dir="(no model)", tokenizer_dir="(no tokenizer)", training=training_settings(cfg),
        generators=cfg.generator.replicas, shuffle=cfg.data.shuffle,
    )  # fmt: skip
