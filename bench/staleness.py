"""`tether bench staleness`: does training on responses η cycles old hurt learning, and does
decoupled PPO hold it within 5 % of synchronous training (AReaL's claim)?

The design, fixed before running, is ``bench/staleness_design.py``; one run is
``bench/staleness_run.py`` (the learner's own code, fed by an in-process fixed-lag sampler);
the tests are ``bench/staleness_stats.py``; the write-up ``bench/staleness_report.py``.

Runs go to ``staleness_runs/<fingerprint>/`` beside the result (``bench/results/`` for the
study of record: committed with it), one JSON each, written when the run ends: an interrupted
study started again with the same design, in this session or a later one, skips the runs it has
and goes on; the result records the folder (``made.runs_dir``) and a test recomputes every
derived figure from those runs. ``study.workers`` runs go in parallel (one thread each).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

from bench.provenance import CLONE, git_state
from bench.staleness_design import PREREGISTERED, SIZES, Arm, Study
from bench.staleness_report import format_staleness, write_report
from bench.staleness_stats import exploratory, per_arm, verdicts
from bench.workload import machine_info, report
from common.data.prompts import encode_prompt
from tether.demo.run import PRESETS, prepare_assets
from tether.demo.tasks import ArithmeticTask, make_problems

ASSETS_PRESET = "demo"  # the demo's tiny model, task and supervised warm-up


def prepare(root: Path, study: Study) -> dict[str, Any]:
    """The warmed-up demo model and task (``tether demo``'s), and ``study.held_out`` problems
    never trained on: the demo's held-out split, then problems drawn after its train split."""
    assets = prepare_assets(root.parent / "demo-assets", preset=ASSETS_PRESET, seed=0)
    task = ArithmeticTask(seed=0, **PRESETS[ASSETS_PRESET]["task"])
    extra = ArithmeticTask(**{**task.__dict__, "num_train": task.num_train + study.held_out})
    train, held_out = make_problems(extra)  # the same draw, continued past the demo's
    problems = held_out + train[task.num_train :]
    path = root / f"held_out_{study.held_out}.jsonl"
    if not path.exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(assets.model_dir))
        style = task.prompt_style
        lines = [
            json.dumps(
                {"prompt_token_ids": encode_prompt(tok, p.prompt(style)), "answer": str(p.answer)}
            )
            for p in problems[: study.held_out]
        ]
        tmp = path.with_suffix(".tmp")
        root.mkdir(parents=True, exist_ok=True)  # a fresh clone has no bench/work/staleness
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(path)
    out: dict[str, Any] = {
        "model_dir": str(assets.model_dir),
        "train_path": str(assets.data_dir / "train.jsonl"),
        "held_out_path": str(path),
    }
    out["initial_accuracy"] = _initial_accuracy(out, study)
    return out


def _initial_accuracy(assets: dict[str, Any], study: Study) -> float:
    """Held-out accuracy of the warm-up model, the same step-0 point of every run (measured
    once here instead of in each of them)."""
    from bench.staleness_run import held_out_accuracy  # noqa: PLC0415 - loads torch

    return held_out_accuracy(assets, study)


def fingerprint(study: Study, assets: dict[str, Any]) -> str:
    """What a finished run's numbers depend on: the design (not the worker count) and the
    warm-up model's weights (their bytes, not where or how fast they were made, so a later
    sitting in another clone finds the same runs). A changed design starts a new set of runs;
    the old ones stay."""
    design = {k: v for k, v in study.describe().items() if k not in ("workers", "arms", "seeds")}
    weights = hashlib.sha256()
    for path in sorted(Path(assets["model_dir"]).glob("*.safetensors")):
        weights.update(path.read_bytes())
    key = json.dumps([design, weights.hexdigest()], sort_keys=True)
    return hashlib.blake2b(key.encode(), digest_size=6).hexdigest()


def _one(job: tuple[Arm, int, Study, dict[str, Any], str, dict[str, Any]]) -> dict[str, Any]:
    """A worker's task: one run, written atomically to its file."""
    from bench.staleness_run import run_arm  # noqa: PLC0415 - loads torch

    arm, seed, study, assets, path, commit = job
    got = {
        **run_arm(arm, study, seed=seed, assets=assets),
        "git": commit,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_after": list(os.getloadavg()),
    }
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(got) + "\n")
    tmp.replace(path)
    return got


