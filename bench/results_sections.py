"""The two generated sections at the end of ``bench/README.md`` (written by ``results_md``): the
learner's GPU path measured on a lent GPU (``bench/gpu/check.py``), and the sizing plan
(``tether plan``) computed from the measured pipeline rates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.memory import format_memory
from tether.runs.memory_plan import format_rows, memory_plan
from tether.runs.plan import (
    GPU_ASSUMED,
    ClusterShape,
    StageRates,
    gpu_rates,
    plan,
    rates_from_pipeline,
)


def _load(path: Path) -> dict[str, Any] | None:
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return r if isinstance(r, dict) and r.get("ok", True) else None


def gpu_section(gpu_dir: Path) -> str:
    """The learner's GPU path measured on a lent H100 (``bench/gpu/check.py``), if results exist."""
    env, mixed = _load(gpu_dir / "env.json"), _load(gpu_dir / "mixed.json")
    small, big = _load(gpu_dir / "learner.json"), _load(gpu_dir / "learner3b.json")
    pub = _load(gpu_dir / "publish3b.json")
    if not (env and small and big):
        return ""
    lines = [
        "## The learner on a GPU (measured)",
        "",
        f"`python bench/gpu/check.py --out DIR --steps env,nccl_same_gpu,mixed,learner,publish3b,learner3b` on a "
        f"lent {env.get('device', 'GPU')} (torch {env.get('torch')}, NCCL {env.get('nccl')}); "
        "results in `bench/results/gpu/`. The learner service ran its real GPU path: an NCCL "
        "process group (one rank), FSDP2, bf16 compute with fp32 master weights. Generation "
        "(CUDA vLLM) and the NCCL weight broadcast could not run there: the vLLM build does not "
        "fit what can be carried to that machine, and NCCL refuses two ranks on one GPU.",
        "",
        "| run | model | service | bare loop | service ÷ bare |",
        "|---|---|---|---|---|",
    ]
    for label, r in (("seed shape, 192 tok", small), ("Qwen2.5-3B shape, 3072 tok", big)):
        st = r["settings"]
        lines.append(
            f"| {label} | {st['params'] / 1e6:,.0f} M | {r['service_train_tokens_per_s']:,.0f} tok/s | "
            f"{r['bare_train_tokens_per_s']:,.0f} tok/s | {r['ratio_service_over_bare']:.2f} |"
        )
    phases = big.get("service_phase_seconds", {})
    lines += [
        "",
        f"3B shape: 120 responses × (512 + 2560) tokens per step, micro-batches of 2, gradient "
        f"checkpointing, decoupled PPO with a proximal log-prob pass (measured before one-step "
        f"cycles took those log-probs from the training forward). Per timed cycle the "
        f"service spent {phases.get('working', 0):.1f} s training and "
        f"{phases.get('syncing_weights', 0):.1f} s publishing weights.",
    ]
    if pub:
        lines.append(
            f"Publishing went from {pub['gather_dcp_fp32_s']:.1f} s to gather the fp32 weights to "
            f"CPU (torch DCP `get_model_state_dict`) to {pub['gather_bf16_staged_s']:.2f} s: the "
            f"publish now gathers in the compute dtype (bf16, {pub['bytes_bf16'] / 1e9:.1f} GB; "
            "`weights.dtype`) into two reused page-locked buffers. The rest of a publish with no "
            f"generator attached (packing, checksum) took {pub['publish_bf16_staged_s']:.1f} s. "
            "Before these changes the 3B service ÷ bare ratio was 0.76."
        )
    if mixed:
        lines.append(
            f"Mixed precision check (`mixed`): token log-probs of the bf16 and fp32 policies differ "
            f"by {mixed['logp_abs_diff_mean']:.4f} on average (max {mixed['logp_abs_diff_max']:.3f}); "
            f"eight AdamW steps raise the batch's mean log-prob from "
            f"{mixed['mean_logp_per_step']['fp32'][0]:.2f} to "
            f"{mixed['mean_logp_per_step']['fp32'][-1]:.3f} in fp32 and "
            f"{mixed['mean_logp_per_step']['mixed'][-1]:.3f} in bf16 (random-init model)."
        )
    same = _load(gpu_dir / "nccl_same_gpu.json")
    if same and "share GPU" in str(same.get("receiver")):
        lines.append(
            'With `weights.backend = "nccl"` a generator on the learner\'s own GPU is refused '
            "when it joins, with a message naming the fix (`nccl_same_gpu`), instead of NCCL's "
            '"Duplicate GPU detected" at the first broadcast.'
        )
    return "\n".join(lines) + "\n\n"


