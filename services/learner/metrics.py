"""The learner's Prometheus series (rank 0 exports them): versions, steps, trained / dropped / filtered / lost counts,
staleness, held-out accuracy, stream housekeeping and the step's time split."""

from __future__ import annotations

from common.protocol import streams
from common.telemetry.metrics import metric


class LearnerMetrics:
    """Created where they are set (the bus side, publishing, the step log): ``metric`` returns the
    one series of each name, so every instance sets the same series."""

    def __init__(self) -> None:
        self.version = metric(
            "Gauge", "tether_learner_policy_version", "policy version (optimizer steps done)"
        )
        self.steps = metric("Counter", "tether_learner_steps_total", "optimizer steps")
        self.generators_configured = metric(
            "Gauge",
            "tether_learner_generators_configured",
            "generator.replicas: the generators this run expects (the TetherGeneratorsMissing alert)",
        )
        self.step = metric(
            "Gauge", "tether_learner_step_value", "per-step training figures", ["name"]
        )
        self.trained = metric(
            "Counter", "tether_learner_trained_samples_total", "responses trained on"
        )
        self.dropped = metric(
            "Counter", "tether_learner_dropped_stale_total", "responses dropped for staleness"
        )
        self.lost = metric(
            "Counter",
            "tether_learner_lost_groups_total",
            "a cycle's groups that never came (their prompt or group was dead-lettered); the cycle "
            "trained without them",
        )
        self.duplicates = metric(
            "Counter",
            "tether_learner_duplicate_groups_total",
            "scored groups received again after training (acked, not trained)",
        )
        self.filtered = metric(
            "Counter",
            "tether_learner_filtered_samples_total",
            "responses of equal-reward groups left out of training (no signal)",
        )
        self.overlong = metric(
            "Counter",
            "tether_learner_overlong_masked_samples_total",
            "responses cut off at max_response_tokens and masked from the loss",
        )
        self.filter_rate = metric(
            "Gauge",
            "tether_learner_dynamic_sampling_filter_rate",
            "smoothed share of equal-reward groups that steers dynamic sampling's extra prompts",
        )
        self.staleness = metric(
            "Histogram",
            "tether_learner_staleness_steps",
            "optimizer steps between a trajectory's policy and the learner's",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32),
        )
        self.trimmed = metric(
            "Counter",
            "tether_learner_stream_trimmed_entries_total",
            "stream entries trimmed after every consumer group acknowledged them",
            ["stream"],
            initial=(streams.PROMPTS, streams.GROUPS, streams.SCORED),
        )
        self.eval_accuracy = metric(
            "Gauge",
            "tether_learner_eval_accuracy",
            "held-out accuracy of the last finished evaluation",
        )
        self.step_seconds = metric(
            "Counter",
            "tether_learner_step_seconds_total",
            "seconds per part of the optimizer step",
            ["part"],
            initial=("forward_backward", "optimizer"),
        )
        self.tokens = metric("Counter", "tether_learner_tokens_total", "response tokens trained on")
        self.last_step_time = metric(
            "Gauge",
            "tether_learner_last_step_timestamp_seconds",
            "unix time of the last optimizer step",
        )
