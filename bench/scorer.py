"""Scorer benchmark: solver rewards batched by the service vs. one solver call at a time.

The seed's shape (``001_*.txt``): 30 prompts × 4 responses = 120 solver calls per step, which its
author ran effectively one by one. Both paths use the same vLLM engine, the same solver model
(``fixtures.solver_fixture``'s copy solver: a real tiny LLM whose right answers we know), the same
prompts and the same math-verify ``GraderPool``, in the same run:

- batched:    ``Solver.correctness(all 120 items)`` — the service's path: every request is
              submitted to the engine at once (continuous batching), answers graded together;
- sequential: ``await Solver.correctness([item])`` for each item, awaiting each before the next.

Both must produce the same rewards (greedy decoding). Also reports rule-scoring items/s per
grading worker (``bench.scorer_rule``). ``python -m bench.scorer``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from bench.scorer_rule import run_rule_bench
from common.engine import EngineSettings, GenerationEngine
from fixtures.solver_fixture import COPY_TEMPLATE, build_copy_solver, copy_example
from services.scorer.grader_pool import GraderPool
from services.scorer.rewards import ScoreItem
from services.scorer.solver import Solver, SolverSettings

log = logging.getLogger(__name__)
DEFAULT_SOLVER_DIR = Path("bench/work/cache/copy_solver")  # inside the clone (git-ignored)


def _items(n: int, *, seed: int = 0) -> tuple[list[Any], list[float]]:
    """``n`` solver items (question, guideline, ground truth); every other one has a wrong number."""
    rng = random.Random(seed)
    items, expected = [], []
    for i in range(n):
        question, guideline, number = copy_example(rng)
        if i % 2:
            guideline = guideline.replace(str(number), str(number % 9 + 1))
        items.append(ScoreItem(prompt=question, response=guideline, ground_truth=str(number)))
        expected.append(0.0 if i % 2 else 1.0)
    return items, expected


async def _solver_pass(
    model: str, items: list[Any], pool: Any, *, max_tokens: int, fixed_length: bool
) -> dict:
    engine = GenerationEngine(
        EngineSettings(model=model, dtype="float32", max_model_len=512, kv_cache_gib=1.0,
                       gpu_memory_utilization=0.2, max_num_seqs=256)
    )  # fmt: skip
    await engine.start()
    try:
        solver = Solver(
            SolverSettings(model=model, template=COPY_TEMPLATE, max_tokens=max_tokens,
                           max_model_len=512, ignore_eos=fixed_length),
            pool=pool, engine=engine,
        )  # fmt: skip
        await solver.start()
        await solver.correctness(items[:4])  # warm-up: first-call costs out of both timings
        tokens0, start = solver.solver_tokens, time.perf_counter()
        batched = await solver.correctness(items)
        batched_s, batched_tokens = time.perf_counter() - start, solver.solver_tokens - tokens0
        start = time.perf_counter()
        sequential = []
        for item in items:  # the seed's pattern: one request, await it, then the next
            sequential += await solver.correctness([item])
        sequential_s = time.perf_counter() - start
    finally:
        engine.shutdown()
    return {
        "batched": [c.value for c in batched],
        "sequential": [c.value for c in sequential],
        "batched_s": batched_s,
        "sequential_s": sequential_s,
        "batched_tokens": batched_tokens,
    }


def run_scorer_bench(
    *, groups: int = 30, per_group: int = 4, out_path: str | Path | None = None,
    solver_dir: str | Path | None = None, max_tokens: int = 32, rule_items: int = 2000,
    rule_workers: tuple[int, ...] = (1, 2), answer_tokens: tuple[int, ...] = (0, 128),
) -> dict:  # fmt: skip
    """Runs both solver paths and the rule benchmark; prints and returns (and writes) the JSON.

    ``answer_tokens``: solver answer lengths to measure; 0 = the copy solver's own short answers
    (about 5 tokens, stops at end-of-sequence, ``max_tokens`` cap), N = every answer runs to N
    tokens (``SolverSettings.ignore_eos``), the cost of a solver that reasons before it answers.
    The first entry is the headline figure; every length is in ``by_answer_length``."""
    n = groups * per_group
    model = str(build_copy_solver(solver_dir or DEFAULT_SOLVER_DIR))
    items, expected = _items(n)
    runs = {}
    with GraderPool(2, 10.0, registry=CollectorRegistry()) as pool:
        pool.wait_ready()
        for length in answer_tokens:
            runs[length] = asyncio.run(
                _solver_pass(model, items, pool, max_tokens=length or max_tokens,
                             fixed_length=bool(length))
            )  # fmt: skip
            if runs[length]["batched"] != runs[length]["sequential"]:
                raise RuntimeError(
                    f"answer length {length}: batched and sequential solver rewards differ "
                    "under greedy decoding"
                )
    solver = runs[answer_tokens[0]]
    rule = [run_rule_bench(n_items=rule_items, workers=w) for w in rule_workers]
    result = {
        "bench": "scorer",
        "solver_calls": n,
        "shape": f"{groups} prompts x {per_group} responses",
        "solver_model": "copy solver (fixtures.solver_fixture), greedy",
        "batched_s": round(solver["batched_s"], 3),
        "sequential_s": round(solver["sequential_s"], 3),
        "speedup": round(solver["sequential_s"] / solver["batched_s"], 1),
        "target_speedup": 10.0,
        "batched_calls_per_s": round(n / solver["batched_s"], 1),
        "solver_tokens": solver["batched_tokens"],
        "reward_matches_expected": sum(
            a == b for a, b in zip(solver["batched"], expected, strict=True)
        )
        / n,
        "by_answer_length": [
            {
                "answer_tokens": length or f"own (<= {max_tokens}, stops at EOS)",
                "batched_s": round(r["batched_s"], 3),
                "sequential_s": round(r["sequential_s"], 3),
                "speedup": round(r["sequential_s"] / r["batched_s"], 1),
                "solver_tokens": r["batched_tokens"],
            }
            for length, r in runs.items()
        ],
        "rule_scoring": [
            {
                k: r[k]
                for k in (
                    "workers",
                    "n_items",
                    "items_per_s",
                    "items_per_s_per_worker",
                    "p50_item_ms",
                    "p99_item_ms",
                )
            }  # fmt: skip
            for r in rule
        ],
    }
    print(format_scorer_bench(result))
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


def format_scorer_bench(r: dict) -> str:
    lines = [
        f"solver reward, {r['shape']} = {r['solver_calls']} solver calls:",
        f"  batched (service)    {r['batched_s']:8.2f} s  ({r['batched_calls_per_s']} calls/s)",
        f"  one call at a time   {r['sequential_s']:8.2f} s",
        f"  speed-up             {r['speedup']:8.1f} x  (target >= {r['target_speedup']:.0f} x)",
    ]
    for row in r.get("by_answer_length", [])[1:]:
        lines.append(
            f"  answers of {row['answer_tokens']} tokens: batched {row['batched_s']:.2f} s, "
            f"one at a time {row['sequential_s']:.2f} s, speed-up {row['speedup']:.1f} x"
        )
    for rule in r["rule_scoring"]:
        lines.append(
            f"rule scoring, {rule['workers']} worker(s): {rule['items_per_s']} items/s "
            f"({rule['items_per_s_per_worker']} per worker, p99 {rule['p99_item_ms']} ms)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    run_scorer_bench(out_path="bench/results/scorer.json")
