"""`tether plan`: predict cycle time and the bounding stage for a cluster shape (``tether.runs.plan``)
from measured or assumed per-stage rates, and the generator:learner split that balances them.
`tether plan --memory`: each learner rank's GPU and host memory for the models users train, with
and without CPU offload (``tether.runs.memory_plan``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_plan_verb(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="predict cycle time and the bottleneck stage for a cluster shape, and the "
        "generator:learner split that balances them",
        description=__doc__,
    )
    shape = p.add_argument_group("cluster shape")
    shape.add_argument("--generators", type=int, default=1, help="vLLM replicas (default 1)")
    shape.add_argument("--scorers", type=int, default=1, help="scorer replicas (default 1)")
    shape.add_argument(
        "--learner-ranks", type=int, default=None, help="FSDP ranks (default 2; --memory: 8)"
    )
    shape.add_argument(
        "--scaling", type=float, default=0.9, help="learner throughput kept per doubling of ranks"
    )
    shape.add_argument(
        "--weights-fanout",
        choices=["chain", "pairwise"],
        default="chain",
        help="how weights reach the generators (weights.fanout): chain = the learner sends "
        "them once, pairwise = once per generator (default chain)",
    )
    work = p.add_argument_group("workload (default: the seed 001 shape on Qwen2.5-3B)")
    work.add_argument("--responses", type=int, default=120, help="responses per cycle")
    work.add_argument("--prompt-tokens", type=int, default=512)
    work.add_argument("--response-tokens", type=int, default=3072)
    work.add_argument("--params", type=float, default=3.09e9, help="model parameters")
    work.add_argument(
        "--bytes-per-param", type=float, default=2.0, help="published weight bytes (bf16: 2)"
    )
    work.add_argument("--steps-per-cycle", type=int, default=1, help="optimizer steps per cycle")
    work.add_argument(
        "--responses-per-prompt", type=int, default=4, help="group size (prompts = responses / it)"
    )
    ckpt = p.add_argument_group("checkpoints (Redis holds scored groups until one covers them)")
    ckpt.add_argument(
        "--checkpoint-every-minutes",
        type=float,
        default=30.0,
        help="learner.checkpoint_every_minutes (default 30; 0 = off)",
    )
    ckpt.add_argument(
        "--checkpoint-every-steps",
        type=int,
        default=0,
        help="learner.checkpoint_every_steps (default 0 = off)",
    )
    rates = p.add_argument_group("rates (default: Qwen2.5-3B on H100s; see bench/README.md)")
    rates.add_argument(
        "--from-pipeline",
        metavar="JSON",
        help="take the rates from a `tether bench pipeline` result measured on your hardware",
    )
    rates.add_argument("--generate-tps", type=float, help="response tokens/s per generator")
    rates.add_argument("--score-rps", type=float, help="responses/s per scorer")
    rates.add_argument("--train-tps", type=float, help="prompt+response tokens/s per learner rank")
    rates.add_argument("--sync-gbps", type=float, help="weight publish GB/s")
    mem = p.add_argument_group("memory (--memory)")
    mem.add_argument(
        "--memory",
        action="store_true",
        help="plan each learner rank's GPU and host memory instead of the cycle time",
    )
    mem.add_argument(
        "--models",
        default="qwen2.5-7b,qwen3-32b,qwen3-30b-a3b",
        help="comma-separated: qwen2.5-0.5b, qwen2.5-7b, qwen3-32b, qwen3-30b-a3b",
    )
    mem.add_argument("--gpu-gib", type=float, default=79.0, help="GPU memory (80 GB card: 79)")
    mem.add_argument(
        "--ranks-per-node",
        type=int,
        default=1,
        help="learner ranks per pod (deploy/k8s/learner.yaml: one GPU per pod)",
    )
    mem.add_argument(
        "--host-limit-gib",
        type=float,
        default=128.0,
        help="a learner pod's memory limit (deploy/k8s/learner.yaml: 128Gi)",
    )
    mem.add_argument(
        "--reference", action="store_true", help="a frozen reference model too (kl_coef > 0)"
    )
    mem.add_argument("--tokens-per-micro-batch", type=int, default=4096)
    mem.add_argument(
        "--async-checkpoint",
        action="store_true",
        help="learner.async_checkpoint: a host copy of the model states while a save is written",
    )
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    p.set_defaults(func=run_plan)


def run_memory_plan(args: argparse.Namespace) -> int:
    from tether.runs.memory_plan import format_rows, memory_plan

    try:
        rows = memory_plan([m.strip() for m in args.models.split(",") if m.strip()],
                           ranks=args.learner_ranks or 8, gpu_gib=args.gpu_gib,
                           ranks_per_node=args.ranks_per_node,
                           host_limit_gib=args.host_limit_gib, reference=args.reference,
                           tokens_per_micro_batch=args.tokens_per_micro_batch,
                           async_checkpoint=args.async_checkpoint)  # fmt: skip
    except ValueError as exc:
        print(f"tether plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"{args.learner_ranks or 8} FSDP ranks, {args.ranks_per_node} per pod, "
        f"{args.tokens_per_micro_batch} tokens per micro-batch, gradient checkpointing, bf16 "
        f"compute with fp32 master weights{', a reference model' if args.reference else ''}"
        f"{', async checkpoints' if args.async_checkpoint else ''}; "
        "GPU fits = within 90 % of it (tether/runs/memory_plan.py says what each term is)"
    )
    print(format_rows(rows, gpu_gib=args.gpu_gib, host_limit_gib=args.host_limit_gib))
    return 0


def _rates(args: argparse.Namespace) -> tuple[Any, str]:
    from tether.runs.plan import StageRates, gpu_rates, rates_from_pipeline

    if args.from_pipeline:
        result = json.loads(Path(args.from_pipeline).read_text())
        base = rates_from_pipeline(result, prompt_tokens=args.prompt_tokens).__dict__
        source = f"measured by `tether bench pipeline` ({args.from_pipeline})"
    else:
        base, measured = gpu_rates()
        source = "Qwen2.5-3B on H100s: " + (
            "train rate measured, the others assumed" if measured else "assumed"
        )
    given = {
        "generate_tokens_per_s": args.generate_tps,
        "score_responses_per_s": args.score_rps,
        "train_tokens_per_s": args.train_tps,
        "sync_bytes_per_s": args.sync_gbps * 1e9 if args.sync_gbps is not None else None,
    }
    if any(v is not None for v in given.values()):
        source += "; overridden: " + ", ".join(k for k, v in given.items() if v is not None)
    return StageRates(**{**base, **{k: v for k, v in given.items() if v is not None}}), source


def run_plan(args: argparse.Namespace) -> int:
    from tether.runs.plan import ClusterShape, best_split, held_memory, plan

    if args.memory:
        return run_memory_plan(args)
    args.learner_ranks = args.learner_ranks or 2
    try:
        rates, source = _rates(args)
        work = {
            "responses_per_cycle": args.responses,
            "prompt_tokens": args.prompt_tokens,
            "response_tokens": args.response_tokens,
            "param_bytes": int(args.params * args.bytes_per_param),
            "train_steps_per_cycle": args.steps_per_cycle,
        }
        shape = ClusterShape(generators=args.generators, scorers=args.scorers,
                             learner_ranks=args.learner_ranks,
                             learner_scaling_efficiency=args.scaling,
                             weights_fanout=args.weights_fanout)  # fmt: skip
        modes = {
            "async": plan(rates=rates, shape=shape, **work),
            "sync": plan(rates=rates, shape=shape, max_staleness=args.steps_per_cycle - 1, **work),
        }
        gpus = args.generators + args.learner_ranks
        splits = best_split(total_gpus=gpus, rates=rates, scorers=args.scorers,
                            scaling=args.scaling, **work) if gpus >= 2 else []  # fmt: skip
        memory = held_memory(
            cycle_seconds=modes["async"]["cycle_seconds"],
            responses_per_cycle=args.responses,
            prompts_per_cycle=max(1, args.responses // max(1, args.responses_per_prompt)),
            prompt_tokens=args.prompt_tokens,
            response_tokens=args.response_tokens,
            train_steps_per_cycle=args.steps_per_cycle,
            checkpoint_every_minutes=args.checkpoint_every_minutes,
            checkpoint_every_steps=args.checkpoint_every_steps,
        )
    except (ValueError, OSError, KeyError) as exc:
        print(f"tether plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"rates": rates.__dict__, "source": source, **modes,
                          "splits": splits, "redis_memory": memory}, indent=2))  # fmt: skip
        return 0
    print(f"rates: {source}")
    print(
        f"  generate {rates.generate_tokens_per_s:,.0f} tok/s per generator, score "
        f"{rates.score_responses_per_s:,.1f} resp/s per scorer, train "
        f"{rates.train_tokens_per_s:,.0f} tok/s per rank, publish {rates.sync_bytes_per_s / 1e9:.1f} GB/s"
    )
    print(
        f"shape: {args.generators} generator(s), {args.scorers} scorer(s), {args.learner_ranks} "
        f"learner rank(s); {args.responses} responses × ({args.prompt_tokens} + "
        f"{args.response_tokens}) tokens per cycle"
    )
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in modes["async"]["stage_seconds"].items())
    print(f"stages: {stages}")
    for name, m in modes.items():
        print(
            f"{name:5s}: {m['cycle_seconds']:.1f} s per cycle, {m['responses_per_s']:.2f} "
            f"responses/s, bound by {m['bottleneck']}"
        )
    print(_memory_line(memory, args))
    if splits:
        best = splits[0]
        print(
            f"best split of these {gpus} devices (async): {best['generators']} generator(s) + "
            f"{best['learner_ranks']} learner rank(s), {best['cycle_seconds']:.1f} s per cycle, "
            f"bound by {best['bottleneck']}"
        )
    return 0


def _memory_line(memory: dict[str, Any], args: argparse.Namespace) -> str:
    """How Redis memory grows with the checkpoint cadence (``plan.held_memory``)."""
    per = memory["bytes_per_cycle"] / 1e6
    head = f"redis: scored groups held until a checkpoint, {per:,.1f} MB per cycle"
    if memory["peak_bytes"] is None:
        return (
            f"{head}; no checkpoint before the end (checkpoint_every_minutes and _steps 0): it "
            f"grows with the run, {per * 1000 / 1e3:,.1f} GB after 1,000 cycles"
        )
    cadence = " or ".join(
        x
        for x in (
            f"{args.checkpoint_every_minutes:g} min" if args.checkpoint_every_minutes else "",
            f"{args.checkpoint_every_steps} steps" if args.checkpoint_every_steps else "",
        )
        if x
    )
    return (
        f"{head}; a checkpoint every {cadence} ≈ {memory['cycles_between_checkpoints']} cycles: "
        f"≈ {memory['peak_bytes'] / 1e6:,.0f} MB at the peak (and at most that much training "
        "repeated after a restart)"
    )