def run_all(
    study: Study, root: Path, *, assets: dict[str, Any] | None = None,
    runs_root: Path | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """Every arm × seed, reusing finished runs; returns (runs, how they were made).
    ``assets``: the model, train and held-out files (default: ``prepare``'s); ``runs_root``:
    where the runs' folders are (default ``root/runs``)."""
    started, load = time.monotonic(), os.getloadavg()
    assets = assets or prepare(root, study)
    warmup_s = time.monotonic() - started
    runs_dir = (runs_root or root / "runs") / fingerprint(study, assets)
    runs_dir.mkdir(parents=True, exist_ok=True)
    commit = git_state()
    jobs, done = [], []
    for seed in study.seeds:  # seed by seed: a study cut short has every arm once first
        for arm in study.arms:
            path = runs_dir / f"{arm.name}-seed{seed}.json"
            if path.exists():
                done.append(json.loads(path.read_text()))
            else:
                jobs.append((arm, seed, study, assets, str(path), commit))
    print(f"staleness: {len(done)} runs found in {runs_dir}, {len(jobs)} to go", flush=True)
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited threads
    t0 = time.monotonic()
    with ctx.Pool(processes=max(1, min(study.workers, len(jobs) or 1))) as pool:
        try:
            for i, got in enumerate(pool.imap_unordered(_one, jobs), 1):
                done.append(got)
                left = (time.monotonic() - t0) / i * (len(jobs) - i)
                print(f"[{i}/{len(jobs)}] {got['arm']} seed {got['seed']}: "
                      f"{got['seconds']:.0f} s, ~{left / 60:.0f} min left", flush=True)  # fmt: skip
        except BaseException:
            pool.terminate()  # an interrupted study stops its workers; finished runs stay
            raise
    made = {
        "runs_dir": _clone_relative(runs_dir),
        "warmup_seconds": warmup_s,
        "run_seconds": time.monotonic() - t0,
        "runs_reused": len(done) - len(jobs),
        "load_average_before": list(load),
        "load_average_after": list(os.getloadavg()),
        **totals(done),
    }
    return sorted(done, key=lambda r: (r["arm"], r["seed"])), made


def _clone_relative(path: Path) -> str:
    """``path`` relative to the clone when inside it (a committed result names its runs in any
    checkout), else absolute."""
    try:
        return str(path.resolve().relative_to(CLONE))
    except ValueError:
        return str(path.resolve())


def load_runs(runs_dir: str | Path) -> list[dict[str, Any]]:
    """The finished runs in ``runs_dir`` (a path relative to the clone, or absolute), in the
    order ``run_all`` returns them."""
    path = Path(runs_dir)
    path = path if path.is_absolute() else CLONE / path
    runs = [json.loads(p.read_text()) for p in path.glob("*.json")]
    return sorted(runs, key=lambda r: (r["arm"], r["seed"]))


# what this invocation of the runner knows about how the runs were made; ``totals`` adds what
# the runs themselves say. A result's ``made`` holds these keys and no others (a test checks it)
MADE_KEYS = frozenset(
    {"runs_dir", "warmup_seconds", "run_seconds", "runs_reused", "load_average_before",
     "load_average_after", "runs", "cpu_seconds_total", "commits", "finished"}
)  # fmt: skip


def totals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """What every run's own record says, summed: how many, their CPU seconds (a run's cost
    whatever else ran), the commits they ran on, when the first and last finished. Runs made in
    several sittings (a study interrupted and started again) are all here: each records its own
    commit, time and load."""
    finished = sorted(r["finished"] for r in runs if r.get("finished"))
    return {
        "runs": len(runs),
        "cpu_seconds_total": sum(r.get("cpu_seconds", 0.0) for r in runs),
        "commits": sorted({json.dumps(r.get("git")) for r in runs}),
        "finished": [finished[0], finished[-1]] if finished else None,
    }


def derive(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything in a result that is computed from its runs: the per-arm summaries, the
    pre-registered verdicts, the exploratory comparisons and the runs' totals. The runner writes
    these, and a test recomputes them from the committed result's ``runs`` and compares."""
    arms = per_arm(runs)
    return {
        "arms": arms,
        "verdicts": verdicts(arms, PREREGISTERED),
        "exploratory": exploratory(arms),
        "totals": totals(runs),
    }


def run_staleness_bench(
    *, out_path: str | Path | None = None, size: str | None = None, quick: bool = False,
    work_dir: str | Path = "bench/work", study: Study | None = None, lr: float | None = None,
    **_: Any,
) -> dict[str, Any]:  # fmt: skip
    """Run the study (``size``: full, or smoke; ``quick`` means smoke; ``lr`` replaces the
    design's learning rate: a different study, with its own runs), test, write JSON + report."""
    size = size or ("smoke" if quick else "full")
    if study is None:
        if size not in SIZES:
            raise ValueError(f"size {size!r}: choose {' or '.join(SIZES)}")
        study = SIZES[size]()
        if lr is not None:
            study = dataclasses.replace(study, lr=lr)
    machine = machine_info()
    # the runs of a study written into a results folder are kept beside it (committed with the
    # result: raw records a later sitting resumes from and a test recomputes the result from)
    runs_root = Path(out_path).parent / "staleness_runs" if out_path is not None else None
    runs, made = run_all(study, Path(work_dir).resolve() / "staleness", runs_root=runs_root)
    derived = derive(runs)
    result: dict[str, Any] = {
        "bench": "staleness",
        "size": size,
        "command": "tether bench staleness" + (f" --size {size}" if size != "full" else ""),
        "machine": machine,
        "git": git_state(),
        "study": study.describe(),
        "preregistered": PREREGISTERED,
        "made": made,
        "arms": derived["arms"],
        "verdicts": derived["verdicts"],
        "exploratory": derived["exploratory"],
    }
    if out_path is not None:
        result["report"] = {k: str(v) for k, v in write_report(result, Path(out_path)).items()}
    return report(result, format_staleness(result), out_path)
