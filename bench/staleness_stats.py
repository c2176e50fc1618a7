"""The staleness study's statistics (``bench.staleness_design.PREREGISTERED``): the area under a
run's held-out curve, paired comparisons over seeds (Student-t interval, exact sign-flip
permutation p-value), the non-inferiority test with its margin, the A/A control, and per-arm
means of the per-step diagnostics. Pure functions of the runs' records."""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Any

# two-sided 95 % Student-t quantiles t(0.975, df) for df = 1..30 (normal beyond)
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
    2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
    2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    if df < 1:
        raise ValueError("an interval needs at least two paired seeds")
    return _T975[df - 1] if df <= len(_T975) else 1.960 + 2.4 / df


def auc(evals: list[list[float]]) -> float:
    """Mean held-out accuracy over steps ``[first, last]`` of ``[[step, accuracy], …]``
    (trapezoids, ÷ the span)."""
    pts = sorted(evals)
    span = pts[-1][0] - pts[0][0]
    if span <= 0:
        raise ValueError("an area needs evaluations at two different steps")
    area = sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in itertools.pairwise(pts))
    return area / span


def sign_flip_p(diffs: list[float]) -> float:
    """Exact two-sided permutation p-value of mean(diffs) = 0 (every sign pattern; ≤ 16 seeds)."""
    n = len(diffs)
    if n > 16:
        raise ValueError("the exact test enumerates 2^n sign patterns: at most 16 seeds")
    observed = abs(sum(diffs)) - 1e-12
    hits = sum(
        abs(sum(s * d for s, d in zip(signs, diffs, strict=True))) >= observed
        for signs in itertools.product((1, -1), repeat=n)
    )
    return hits / 2**n


def paired(a: dict[int, float], b: dict[int, float]) -> dict[str, Any]:
    """``a − b`` over the seeds both have: mean, 95 % interval, relative to mean(b), p-value."""
    seeds = sorted(set(a) & set(b))
    d = [a[s] - b[s] for s in seeds]
    n = len(d)
    base = statistics.fmean(b[s] for s in seeds)
    mean = statistics.fmean(d)
    half = t975(n - 1) * statistics.stdev(d) / math.sqrt(n) if n > 1 else math.inf
    return {
        "seeds": seeds,
        "mean_a": statistics.fmean(a[s] for s in seeds),
        "mean_b": base,
        "diff": mean,
        "ci": [mean - half, mean + half],
        "relative": mean / base,
        "relative_ci": [(mean - half) / base, (mean + half) / base],
        "p_sign_flip": sign_flip_p(d) if 1 < n <= 16 else None,
    }


def non_inferiority(arm: dict[int, float], sync: dict[int, float], *, margin: float) -> dict:
    """Holds when the interval's lower end of the relative difference lies above −margin."""
    got = paired(arm, sync)
    low = got["relative_ci"][0]
    verdict = "holds" if low > -margin else "fails" if got["relative_ci"][1] < -margin else "open"
    return {**got, "margin": margin, "verdict": verdict}


def aa_control(a: dict[int, float], b: dict[int, float]) -> dict[str, Any]:
    got = paired(a, b)
    return {**got, "equal_within_interval": got["ci"][0] <= 0.0 <= got["ci"][1]}


