"""Scale on paper: predict a run's cycle time and its bottleneck stage for a cluster shape, from
measured (or assumed) per-stage rates.

The model (one cycle = ``responses`` responses generated, scored, trained on, weights published):

- generate = responses × response_tokens / (generate_tokens_per_s × generators)
- score    = responses / (score_responses_per_s × scorers)
- train    = responses × (prompt_tokens + response_tokens) / (train_tokens_per_s × ranks × scaling)
             where scaling = learner_scaling_efficiency ** log2(ranks) (1 for one rank)
- sync     = the learner's publish to every generator (generators pause to load), over links of
             sync_bytes_per_s each: down a chain (``weights.fanout = "chain"``, the default) the
             learner sends the bytes once and each generator passes each piece of
             ``weights.chunk_mb`` on, so (param_bytes + (generators - 1) × chunk_bytes) / rate;
             pairwise, the learner sends them once per generator: generators × param_bytes / rate.
             Measured (`tether bench weights`, 200 MB over loopback, bench/README.md): the
             learner's bytes per publish are 1.00× for 1, 2 and 4 generators down a chain and
             1×, 2×, 4× pairwise; gloo's own broadcast is a binomial tree that sends
             ceil(log2(N + 1)) copies from its root (1×, 2×, 3×).

Redis memory (``held_memory``): the learner acknowledges a cycle's scored groups only once a
checkpoint holds their training, so Redis keeps them until then: about ``BYTES_PER_RESPONSE_TOKEN``
bytes per response token (its id, its behaviour log-prob and its text, msgpack-encoded: 12.2-12.4
measured with 4 characters of text per token, groups of 4-8 responses of 3k tokens) plus
``BYTES_PER_PROMPT_TOKEN`` per prompt token, for every cycle trained since the last checkpoint and
the one being collected. ``learner.checkpoint_every_minutes`` / ``checkpoint_every_steps`` bound
it; with neither it grows with the run.

Synchronous (``max_staleness < train_steps_per_cycle``: cycle c+1 waits for cycle c's weights):
``cycle = generate + score + train + sync``. Asynchronous (at least one cycle of overlap): a
perfect pipeline, ``cycle = max(generate + sync, score, train + sync)`` — each stage on its own
hardware. Shared hardware (a 2-core CPU running every service) breaks that assumption; the
benchmark compares the prediction with what it measures.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common.config.rules import default_max_staleness
from common.config.shared import CHUNK_MB
import json


@dataclass(frozen=True, kw_only=True)
class StageRates:
    generate_tokens_per_s: float  # response tokens per second, one generator replica, full batch
    score_responses_per_s: float  # responses graded per second, one scorer replica
    train_tokens_per_s: float  # prompt + response tokens through forward/backward/step, one rank
    sync_bytes_per_s: float  # weight broadcast, learner to every generator

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if not v > 0:
                raise ValueError(
                    f"StageRates.{k} = {v}: rates must be positive (measure them with `tether bench pipeline`)"
                )


@dataclass(frozen=True, kw_only=True)
class ClusterShape:
    generators: int = 1
    scorers: int = 1
    learner_ranks: int = 1
    learner_scaling_efficiency: float = 0.9  # throughput kept per doubling of learner ranks
    weights_fanout: str = "chain"  # weights.fanout: "chain" (one copy out) or "pairwise" (N)
    chunk_bytes: int = int(CHUNK_MB * 2**20)  # weights.chunk_mb: the piece a chain passes on

    def __post_init__(self) -> None:
        if min(self.generators, self.scorers, self.learner_ranks) < 1:
            raise ValueError(f"ClusterShape {self}: every count must be >= 1")
        if self.weights_fanout not in ("chain", "pairwise"):
            raise ValueError(
                f"ClusterShape.weights_fanout = {self.weights_fanout!r}: 'chain' or 'pairwise'"
            )
        if not 0 < self.learner_scaling_efficiency <= 1:
            raise ValueError("ClusterShape.learner_scaling_efficiency must be in (0, 1]")


def plan(
    *,
    rates: StageRates,
    shape: ClusterShape,
    responses_per_cycle: int,
    prompt_tokens: int,
    response_tokens: int,
    param_bytes: int,
    train_steps_per_cycle: int = 1,
    max_staleness: int | None = None,
) -> dict[str, Any]:
    """Predicted seconds per stage and per cycle, the bottleneck, and responses/s."""
    if (
        min(responses_per_cycle, response_tokens, train_steps_per_cycle) < 1
        or prompt_tokens < 0
        or param_bytes < 0
    ):
        raise ValueError(
            "responses_per_cycle, response_tokens and train_steps_per_cycle must be >= 1; prompt_tokens and param_bytes >= 0"
        )
    staleness = (
        default_max_staleness(train_steps_per_cycle) if max_staleness is None else max_staleness
    )
    scaling = shape.learner_scaling_efficiency ** math.log2(shape.learner_ranks)
    stages = {
        "generate": responses_per_cycle
        * response_tokens
        / (rates.generate_tokens_per_s * shape.generators),
        "score": responses_per_cycle / (rates.score_responses_per_s * shape.scorers),
        "train": responses_per_cycle
        * (prompt_tokens + response_tokens)
        / (rates.train_tokens_per_s * shape.learner_ranks * scaling),
        "sync": sync_seconds(param_bytes, shape) / rates.sync_bytes_per_s,
    }
    overlapped = staleness >= train_steps_per_cycle
    lanes = {
        "generate": stages["generate"] + stages["sync"],
        "score": stages["score"],
        "train": stages["train"] + stages["sync"],
    }
    if overlapped:
        bottleneck = max(lanes, key=lambda k: lanes[k])
        cycle = lanes[bottleneck]
    else:
        bottleneck = max(stages, key=lambda k: stages[k])
        cycle = sum(stages.values())
    return {
        "mode": "async" if overlapped else "sync",
        "max_staleness": staleness,
        "stage_seconds": stages,
        "cycle_seconds": cycle,
        "bottleneck": bottleneck,
        "responses_per_s": responses_per_cycle / cycle,
        "speedup_over_sync": sum(stages.values()) / cycle,
    }


BYTES_PER_RESPONSE_TOKEN = 12.5
BYTES_PER_PROMPT_TOKEN = 8.0


def held_memory(
    *,
    cycle_seconds: float,
    responses_per_cycle: int,
    prompts_per_cycle: int,
    prompt_tokens: int,
    response_tokens: int,
    train_steps_per_cycle: int = 1,
    checkpoint_every_minutes: float = 30.0,
    checkpoint_every_steps: int = 0,
) -> dict[str, Any]:
    """Bytes of scored groups Redis holds for the learner until a checkpoint covers them: per
    cycle, the cycles between two checkpoints (None: only at the end, so it grows with the run)
    and the peak (those cycles and the one being collected)."""
    per_cycle = (
        responses_per_cycle * response_tokens * BYTES_PER_RESPONSE_TOKEN
        + prompts_per_cycle * prompt_tokens * BYTES_PER_PROMPT_TOKEN
    )
    bounds = []
    if checkpoint_every_minutes > 0:
        bounds.append(math.ceil(checkpoint_every_minutes * 60 / cycle_seconds))
    if checkpoint_every_steps > 0:
        bounds.append(math.ceil(checkpoint_every_steps / train_steps_per_cycle))
    cycles = min(bounds) if bounds else None
    return {
        "bytes_per_cycle": per_cycle,
        "cycles_between_checkpoints": cycles,
        "peak_bytes": None if cycles is None else (cycles + 1) * per_cycle,
    }


def sync_seconds(param_bytes: int, shape: ClusterShape) -> float:
    """Bytes on the slowest path of one publish, in units of one link's rate (see the module
    docstring): the learner's NIC pairwise, the chain's length in pieces down a chain."""
    n = shape.generators
    if shape.weights_fanout == "pairwise":
        return float(n * param_bytes)
    return float(param_bytes + (n - 1) * min(shape.chunk_bytes, param_bytes))


def rates_from_pipeline(result: dict[str, Any], *, prompt_tokens: int) -> StageRates:
    """Per-stage rates from a ``tether bench pipeline`` result's sync run, where the stages run one
    after another (each stage's busy time is its own, not shared with another stage's)."""
    w, s = result["workload"], result["sync"]
    busy = s["busy_seconds_per_cycle"]
    missing = {"generator", "scorer", "learner"} - set(busy)
    if missing:
        raise ValueError(
            f"pipeline result has no busy seconds for {sorted(missing)}; re-run `tether bench pipeline`"
        )
    n = w["responses_per_step"]
    cycles = s.get("timed_cycles") or 1
    learner = next(
        (v for k, v in s.get("phase_seconds_timed", {}).items() if k.startswith("learner:")), None
    )
    if learner and learner.get("syncing_weights"):
        # everything the learner does besides publishing is the train stage (batching, log-probs, steps)
        train_s = learner.get("working", 0.0) / cycles
        sync_s = learner["syncing_weights"] / cycles
    else:
        train_s = s["learner_train_step_seconds"]
        sync_s = max(busy["learner"] - train_s, 1e-3)  # the learner's other busy time: publishing
    return StageRates(
        generate_tokens_per_s=n * w["response_tokens"] / busy["generator"],
        score_responses_per_s=n / busy["scorer"],
        train_tokens_per_s=n * (prompt_tokens + w["response_tokens"]) / train_s,
        sync_bytes_per_s=4 * w["params"] / sync_s,
    )


# Rates for Qwen2.5-3B on one H100 per role, bf16. Generation, scoring and the weight broadcast
# are assumed (no CUDA vLLM or second GPU was available to measure them): vLLM decode of ~120
# concurrent sequences of a 3B model ≈ 6 k tokens/s; the solver scorer (seed 001) batched on one
# GPU ≈ 5 responses/s (≈ 2 k-token prompt, ≈ 1 k-token answer); NCCL publish ≈ 10 GB/s. Training
# was guessed at ≈ 40 % MFU ≈ 16.5 k tokens/s per rank; `gpu_rates` replaces it with the learner
# service's rate measured on an H100 when bench/results/gpu/learner3b.json is there.
GPU_ASSUMED = {
    "generate_tokens_per_s": 6000.0,
    "score_responses_per_s": 5.0,
    "train_tokens_per_s": 16500.0,
    "sync_bytes_per_s": 10e9,
}


def gpu_rates(results_dir: Path | None = None) -> tuple[dict[str, float], bool]:
    """The GPU rates above, with the train rate measured on an H100 (``gpu/learner3b.json`` under
    ``results_dir``, default the repository's bench/results) when that result exists. Returns the
    rates and whether the train rate was measured."""
    rates = dict(GPU_ASSUMED)
    root = (
        Path(results_dir)
        if results_dir
        else Path(__file__).resolve().parents[2] / "bench" / "results"
    )
    try:
        big = json.loads((root / "gpu" / "learner3b.json").read_text())
    except (OSError, ValueError):
        return rates, False
    if big.get("ok", True) and big.get("settings", {}).get("hidden") == 2048:
        rates["train_tokens_per_s"] = float(big["service_train_tokens_per_s"])
        return rates, True
    return rates, False


def best_split(
    *, total_gpus: int, rates: StageRates, scorers: int = 1, scaling: float = 0.9, **work: Any
) -> list[dict[str, Any]]:
    """Every generator:learner split of ``total_gpus`` (at least one of each), fastest async cycle
    first; ``work`` is ``plan``'s workload keywords."""
    if total_gpus < 2:
        raise ValueError("total_gpus must be >= 2: one generator and one learner rank at least")
    out = []
    for gens in range(1, total_gpus):
        shape = ClusterShape(generators=gens, scorers=scorers, learner_ranks=total_gpus - gens,
                             learner_scaling_efficiency=scaling)  # fmt: skip
        out.append({"generators": gens, "learner_ranks": total_gpus - gens,
                    **plan(rates=rates, shape=shape, **work)})  # fmt: skip
    return sorted(out, key=lambda p: p["cycle_seconds"])
