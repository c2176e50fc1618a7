"""The staleness study's figures (``bench.staleness``): one run's summary from its
``metrics.jsonl`` records, and one configuration's aggregate over its seeds. Staleness
histograms are lists indexed by optimizer steps behind, holding numbers of responses."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.staleness import Arm


def pool_counts(histograms: Iterable[list[int]]) -> list[int]:
    """Sum histograms (index = staleness in optimizer steps, value = responses)."""
    out: list[int] = []
    for h in histograms:
        out += [0] * (len(h) - len(out))
        for k, n in enumerate(h):
            out[k] += n
    return out


def histogram_mean(counts: list[int]) -> float:
    return sum(k * n for k, n in enumerate(counts)) / max(1, sum(counts))


def summarize_run(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures from its ``metrics.jsonl`` records (kind step / eval)."""
    steps = sorted((r for r in rows if r["kind"] == "step"), key=lambda r: r["step"])
    evals = sorted((r for r in rows if r["kind"] == "eval"), key=lambda r: r["eval_round"])
    if not steps or not evals:
        raise ValueError("the run recorded no optimizer step or no held-out evaluation")
    # older step records carry only each step's largest staleness: counted once
    counts = pool_counts(r.get("staleness_counts") or [0] * r["staleness_max"] + [1] for r in steps)

    def mean_of(key: str) -> float:
        vals = [r[key] for r in steps if r.get(key) is not None and r[key] == r[key]]
        return sum(vals) / len(vals) if vals else 0.0

    return {
        "final_accuracy": evals[-1]["accuracy"],
        # [policy version that answered (mean of the versions the record lists), accuracy]
        "accuracy_curve": [
            [statistics.fmean(e.get("policy_versions") or [e["eval_round"]]), e["accuracy"]]
            for e in evals
        ],
        "reward_curve": [r["reward_mean"] for r in steps],
        "staleness_counts": counts,
        "staleness_mean": histogram_mean(counts),
        "staleness_max": len(counts) - 1,
        "clipped_frac": mean_of("clip_frac_low") + mean_of("clip_frac_high"),
        "is_capped_frac": mean_of("is_over_cap_frac"),
        "dropped_stale": sum(r.get("dropped_stale", 0) for r in steps),
        # RL time: from the end of the v0 evaluation (the generator's first work, once it is up)
        # to the last optimizer step; the run's wall time adds start-up and the last evaluation
        "rl_seconds": steps[-1]["time"] - evals[0]["time"],
    }


# ---------------------------------------------------------------------------- over seeds
def _mean_curve(curves: list[list[Any]]) -> list[Any]:
    return [sum(c[i] for c in curves) / len(curves) for i in range(min(map(len, curves)))]


def aggregate(arm: Arm, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration over its seeds: mean and spread of the final accuracy, mean curves,
    the pooled measured staleness distribution, mean clipped / IS-capped fractions, wall time."""
    accs = [r["final_accuracy"] for r in runs]
    counts = pool_counts(r["staleness_counts"] for r in runs)
    total = sum(counts)
    acc_steps = _mean_curve([[p[0] for p in r["accuracy_curve"]] for r in runs])
    acc_curve = _mean_curve([[p[1] for p in r["accuracy_curve"]] for r in runs])
    return {
        "name": arm.name,
        "steps_per_cycle": arm.steps_per_cycle,
        "depth": arm.depth,
        "max_staleness": arm.max_staleness,
        "correction": arm.correction,
        "seeds": [r["seed"] for r in runs],
        "final_accuracy_mean": statistics.fmean(accs),
        "final_accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
        "final_accuracy_min": min(accs),
        "final_accuracy_max": max(accs),
        "accuracy_curve": [[s, a] for s, a in zip(acc_steps, acc_curve, strict=False)],
        "reward_curve": _mean_curve([r["reward_curve"] for r in runs]),
        "staleness_counts": counts,
        "staleness_mean": histogram_mean(counts),
        "staleness_max": len(counts) - 1,
        "at_bound_frac": counts[arm.max_staleness] / total
        if len(counts) > arm.max_staleness and total
        else 0.0,
        "clipped_frac": statistics.fmean(r["clipped_frac"] for r in runs),
        "is_capped_frac": statistics.fmean(r["is_capped_frac"] for r in runs),
        "dropped_stale": sum(r["dropped_stale"] for r in runs),
        "wall_s_mean": statistics.fmean(r["wall_s"] for r in runs),
        "rl_seconds_mean": statistics.fmean(r["rl_seconds"] for r in runs),
        "runs": runs,
    }