PROMPT_TOKENS = 53  # the arithmetic prompt with the chat template, byte-level tokenizer


def _plan_rows(r: dict[str, Any]) -> list[str]:
    w = r["workload"]
    rates = rates_from_pipeline(r, prompt_tokens=PROMPT_TOKENS)
    rows = []
    for mode, staleness in (("async", 1), ("sync", 0)):
        p = plan(
            rates=rates,
            shape=ClusterShape(),
            responses_per_cycle=w["responses_per_step"],
            prompt_tokens=PROMPT_TOKENS,
            response_tokens=w["response_tokens"],
            param_bytes=4 * w["params"],
            max_staleness=staleness,
        )
        measured = r[mode]["cycle_seconds"]
        rows.append(
            f"| {w['params'] / 1e6:.1f} M, {w['response_tokens']} tok, threads {r.get('threads_per_process')} | {mode} | "
            f"{p['cycle_seconds']:.1f} s ({p['bottleneck']}) | {measured:.1f} s | {measured / p['cycle_seconds']:.2f} |"
        )
    return rows


def _gpu_rates(results_dir: Path) -> tuple[dict[str, float], bool]:
    return gpu_rates(results_dir)


def _gpu_rows(gpu_rates: dict[str, float]) -> list[str]:
    rates = StageRates(**gpu_rates)
    rows = []
    for label, shape, resp in (
        ("1 gen + 1 solver + 2 learner (seed 001 layout),", ClusterShape(learner_ranks=2), 3072),
        ("seed 001 layout, mean response", ClusterShape(learner_ranks=2), 1500),
        ("2 gen + 1 solver + 1 learner,", ClusterShape(generators=2, learner_ranks=1), 3072),
    ):
        for staleness in (1, 0):
            p = plan(
                rates=rates,
                shape=shape,
                responses_per_cycle=120,
                prompt_tokens=512,
                response_tokens=resp,
                param_bytes=2 * 3_090_000_000,
                max_staleness=staleness,
            )
            st = ", ".join(f"{k} {v:.1f}" for k, v in p["stage_seconds"].items())
            rows.append(
                f"| {label} {resp} tok | {p['mode']} | {st} | {p['cycle_seconds']:.0f} s | {p['bottleneck']} |"
            )
    return rows


