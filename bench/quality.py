"""`tether bench quality`: wall time to the same held-out accuracy on the demo task.

Three runs from the same warmed-up demo model (``tether demo``'s assets: tiny Qwen2, the
column-addition task whose warm-up teacher drops carries), same train prompts, group size 8,
64 responses per optimizer step, lr 5e-5 with 5 warm-up steps, temperature 0.7, token-mean loss,
no KL, greedy held-out accuracy on the 200 held-out problems every ``eval_every`` steps:

- **Tether async**: ``tether demo`` (16 prompts × 8 per cycle, 2 optimizer steps per cycle,
  ``max_staleness`` = 3: one cycle of overlap);
- **Tether sync**: the same with ``max_staleness`` = 1 (= steps per cycle − 1: no overlap);
- **TRL**: ``GRPOTrainer`` (transformers ``generate``), 8 prompts × 8 per step.

Time to quality = wall seconds from the start of RL to the optimizer step whose policy first
scores ``target`` or more. For Tether, RL starts when the generator is ready (engine up, v0
loaded) and the v0 evaluation has finished (see ``tether_curve``); the step time is the
learner's record of that step; later evaluations run on the generator alongside training and
are not subtracted (200 greedy held-out answers every ``eval_every`` steps, against 64 training
responses per step: they slow Tether's training). For TRL, the clock starts at
``trainer.train()``; both its time with the evaluation callback's time subtracted (it blocks
training) and its wall time with them are reported, the latter comparable with Tether's.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench import child_process
from bench.workload import child_env, machine_info, trl_task
from common.data.prompts import encode_prompt
from tether.demo.run import prepare_assets
from tether.demo.tasks import is_correct, read_jsonl

log = logging.getLogger(__name__)

DEMO_BATCH, GROUP, LR, WARMUP_STEPS, TEMPERATURE, MAX_TOKENS = 64, 8, 5e-5, 5, 0.7, 32


def _tether_run(root: Path, name: str, *, cycles: int, eval_every: int, sync: bool,
                seed: int, timeout_s: float) -> dict[str, Any]:  # fmt: skip
    cmd = [
        sys.executable, "-m", "tether.cli", "demo", "--num-cycles", str(cycles),
        "--set", f"run.run_dir={json.dumps(str(root / 'runs'))}",
        "--set", f'run.name="{name}"', "--set", f"run.seed={seed}",
        "--set", f"learner.eval_every_steps={eval_every}",
        "--set", "learner.checkpoint_every_steps=0", "--set", "learner.checkpoint_every_minutes=0",
        "--assets", str(root / "assets"),
    ]  # fmt: skip
    if sync:
        cmd += ["--set", "run.max_staleness=1"]
    started = time.monotonic()
    proc = child_process.run(cmd, timeout_s=timeout_s, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"tether demo ({name}) failed:\n{proc.stdout[-3000:]}")
    return {**tether_curve(root / "runs" / name), "wall_s": time.monotonic() - started}


def rl_start(run_dir: Path) -> float:
    """When RL starts in a finished Tether run (epoch seconds): once the generator is ready (vLLM
    engine up, v0 loaded: its uptime minus its start-up, read from the run's final status
    snapshot) and the v0 held-out evaluation has finished — start-up is not RL, as TRL's model
    loading is not. The v0 evaluation runs first on the generator (its prompts precede cycle 0's):
    like TRL's blocking evaluations, it is not counted."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    v0 = min((r for r in rows if r["kind"] == "eval"), key=lambda r: r["eval_round"])
    ready = []
    for svc in json.loads((run_dir / "status.json").read_text())["services"]:
        if svc.get("service") == "generator":
            uptime = svc["heartbeat"] - svc["started"]
            ready.append(svc["started"] + uptime - sum(svc["phases"].values()))
    return max([v0["time"] - v0["seconds"], *ready, v0["time"]])


def tether_curve(run_dir: Path) -> dict[str, Any]:
    """Held-out accuracy per evaluated policy version, with the seconds from the start of RL
    (``rl_start``) to the step that made that version."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r["time"] for r in rows if r["kind"] == "step"}
    evals = sorted((r for r in rows if r["kind"] == "eval"), key=lambda r: r["eval_round"])
    t0 = evals[0]["time"] - evals[0]["seconds"]  # the v0 evaluation was dispatched
    start = rl_start(run_dir)
    curve = [
        {"step": e["eval_round"], "accuracy": e["accuracy"],
         "seconds": (steps[e["eval_round"]] - start) if e["eval_round"] else 0.0}
        for e in evals
    ]  # fmt: skip
    return {"curve": curve, "rl_start_after_v0_eval_dispatch_s": start - t0}  # start-up + v0 eval


def _trl_child(spec_path: str) -> None:
    """Child process: GRPOTrainer on the demo task with a greedy held-out evaluation callback."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    torch.manual_seed(spec["seed"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    train = read_jsonl(spec["train"])
    held_out = read_jsonl(spec["eval"])
    data, rule_reward = trl_task(train)

    prompts = [encode_prompt(tok, r["prompt"]) for r in held_out]
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (
        torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]
    ).long()

    def accuracy(m) -> float:
        was_training = m.training
        m.eval()
        with torch.no_grad():
            out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)  # fmt: skip
        m.train(was_training)
        texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
        return sum(is_correct(t, r["answer"]) for t, r in zip(texts, held_out, strict=True)) / len(
            held_out
        )

    curve: list[dict[str, float]] = []
    clock = {"start": 0.0, "eval_s": 0.0}

    class Evaluate(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            clock["start"] = time.monotonic()
            t = time.monotonic()
            curve.append({"step": 0, "accuracy": accuracy(model), "seconds": 0.0})
            clock["eval_s"] += time.monotonic() - t

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % spec["eval_every"]:
                return
            now = time.monotonic()
            acc = accuracy(model)
            curve.append({"step": state.global_step, "accuracy": acc,
                          "seconds": now - clock["start"] - clock["eval_s"],
                          "wall_seconds": now - clock["start"]})  # fmt: skip
            clock["eval_s"] += time.monotonic() - now

    args = GRPOConfig(
        output_dir=spec["out_dir"], per_device_train_batch_size=DEMO_BATCH,
        gradient_accumulation_steps=1, num_generations=GROUP, max_completion_length=MAX_TOKENS,
        temperature=TEMPERATURE, learning_rate=LR, lr_scheduler_type="constant_with_warmup",
        warmup_steps=WARMUP_STEPS, max_steps=spec["steps"], beta=0.0, loss_type="dapo",
        use_cpu=True, bf16=False, report_to="none", logging_steps=1, save_strategy="no",
        seed=spec["seed"], disable_tqdm=True,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=rule_reward, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[Evaluate()])  # fmt: skip
    trainer.train()
    Path(spec["result"]).write_text(json.dumps({"curve": curve}))


def _trl_run(root: Path, assets: Any, *, steps: int, eval_every: int, seed: int,
             timeout_s: float, threads: int | None) -> dict[str, Any]:  # fmt: skip

    work = root / "trl"
    work.mkdir(parents=True, exist_ok=True)
    spec = {"model": str(assets.model_dir), "train": str(assets.data_dir / "train.jsonl"),
            "eval": str(assets.data_dir / "eval.jsonl"), "steps": steps, "eval_every": eval_every,
            "seed": seed, "out_dir": str(work / "out"), "result": str(work / "result.json")}  # fmt: skip
    (work / "spec.json").write_text(json.dumps(spec))
    started = time.monotonic()
    code = f"from bench.quality import _trl_child; _trl_child({str(work / 'spec.json')!r})"
    proc = child_process.run(
        [sys.executable, "-c", code], timeout_s=timeout_s, env=child_env(threads)
    )
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    out = json.loads((work / "result.json").read_text())
    return {"curve": out["curve"], "wall_s": time.monotonic() - started}


def _reached(curve: list[dict[str, float]], target: float) -> dict[str, Any] | None:
    return next(({"step": p["step"], "seconds": p["seconds"],
                  "wall_seconds": p.get("wall_seconds", p["seconds"])}
                 for p in curve if p["accuracy"] >= target), None)  # fmt: skip


def run_quality_bench(
    *, target: float = 0.9, cycles: int = 12, eval_every: int = 4, seed: int = 0,
    work_dir: str | Path = "bench/work", out_path: str | Path | None = None,
    timeout_s: float = 1800, threads: int | None = 1, quick: bool = False,
    size: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run the three and report each accuracy curve and the time to ``target``."""
    del size  # one size: the demo's
    if quick:
        cycles, eval_every = 6, 4
    root = Path(work_dir).resolve() / "quality"
    assets = prepare_assets(root / "assets", seed=seed)
    stamp = int(time.time())
    runs = {
        "tether_async": _tether_run(root, f"q-async-{stamp}", cycles=cycles,
                                    eval_every=eval_every, sync=False, seed=seed,
                                    timeout_s=timeout_s),
        "tether_sync": _tether_run(root, f"q-sync-{stamp}", cycles=cycles,
                                   eval_every=eval_every, sync=True, seed=seed,
                                   timeout_s=timeout_s),
        "trl": _trl_run(root, assets, steps=2 * cycles, eval_every=eval_every, seed=seed,
                        timeout_s=timeout_s, threads=threads),
    }  # fmt: skip
    reached = {k: _reached(v["curve"], target) for k, v in runs.items()}
    result: dict[str, Any] = {
        "bench": "quality",
        "machine": machine_info(),
        "target_accuracy": target,
        "settings": {
            "optimizer_steps": 2 * cycles,
            "responses_per_step": DEMO_BATCH,
            "group": GROUP,
            "lr": LR,
            "temperature": TEMPERATURE,
            "eval_every_steps": eval_every,
            "seed": seed,
            "trl_generation": "transformers generate",
        },  # fmt: skip
        "command": "tether bench quality" + (" --quick" if quick else ""),
        **{k: {**v, "reached": reached[k]} for k, v in runs.items()},
    }
    trl_s = (reached["trl"] or {}).get("seconds")
    trl_wall = (reached["trl"] or {}).get("wall_seconds")
    for k in ("tether_async", "tether_sync"):
        mine = (reached[k] or {}).get("seconds")
        if mine and trl_s:
            result[f"ratio_trl_time_over_{k}"] = trl_s / mine
        if mine and trl_wall:  # both clocks include their evaluations
            result[f"ratio_trl_wall_over_{k}"] = trl_wall / mine
    print(format_quality(result))
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


def format_quality(r: dict[str, Any]) -> str:
    lines = [f"time to held-out accuracy >= {r['target_accuracy']:.2f} on the demo task:"]
    for k, label in (("tether_async", "Tether async"), ("tether_sync", "Tether sync"),
                     ("trl", "TRL GRPOTrainer")):  # fmt: skip
        got = r[k]["reached"]
        curve = ", ".join(f"v{p['step']} {p['accuracy']:.3f}" for p in r[k]["curve"])
        when = f"{got['seconds']:.1f} s (step {got['step']})" if got else "not reached"
        if got and k == "trl":
            when += f", {got['wall_seconds']:.1f} s with its evaluations"
        lines.append(f"  {label:16s} {when:22s} [{curve}]")
    for k in ("tether_async", "tether_sync"):
        if f"ratio_trl_time_over_{k}" in r:
            lines.append(
                f"  TRL time / {k} time: {r[f'ratio_trl_time_over_{k}']:.2f} (TRL's evaluations "
                f"excluded), {r.get(f'ratio_trl_wall_over_{k}', float('nan')):.2f} (included)"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    run_quality_bench(out_path="bench/results/quality.json")
