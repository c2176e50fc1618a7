"""Benchmark (not a test): rule-scoring throughput of ``GraderPool``, items/s and per worker.

``python -m bench.scorer_rule --n-items 2000 --workers 1 2`` prints one JSON line per
worker count. Items are a fixed, seeded mix of what a math RL run sees: integers, fractions vs.
decimals, LaTeX fractions, percentages, intervals, polynomials, ~30 % wrong answers, and groups
of 4 responses sharing one ground truth (as GRPO does). Worker start-up (warm-up) is excluded.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from prometheus_client import CollectorRegistry

from services.scorer.grader_pool import GraderPool


def make_items(n_items: int, *, seed: int = 0, group_size: int = 4) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    items: list[tuple[str, str]] = []
    while len(items) < n_items:
        a, b = rng.randint(1, 999), rng.randint(2, 60)
        kind = rng.randrange(6)
        if kind == 0:
            gold, right, wrong = str(a), str(a), str(a + 1)
        elif kind == 1:
            gold, right, wrong = f"{a}/{b}", str(round(a / b, 8)), f"{a + 1}/{b}"
        elif kind == 2:
            gold, right, wrong = f"{a / b:.6f}", f"\\frac{{{a}}}{{{b}}}", f"\\dfrac{{{b}}}{{{a}}}"
        elif kind == 3:
            gold, right, wrong = f"{a}", f"{a}\\%", f"{a + 2}\\%"
        elif kind == 4:
            gold, right, wrong = f"[{a},{a + b})", f"[{a}, {a + b})", f"({a}, {a + b}]"
        else:
            gold, right, wrong = f"(x+{a})^2", f"x^2+{2 * a}x+{a * a}", f"x^2+{a * a}"
        for _ in range(group_size):
            items.append((right if rng.random() < 0.7 else wrong, gold))
    return items[:n_items]


def run_rule_bench(*, n_items: int, workers: int, timeout_s: float = 10.0) -> dict:
    """Grade ``n_items`` with a fresh pool of ``workers``; returns and prints the numbers."""
    items = make_items(n_items)
    with GraderPool(workers, timeout_s, registry=CollectorRegistry()) as pool:
        pool.wait_ready()
        start = time.perf_counter()
        results = pool.grade_many(items)
        elapsed = time.perf_counter() - start
    reasons: dict[str, int] = {}
    for result in results:
        reasons[result.reason] = reasons.get(result.reason, 0) + 1
    latencies = sorted(r.seconds for r in results)
    report = {
        "bench": "rule_scoring",
        "n_items": n_items,
        "workers": workers,
        "seconds": round(elapsed, 3),
        "items_per_s": round(n_items / elapsed, 1),
        "items_per_s_per_worker": round(n_items / elapsed / workers, 1),
        "p50_item_ms": round(1000 * latencies[len(latencies) // 2], 2),
        "p99_item_ms": round(1000 * latencies[int(len(latencies) * 0.99)], 2),
        "reasons": reasons,
    }
    print(json.dumps(report))
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-items", type=int, default=2000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    for workers in args.workers:
        run_rule_bench(n_items=args.n_items, workers=workers)


if __name__ == "__main__":
    main()