def plan_section(results_dir: Path) -> str:
    """ "Scale on paper": the `tether.runs.plan` model checked against the CPU runs, then the GPU guess."""
    lines = [
        "## Scale on paper (`tether/runs/plan.py`)",
        "",
        "`plan(rates=StageRates(...), shape=ClusterShape(...), responses_per_cycle, prompt_tokens,",
        "response_tokens, param_bytes, max_staleness)` predicts each stage's seconds per cycle",
        "(generate, score, train, weight sync), the cycle time — sync: their sum; async (one cycle of",
        "overlap): the slowest lane, `max(generate + sync, score, train + sync)`, each stage on its",
        "own hardware — and the bottleneck. `rates_from_pipeline` derives the rates from a pipeline",
        "result's *sync* run (stages one after another). Check against the CPU measurements",
        "(ratio > 1: slower than the model predicts):",
        "",
        "| run | mode | predicted cycle (bottleneck) | measured | measured / predicted |",
        "|---|---|---|---|---|",
    ]
    for f in sorted(Path(results_dir).glob("pipeline*.json")):
        try:
            lines += _plan_rows(json.loads(f.read_text()))
        except (ValueError, KeyError):
            continue
    gpu_rates, measured_train = _gpu_rates(results_dir)
    train_note = (
        "measured on one H100 (the learner service at this shape, gradient checkpointing, "
        "decoupled PPO; the section above; the FLOP-based guess was "
        f"{GPU_ASSUMED['train_tokens_per_s']:,.0f})"
        if measured_train
        else "assumed"
    )
    lines += [
        "",
        "Two things separate prediction and measurement on this CPU. All services share two cores,",
        "so a stage running concurrently with another gets less CPU than it had in the sync run",
        "(the async prediction is then optimistic); and other jobs change the load between and",
        "within runs — one stalled cycle in the sync run inflates its stage times (the prediction",
        "is then pessimistic). A perfect pipeline needs each stage on its own device: the GPU case.",
        "",
        "**GPUs**: Qwen2.5-3B, 120 responses per step, 512-token prompts, one H100 per role. "
        f"Train {gpu_rates['train_tokens_per_s']:,.0f} tokens/s per FSDP rank, {train_note}, "
        "0.9 efficiency per doubling of ranks. Assumed, not measured (no CUDA vLLM or second "
        f"GPU was available): generate {gpu_rates['generate_tokens_per_s']:.0f} tokens/s per vLLM "
        f"replica, batched solver scorer {gpu_rates['score_responses_per_s']:.0f} responses/s, "
        f"weight publish {gpu_rates['sync_bytes_per_s'] / 1e9:.0f} GB/s (6.2 GB bf16).",
        "",
        "| layout | mode | stage seconds | cycle | bottleneck |",
        "|---|---|---|---|---|",
        *_gpu_rows(gpu_rates),
        "",
        "In the seed 001 layout Tether's step would be bound by generation (one vLLM GPU for 120 ×",
        "3072 tokens); with the solver batched the reward stage is no longer the 2,700 s/step",
        "bottleneck the seed describes. Moving one learner GPU to a second generator balances the",
        "stages better. `tether plan` prints these and the balancing split for any shape; re-derive",
        "with measured GPU rates: `tether bench pipeline` on the cluster, then",
        "`tether plan --from-pipeline <its JSON>`.",
        "",
    ]
    return "\n".join(lines)


def memory_section(results_dir: Path) -> str:
    """Each rank's memory (`tether bench memory`) and the plan beyond this machine
    (`tether plan --memory`), if the benchmark has run."""
    r = _load(results_dir / "memory.json") or _load(results_dir / "memory_quick.json")
    if not r:
        return ""
    load = r.get("machine", {}).get("load_average", [float("nan")])[0]
    kw: dict[str, Any] = dict(
        ranks=8, gpu_gib=79.0, host_limit_gib=128.0, tokens_per_micro_batch=4096
    )
    models = ["qwen2.5-7b", "qwen3-32b", "qwen3-30b-a3b"]
    lines = [
        "## The learner's memory per rank (measured, then planned)",
        "",
        f"`tether bench memory{' --quick' if r['shape'] == 'quick' else ''}` (load average "
        f"{load:.1f}, commit {r.get('git_commit', '?')[:10]}{' dirty' if r.get('git_dirty') else ''}): "
        f"a random model of the {r['shape']} shape ({r['weights_fp32_bytes'] / 2**30:.2f} GiB in "
        f"fp32) on 1 and on 2 gloo ranks of this CPU, one micro-batch of {r['seq_per_rank']} "
        "tokens per rank, each phase's peak measured by the rank itself (`VmHWM`, reset per "
        "phase; in brackets the sampled peak of anonymous memory, without the shared libraries "
        "and memory-mapped files `VmHWM` also counts; `bench/memory_worker.py`):",
        "",
        format_memory(r),
        "",
        "`tether plan --memory` then applies the same terms (`tether/runs/memory_plan.py`) to the "
        "models users train, on 8 GPUs of 80 GB (79 GiB usable), one rank per pod as "
        "`deploy/k8s/learner.yaml` places them (its limit: 128 GiB of host memory per pod), "
        "4096 tokens per micro-batch:",
        "",
        format_rows(
            memory_plan(models, ranks_per_node=1, reference=False, **kw),
            gpu_gib=79.0,
            host_limit_gib=128.0,
        ),  # fmt: skip
        "",
        "With a reference model (`learner.kl_coef > 0`; offloaded with the policy where offload is on) "
        "and all 8 ranks in one pod (`--ranks-per-node 8 --reference`):",
        "",
        format_rows(
            memory_plan(models, ranks_per_node=8, reference=True, **kw),
            gpu_gib=79.0,
            host_limit_gib=128.0,
        ),  # fmt: skip
        "",
    ]
    return "\n".join(lines) + "\n"
