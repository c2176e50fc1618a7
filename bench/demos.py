"""`tether bench demos --kind KIND [--seeds 0,1,2]`: the README's demo tables, measured.

Runs `tether demo` of one kind (``KINDS``) once per seed, one after another, each a child
process, and collects the ``demo_result.json`` each writes (``tether.demo.result``: seed,
commit, config digest, held-out accuracy at every round, reward and tool use per step, wall
time by phase, load average) into ``bench/results/demos/<kind>.json``. The README's tables are
generated from those files (``bench.demos_report``), never typed.

**One commit.** Every run records the commit it ran at; a file holds runs of one commit only.
Seeds run in several sittings (``--seeds 0,1,2`` today, ``--seeds 3,4,5`` tomorrow) are merged
when the commit is the same and the tree was clean both times; runs of another commit, or of a
dirty tree, are replaced, never mixed in. Each sitting is listed with its command and seeds.

**Shared warm-ups.** The model and warm-up of a seed are built once per commit and preset under
``<work-dir>/demos/<commit>/assets/`` and shared by the kinds of that preset: ``arithmetic`` and
``arithmetic-lora`` start RL from the same model, as do ``tools`` and ``tools-agent`` (so their
"before RL" figures are equal and their comparison is of RL alone). The kind that runs first
builds them; a result says whether it reused its warm-up (``warmup.reused``), and its wall
time then holds no warm-up.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from bench import child_process
from bench.workload import child_env, machine_info
from tether.demo.result import DemoResult
from tether.runs.provenance import git_state
from tether.runs.supervisor import tether_command

log = logging.getLogger(__name__)

# the `tether demo` arguments of each kind (with --set run.seed / run.name / run.run_dir added)
LORA = ["--set", "learner.lora_rank=16", "--set", "learner.lora_alpha=32", "--set",
        "learner.lr=5e-4"]  # fmt: skip
KINDS: dict[str, list[str]] = {
    "arithmetic": [],
    "arithmetic-lora": LORA,
    "tools": ["--task", "tools"],
    "tools-agent": ["--task", "tools", "--agent"],
    "smollm2": ["--task", "smollm2"],
    "smollm2-tools": ["--task", "smollm2-tools"],
}
PRESET = {"arithmetic": "demo", "arithmetic-lora": "demo", "tools": "tools", "tools-agent": "tools",
          "smollm2": "smollm2", "smollm2-tools": "smollm2-tools"}  # fmt: skip
# the seeds each table reports; the tools demo's recipe was tuned on seeds 0 and 1 (d25bc5f), so
# its tables (the built-in loop's and the endpoint's) add 3, 4 and 5, which were not used for tuning
SEEDS = {
    "arithmetic": (0, 1, 2),
    "arithmetic-lora": (0, 1, 2),
    "tools": (0, 1, 2, 3, 4, 5),
    "tools-agent": (0, 1, 2, 3, 4, 5),
    "smollm2": (0, 1, 2),
    "smollm2-tools": (0, 1, 2),
}
QUICK_CYCLES = 2  # --quick: one seed, 2 cycles (the plumbing, not a measurement)
RUN_TIMEOUT_S = 3600.0  # one demo; the tools demo takes ~10 min alone on 2 cores


def check_kind(kind: str | None) -> str:
    if kind not in KINDS:
        raise ValueError(
            f"--kind {kind!r}: `tether bench demos` needs the demo to run; choose one of "
            f"{', '.join(KINDS)} (e.g. tether bench demos --kind tools --seeds 0,1,2)"
        )
    return kind


def command_line(kind: str, seeds: tuple[int, ...], quick: bool) -> str:
    """The CLI line that reproduces a sitting."""
    return (f"tether bench demos --kind {kind} --seeds {','.join(map(str, seeds))}"
            f"{' --quick' if quick else ''}")  # fmt: skip


def demo_command(kind: str, seed: int, *, root: Path, quick: bool) -> list[str]:
    assets = root / "assets" / f"{PRESET[kind]}-s{seed}"
    sets = {
        "run.seed": str(seed),
        "run.name": json.dumps(f"{kind}-s{seed}"),
        "run.run_dir": json.dumps(str(root / "runs")),
    }
    args = [*KINDS[kind], "--assets", str(assets)]
    args += ["--num-cycles", str(QUICK_CYCLES)] if quick else []
    args += [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    return tether_command("demo", *args)


def run_one_demo(kind: str, seed: int, *, root: Path, quick: bool) -> dict[str, Any]:
    """One `tether demo`; its ``demo_result.json``. A run that fails raises (with its output's
    tail): a failed demo is a bug to look at, not a row of a table."""
    result_path = root / "runs" / f"{kind}-s{seed}" / "demo_result.json"
    result_path.unlink(missing_ok=True)
    proc = child_process.run(demo_command(kind, seed, root=root, quick=quick),
                             timeout_s=RUN_TIMEOUT_S, env=child_env(None))  # fmt: skip
    if proc.returncode != 0 or not result_path.exists():
        raise RuntimeError(
            f"tether demo ({kind}, seed {seed}) exited {proc.returncode}:\n"
            f"{(proc.stdout + proc.stderr)[-3000:]}"
        )
    result = DemoResult.from_dict(json.loads(result_path.read_text())).to_dict()
    if result["kind"] != kind or result["seed"] != seed:
        raise RuntimeError(f"{result_path}: a {result['kind']} run of seed {result['seed']}, "
                           f"not {kind} of seed {seed}")  # fmt: skip
    return result


def merge(previous: dict[str, Any] | None, git: dict[str, Any]) -> tuple[list, list]:
    """(runs, sittings) of ``previous`` that may stay beside runs made at ``git``: all of them
    when both are of one commit with a clean tree, none otherwise."""
    if not previous or not git.get("commit") or git.get("dirty"):
        return [], []
    same = previous.get("git") == git
    if not same:
        log.warning("bench demos: %s holds runs of commit %s; replaced by commit %s",
                    previous.get("kind"), (previous.get("git") or {}).get("commit"),
                    git["commit"])  # fmt: skip
        return [], []
    return list(previous.get("runs", [])), list(previous.get("sittings", []))


def write(out: Path, doc: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(out)


def run_demos_bench(
    *, out_path: str | Path, work_dir: str | Path = "bench/work", kind: str | None = None,
    seeds: tuple[int, ...] | None = None, quick: bool = False, **_: Any,
) -> dict[str, Any]:  # fmt: skip

    kind = check_kind(kind or "arithmetic")
    seeds = seeds or ((0,) if quick else SEEDS[kind])
    git = git_state()
    tag = (git["commit"] or "no-commit")[:12] + ("-dirty" if git["dirty"] else "")
    root = Path(work_dir).resolve() / "demos" / tag
    out = Path(out_path)
    previous = json.loads(out.read_text()) if out.exists() else None
    runs, sittings = merge(previous, git)
    runs = [r for r in runs if r["seed"] not in seeds]
    sitting = {"command": command_line(kind, seeds, quick), "seeds": list(seeds),
               "machine": machine_info()}  # fmt: skip
    sittings.append(sitting)
    doc: dict[str, Any] = {}
    for seed in seeds:
        log.info("bench demos: %s, seed %d", kind, seed)
        runs.append(run_one_demo(kind, seed, root=root, quick=quick))
        runs.sort(key=lambda r: r["seed"])
        # written after every seed: a sitting stopped half-way keeps the seeds it finished
        doc = {"bench": "demos", "kind": kind, "quick": quick, "git": git,
               "seeds": [r["seed"] for r in runs], "sittings": sittings, "runs": runs}  # fmt: skip
        write(out, doc)
    sitting["load_average_after"] = machine_info()["load_average"]
    write(out, doc)
    print(f"bench demos: {kind}, seeds {', '.join(map(str, doc['seeds']))} → {out}")
    return doc
