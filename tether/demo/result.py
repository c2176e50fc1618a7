"""What `tether demo` writes into its run directory when it ends: ``demo_result.json``, one
``DemoResult``. `tether bench demos` (``bench/demos.py``) collects these into
``bench/results/demos/<kind>.json`` and the README's demo tables are generated from those
(``bench/demos_report.py``), so every field a table shows is here, measured by the run itself.

- **Which demo**: ``kind`` (``demo_kind``: ``arithmetic``, ``tools``, ``tools-agent``, with
  ``-lora`` when ``learner.lora_rank > 0``), the task, the seed, the command line.
- **Which code**: the git commit of the checkout that ran and whether its tracked files differed
  (``tether.runs.provenance.git_state``), taken when the command starts, as its services load
  the code (``run_git``: a checkout that changed during the run counts as differing), and ``config_digest``: a SHA-256 (16 hex digits) of
  the resolved config and the demo's preset (model, task, warm-up), with the run's own paths,
  name and seed left out (``LOCAL_KEYS``), so runs of one demo at different seeds share it and
  a changed setting shows.
- **What it measured**: held-out accuracy at every evaluation round; per optimizer step the
  mean reward and, where episodes call tools, the share that called one; the warm-up's report
  (its steps; for the tools task the careful stage's steps and its last check).
- **What it cost**: wall seconds split into ``assets`` (the tiny model and the task files),
  ``warmup`` (the supervised warm-up; ~0 when ``warmup.reused``) and ``rl`` (`tether train`:
  start-up, every cycle and evaluation, shutdown), and the load average (1, 5, 15 min) before
  the command, before RL and after it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SCHEMA = 1
# settings that name this run's own files and seed: left out of the config digest
LOCAL_KEYS = {
    "run": ("name", "run_dir", "model", "seed", "redis_url", "redis_server_binary"),
    "data": ("train_path", "eval_path"),
}
# of the warm-up's report (``tether.demo.warmup``): the fields a result keeps
WARMUP_KEYS = ("steps", "first_steps", "first_exact", "loss_first", "loss_last", "seconds",
               "num_parameters", "reused")  # fmt: skip


def demo_kind(*, task: str, agent: bool, lora_rank: int) -> str:
    """``arithmetic`` / ``tools`` / ``tools-agent``, then ``-lora`` for a LoRA learner."""
    return f"{task}{'-agent' if agent else ''}{'-lora' if lora_rank > 0 else ''}"


def config_digest(config: dict[str, dict[str, Any]], preset: dict[str, Any]) -> str:
    """16 hex digits of SHA-256 over the resolved config (``TetherConfig.to_dict()``) less
    ``LOCAL_KEYS``, and the demo's preset."""
    kept = {
        section: {k: v for k, v in values.items() if k not in LOCAL_KEYS.get(section, ())}
        for section, values in config.items()
    }
    text = json.dumps({"config": kept, "preset": preset}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_git(at_start: dict[str, Any], at_end: dict[str, Any]) -> dict[str, Any]:
    """The git state a run records: the one its command started with (what its services
    loaded), marked ``dirty`` when the checkout changed before the run ended (a commit or an
    edit since: a service restarted late may have loaded other code)."""
    return at_start if at_end == at_start else {**at_start, "dirty": True}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    """The CPU's model (Linux) and its logical cores."""
    model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next(
                (x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), None
            )
    except OSError:
        pass
    return {"cpu": model, "cpus": os.cpu_count()}


@dataclass(kw_only=True)
class DemoResult:
    kind: str
    task: str
    agent: bool
    lora_rank: int
    seed: int
    command: str
    git: dict[str, Any]
    config_digest: str
    exit_code: int
    # {"round": policy version, "accuracy", "n": prompts graded}, in round order
    evals: list[dict[str, Any]]
    # {"step", "reward_mean"[, "tool_call_rate"]}, in step order
    steps: list[dict[str, Any]]
    warmup: dict[str, Any]
    seconds: dict[str, float]  # assets, warmup, rl, total
    load_average: dict[str, list[float]]  # before, before_rl, after
    machine: dict[str, Any]
    finished: str  # UTC, ISO 8601
    # the run's responses by grading reason, from the scorers' last heartbeats (the status
    # snapshot, ``tether.runs.status.grading``); empty in a result written before it existed
    grading: dict[str, int] = field(default_factory=dict)
    schema: int = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DemoResult:
        """A result read back (``bench.demos``); a schema or a field it does not know is an
        error, not a guess."""
        if d.get("schema") != SCHEMA:
            raise ValueError(f"demo result schema {d.get('schema')!r}: this code reads {SCHEMA}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"demo result: unknown field(s) {unknown}")
        return cls(**d)


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(evaluation rounds, steps) of a run's ``metrics.jsonl``, as a result keeps them."""
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    evals = [
        {"round": r["eval_round"], "accuracy": r["accuracy"], "n": r["n"]}
        for r in rows
        if r.get("kind") == "eval"
    ]
    steps = [
        {"step": r["step"], "reward_mean": r["reward_mean"],
         **({"tool_call_rate": r["tool_call_rate"]} if "tool_call_rate" in r else {})}
        for r in rows
        if r.get("kind") == "step"
    ]  # fmt: skip
    evals.sort(key=lambda e: e["round"])
    steps.sort(key=lambda s: s["step"])
    return evals, steps


def make_result(
    *, kind: str, task: str, agent: bool, lora_rank: int, seed: int, command: str,
    git: dict[str, Any], digest: str, exit_code: int, metrics: Path, warmup: dict[str, Any],
    seconds: dict[str, float], load: dict[str, list[float]], grading: dict[str, int],
) -> DemoResult:  # fmt: skip
    evals, steps = read_metrics(metrics)
    return DemoResult(
        kind=kind, task=task, agent=agent, lora_rank=lora_rank, seed=seed, command=command,
        git=git, config_digest=digest, exit_code=exit_code, evals=evals, steps=steps,
        warmup={k: warmup[k] for k in WARMUP_KEYS if k in warmup},
        seconds={k: round(v, 1) for k, v in seconds.items()}, load_average=load,
        machine=machine(), finished=datetime.now(UTC).isoformat(timespec="seconds"),
        grading=grading,
    )  # fmt: skip


def write_result(path: Path, result: DemoResult) -> None:
    """Write ``result`` at ``path`` atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    tmp.replace(path)
