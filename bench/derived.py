"""The figures of a result that are computed from its own raw records, recomputed: each
benchmark's ``derive`` (the function its runner writes them with) applied to a committed result
and compared with what the result holds. A hand edit of a summary, a ratio, a verdict or a total
shows up as a difference (``tests/unit/test_results_provenance.py``)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from bench import episodes, lora, memory, reproducibility, staleness
from bench.staleness_stats import exploratory, verdicts


def _staleness(r: dict[str, Any]) -> dict[str, Any]:
    """From the runs in ``made.runs_dir`` (committed beside the result) when the result counts
    them (``made.runs``), everything but how the invocation went; from the per-arm summaries
    otherwise (results from before the runs were kept)."""
    # how the invocation went is the runner's word (only the keys it writes); the totals are
    # the runs'
    made = {k: v for k, v in r["made"].items() if k in staleness.MADE_KEYS}
    if "runs" in made:
        runs = staleness.load_runs(made["runs_dir"])
        if not runs:
            return {"made": {**made, "runs": 0}}  # the runs it names are not there
        got = staleness.derive(runs)
        totals = got.pop("totals")
        return {**got, "made": {**made, **totals}}

    # JSON made the per-seed keys strings; the statistics pair seeds as the runner had them
    arms = {
        name: {**a, **{k: {int(s): v for s, v in a[k].items()} for k in ("auc", "final")}}
        for name, a in r["arms"].items()
    }
    return {
        "made": made,
        "verdicts": verdicts(arms, r["preregistered"]),
        "exploratory": exploratory(arms),
    }


DERIVE: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "staleness": _staleness,
    "memory": memory.derive,
    "episodes": episodes.derive,
    "reproducibility": reproducibility.derive,
    "lora": lora.derive,
}


def differences(held: Any, computed: Any, path: str = "") -> list[str]:
    """Where ``held`` (the committed result) differs from ``computed`` (``derive``'s), as
    ``path: held != computed`` lines; floats equal within 1e-12 relative (JSON round trip)."""
    if isinstance(computed, dict):
        if not isinstance(held, dict):
            return [f"{path}: {held!r} is not a mapping"]
        out = []
        for k in sorted(set(held) | set(computed), key=str):
            if k not in computed and path.endswith("made"):
                out.append(f"{path}.{k}: no code writes it")
            elif k not in held:
                out.append(f"{path}.{k}: missing")
            elif k in computed:
                out += differences(held[k], computed[k], f"{path}.{k}")
        return out
    if isinstance(computed, (list, tuple)):
        if not isinstance(held, list) or len(held) != len(computed):
            return [f"{path}: {held!r} != {computed!r}"]
        return [
            d
            for i, (h, c) in enumerate(zip(held, computed, strict=True))
            for d in differences(h, c, f"{path}[{i}]")
        ]
    if (
        isinstance(computed, float)
        and isinstance(held, (int, float))
        and not isinstance(held, bool)
    ):
        same = math.isclose(held, computed, rel_tol=1e-12, abs_tol=1e-15) or (
            math.isnan(held) and math.isnan(computed)
        )
        return [] if same else [f"{path}: {held!r} != {computed!r}"]
    if held != computed:
        return [f"{path}: {held!r} != {computed!r}"]
    return []


def check(result: dict[str, Any]) -> list[str]:
    """The differences between a result and what its benchmark's ``derive`` computes from it
    (empty when they agree, or when the benchmark has no ``derive``)."""
    derive = DERIVE.get(result.get("bench", ""))
    if derive is None:
        return []
    # compared as the runner wrote it: through JSON (integer keys become strings)
    return differences(result, json.loads(json.dumps(derive(result))))
