"""Verbs beyond config and the services: demo, bus, bench, export. Heavy imports stay inside."""

from __future__ import annotations

import argparse
from collections.abc import Callable

AddConfigArgs = Callable[[argparse.ArgumentParser], None]


def _cmd_demo(args: argparse.Namespace) -> int:
    from common.demo import main as demo_main

    return demo_main(args)


def _cmd_bus_inspect(args: argparse.Namespace) -> int:
    import json

    from common.bus.inspect import format_inspect, inspect_bus
    from common.bus.settings import bus_settings_for
    from common.cli import load_from_args

    cfg = load_from_args(args).config
    report = inspect_bus(bus_settings_for(cfg, redis_url=cfg.run.redis_url or None))
    print(json.dumps(report, indent=2, default=str) if args.json else format_inspect(report))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    import sys

    from services.learner.export import export_hf

    try:
        out = export_hf(args.checkpoint, args.out, tokenizer_dir=args.tokenizer)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tether export: {exc}", file=sys.stderr)
        return 2
    print(f"exported a Hugging Face model directory to {out} (loads with transformers and vLLM)")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from common.bench.runner import run_bench

    return run_bench(args)


def add_more_verbs(sub: argparse._SubParsersAction, add_config_args: AddConfigArgs) -> None:
    demo = sub.add_parser(
        "demo",
        help="the embedded default: build a tiny model and task, run Tether end to end on this CPU",
    )
    add_config_args(demo)
    demo.add_argument(
        "--assets",
        metavar="DIR",
        default=None,
        help="where the tiny model, task files and warm-up go (default: <run dir>/assets); "
        "runs that name the same directory share one warm-up",
    )
    demo.set_defaults(func=_cmd_demo)

    bus = sub.add_parser(
        "bus", help="inspect the trajectory bus (streams, groups, lag, dead letters)"
    )
    bus_sub = bus.add_subparsers(dest="bus_verb", metavar="ACTION", required=True)
    insp = bus_sub.add_parser("inspect", help="streams, groups, lag, pending, dead-letter counts")
    add_config_args(insp)
    insp.add_argument("--json", action="store_true", help="machine-readable output")
    insp.set_defaults(func=_cmd_bus_inspect)

    from common.cli_status import add_status_verbs

    add_status_verbs(sub, add_config_args)

    exp = sub.add_parser(
        "export", help="write a Hugging Face model directory from a checkpoint or run directory"
    )
    exp.add_argument(
        "checkpoint", help="runs/NAME, runs/NAME/checkpoints or runs/NAME/checkpoints/step-N"
    )
    exp.add_argument("out", help="new, empty output directory")
    exp.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory (default: the model the run started from)",
    )
    exp.set_defaults(func=_cmd_export)

    bench = sub.add_parser(
        "bench", help="benchmarks: ratios measured side by side, JSON under bench/results/"
    )
    bench.add_argument(
        "what",
        choices=[
            "bus",
            "weights",
            "scorer",
            "generator",
            "learner",
            "pipeline",
            "peer",
            "quality",
            "all",
        ],
        help="which benchmark",
    )
    bench.add_argument(
        "--size",
        choices=["quick", "medium", "full"],
        default=None,
        help="workload preset for pipeline/peer (default: full, or quick with --quick)",
    )
    bench.add_argument(
        "--threads", type=int, default=None, help="OpenMP threads per benchmarked process"
    )
    bench.add_argument(
        "--work-dir", default="bench/work", help="where models and run directories are built"
    )
    bench.add_argument("--out", default="bench/results", help="directory for JSON results")
    bench.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    bench.set_defaults(func=_cmd_bench)