def per_arm(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm: AUC and final accuracy per seed, their means and spreads, the mean held-out
    curve and the mean of every per-step diagnostic, step by step."""
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({r["arm"] for r in runs}):
        mine = sorted((r for r in runs if r["arm"] == name), key=lambda r: r["seed"])
        aucs = {r["seed"]: auc(r["evals"]) for r in mine}
        finals = {r["seed"]: r["evals"][-1][1] for r in mine}
        keys = list(mine[0]["steps"][0]) if mine[0]["steps"] else []
        head = mine[0]
        out[name] = {
            **{k: head[k] for k in ("label", "correction", "eta", "steps_per_cycle", "replicate")},
            "auc": aucs,
            "final": finals,
            "auc_mean": statistics.fmean(aucs.values()),
            "auc_sd": statistics.stdev(aucs.values()) if len(aucs) > 1 else 0.0,
            "final_mean": statistics.fmean(finals.values()),
            "final_sd": statistics.stdev(finals.values()) if len(finals) > 1 else 0.0,
            "curve": [
                [pt[0], statistics.fmean(r["evals"][i][1] for r in mine)]
                for i, pt in enumerate(head["evals"])
            ],
            "diagnostics": {
                k: [
                    statistics.fmean(r["steps"][i][k] for r in mine)
                    for i in range(len(head["steps"]))
                ]
                for k in keys
            },
            "off_policy": off_policy(mine),
            "seconds_mean": statistics.fmean(r["seconds"] for r in mine),
            "cpu_seconds_mean": statistics.fmean(r.get("cpu_seconds", r["seconds"]) for r in mine),
        }
    return out


# per-step diagnostics summarised per arm: how far off-policy its training really was
_OFF_POLICY_KEYS = (
    "kl_behaviour_learner", "is_weight_max", "is_over_2_frac", "is_over_5_frac", "clip_frac",
)  # fmt: skip


def off_policy(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per diagnostic of ``_OFF_POLICY_KEYS``: its mean over every step of every seed, its
    largest value at any step of any seed, and that seed (KL(behaviour ‖ learner), the
    largest behaviour weight π_prox / π_behav, the share of a step's sampled tokens whose weight
    exceeds 2 (TIS's cap) and 5 (decoupled PPO's), the clipped fraction)."""
    out: dict[str, dict[str, Any]] = {}
    for key in _OFF_POLICY_KEYS:
        per_seed = {r["seed"]: [st[key] for st in r["steps"] if key in st] for r in runs}
        values = [v for vs in per_seed.values() for v in vs]
        if not values:
            continue
        top_seed = max(per_seed, key=lambda s: max(per_seed[s], default=-math.inf))
        out[key] = {
            "mean": statistics.fmean(values),
            "max": max(values),
            "max_seed": top_seed,
        }
    return out


def _arm(arms: dict[str, Any], *, s: int, eta: int, label: str) -> dict[str, Any] | None:
    name = f"S{s}-eta{eta}-{label}"
    return arms.get(name)


def verdicts(arms: dict[str, dict[str, Any]], prereg: dict[str, Any]) -> dict[str, Any]:
    """The pre-registered tests: per S, non-inferiority and decoupled vs uncorrected; once, the
    A/A control (``resolvable``: its interval contains 0). Unless the A/A control ran and came
    out equal, every non-inferiority verdict is "cannot resolve"."""
    ni, cmp_, aa = prereg["non_inferiority"], prereg["comparison"], prereg["aa_control"]
    out: dict[str, Any] = {}
    a = _arm(arms, s=aa["steps_per_cycle"], eta=aa["eta"], label=aa["labels"][0])
    b = _arm(arms, s=aa["steps_per_cycle"], eta=aa["eta"], label=aa["labels"][1])
    if a and b and len(set(a["auc"]) & set(b["auc"])) > 1:
        out["aa_control"] = aa_control(a["auc"], b["auc"])
    # a study whose A/A pair differs (or that has none) cannot tell noise from an effect: no
    # test of it "holds" or "fails", whatever its interval says
    out["resolvable"] = bool(out.get("aa_control", {}).get("equal_within_interval"))
    for s in ni["steps_per_cycle"]:
        sync = _arm(arms, s=s, eta=0, label="sync")
        dec = _arm(arms, s=s, eta=ni["eta"], label=ni["arm"])
        none = _arm(arms, s=s, eta=cmp_["eta"], label=cmp_["against"])
        got: dict[str, Any] = {}
        if sync and dec and len(dec["auc"]) > 1:
            got["non_inferiority"] = non_inferiority(dec["auc"], sync["auc"], margin=ni["margin"])
            if not out["resolvable"]:
                got["non_inferiority"]["verdict"] = "cannot resolve"
        if dec and none and len(dec["auc"]) > 1:
            got["decoupled_vs_none"] = paired(dec["auc"], none["auc"])
        out[f"S{s}"] = got
    return out


def exploratory(arms: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every lagged arm against the synchronous arm of its S (AUC, paired), not pre-registered."""
    rows = []
    for name, a in arms.items():
        sync = _arm(arms, s=a["steps_per_cycle"], eta=0, label="sync")
        if a["eta"] == 0 or sync is None or len(a["auc"]) < 2:
            continue
        rows.append({"arm": name, **paired(a["auc"], sync["auc"])})
    return rows
