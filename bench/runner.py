"""`tether bench WHAT [--out DIR] [--quick]`: run benchmarks, write JSON, regenerate bench/README.md.

Every benchmark measures Tether's path and a baseline in the same run; each writes
``<out>/<what>[_quick].json``. ``all`` runs every benchmark whose module exists and then rewrites
``bench/README.md`` from every JSON file in ``<out>``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ORDER = (
    "bus", "weights", "scorer", "generator", "episodes", "learner", "pipeline", "peer", "quality",
    "staleness", "models", "lora",
)  # fmt: skip


def _quick_kwargs(what: str, quick: bool) -> dict[str, Any]:
    if not quick:
        return {}
    presets: dict[str, dict[str, Any]] = {
        "bus": {"n_messages": 50, "repeats": 1},
        "weights": {"total_mb": 64, "repeats": 2},
        "scorer": {"rule_items": 400, "answer_tokens": (0, 64)},
        "generator": {"max_tokens": 32, "rounds": 1, "hidden_size": 128, "num_layers": 2},
        "episodes": {"prompts": 8, "n": 4, "rounds": 1},
        "learner": {
            "cycles": 3,
            "prompts": 8,
            "response_tokens": 64,
            "hidden": 128,
            "layers": 2,
            "repeats": 1,
        },
        "pipeline": {"quick": True},
        "peer": {"quick": True},
        "quality": {"quick": True},
        "staleness": {"quick": True},
        "models": {"quick": True},
        "lora": {"quick": True, "steps": 2, "repeats": 2},
    }
    return presets[what]


def _bench_fn(what: str) -> Callable[..., dict[str, Any]] | None:
    """``bench.<what>.run_<what>_bench``, or None when that module is not written yet."""
    try:
        mod = importlib.import_module(f"bench.{what}")
    except ModuleNotFoundError as exc:
        if exc.name == f"bench.{what}":
            return None
        raise
    return getattr(mod, f"run_{what}_bench", None)


def run_one(
    what: str,
    *,
    out_dir: Path,
    quick: bool,
    work_dir: Path,
    reuse: dict[str, Any] | None = None,
    threads: int | None = None,
    size: str | None = None,
    generators: tuple[int, ...] = (),
    lr: float | None = None,
) -> dict[str, Any] | None:
    fn = _bench_fn(what)
    if fn is None:
        log.warning(
            "bench %s: module bench.%s (run_%s_bench) not available; skipped",
            what,
            what,
            what,
        )
        return None
    e2e = what in ("pipeline", "peer", "quality", "staleness")
    suffix = f"_{size}" if size and e2e else "_quick" if quick else ""
    suffix += f"_t{threads}" if threads and e2e else ""
    suffix += f"_lr{lr:g}" if lr is not None and what == "staleness" else ""
    out = out_dir / f"{what}{suffix}.json"
    kwargs = _quick_kwargs(what, quick)
    if e2e:
        kwargs["work_dir"] = work_dir
        kwargs["threads"] = threads
        kwargs["size"] = size
    if what in ("models", "episodes", "lora"):
        kwargs["work_dir"] = work_dir
    if what == "peer" and reuse is not None:
        kwargs["tether_result"] = reuse
    if what == "weights" and generators:
        kwargs["generators"] = generators
    if what == "staleness" and lr is not None:
        kwargs["lr"] = lr
    return fn(out_path=out, **kwargs)


def _generators(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise ValueError(f"--generators {text!r}: give counts >= 1 separated by commas, e.g. 1,2,4")
    return counts


def run_bench(args: Any) -> int:
    """CLI entry: ``args.what`` in bus|weights|scorer|generator|pipeline|peer|all, ``args.out``,
    ``args.quick``; optional ``args.size`` (quick|medium|full, pipeline and peer), ``args.threads`` (OMP threads per benchmarked process, pipeline and
    peer only), ``args.lr`` (the staleness study's learning rate) and ``args.work_dir``. Returns
    the exit code."""
    from bench.results_md import write_readme

    what = args.what
    if what not in (*ORDER, "all"):
        raise ValueError(f"bench {what!r}: choose one of {', '.join(ORDER)} or all")
    out_dir = Path(getattr(args, "out", None) or "bench/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    quick = bool(getattr(args, "quick", False))
    work_dir = Path(getattr(args, "work_dir", None) or "bench/work")
    threads = getattr(args, "threads", None)
    size = getattr(args, "size", None)
    generators = _generators(getattr(args, "generators", None) or ("1,2" if quick else "1,2,4"))
    lr = getattr(args, "lr", None)
    if what != "all":
        result = run_one(
            what, out_dir=out_dir, quick=quick, work_dir=work_dir, threads=threads, size=size,
            generators=generators, lr=lr,
        )  # fmt: skip
        if result is None:
            print(f"bench {what}: its module is not available in this checkout")
            return 1
    else:
        pipeline = None
        for name in ORDER:
            # peer reuses the pipeline bench's async run of the same workload (same process, minutes saved)
            reuse = pipeline["async"] if name == "peer" and pipeline else None
            result = run_one(
                name,
                out_dir=out_dir,
                quick=quick,
                work_dir=work_dir,
                reuse=reuse,
                threads=threads,
                size=size,
                generators=generators,
            )
            if name == "pipeline":
                pipeline = result
    readme = write_readme(out_dir, out_dir.parent / "README.md")
    print(f"wrote {readme}")
    return 0
