"""`tether demo`, `tether export` and `tether bench`. Heavy imports stay inside the handlers."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from tether.cli.args import add_config_args, config_flags

BENCHMARKS = (
    "bus", "weights", "scorer", "generator", "episodes", "learner", "pipeline", "peer", "quality",
    "staleness", "reproducibility", "models", "memory", "lora", "demos", "replay", "race",
)  # fmt: skip
DEMO_KINDS = (
    "arithmetic",
    "arithmetic-lora",
    "tools",
    "tools-agent",
    "smollm2",
    "smollm2-tools",
)  # bench.demos.KINDS
NOT_IN_A_CLONE = (
    "tether bench: the benchmarks live in bench/ of a clone of the Tether repository and are not "
    "installed with the package. Clone it, then run `make bench`, or `python -m tether.cli bench "
    "...` from the clone's top directory."
)
CLONE = Path(__file__).resolve().parents[2]  # the clone's top directory, when this runs from one


def _seeds(text: str) -> tuple[int, ...]:
    """``--seeds 0,1,2``: distinct seeds >= 0 (argparse turns the error into exit 2)."""
    try:
        seeds = tuple(int(x) for x in text.split(","))
    except ValueError:
        seeds = ()
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give distinct seeds >= 0 separated by commas, e.g. 0,1,2"
        )
    return seeds


def _families(text: str) -> tuple[str, ...]:
    """``--families llama3,smollm2-135m``: distinct names (which exist, `tether bench` checks)."""
    names = tuple(x.strip() for x in text.split(","))
    if not all(names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give distinct family names separated by commas, e.g. smollm2-135m,llama3"
        )
    return names


def _warmup_steps(text: str) -> int:
    """``--warmup-steps 100``: a whole number of steps >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of steps >= 1, e.g. 100")
    return int(text)


def _demo(args: argparse.Namespace) -> int:
    from tether.demo.run import run_demo

    return run_demo(
        config_file=args.config,
        overrides=args.set,
        flags=config_flags(args),
        assets=args.assets,
        task=args.task,
        agent=args.agent,
        warmup_steps=args.warmup_steps,
    )


def _export(args: argparse.Namespace) -> int:
    from tether.runs.launcher import export_checkpoint

    try:
        out = export_checkpoint(
            args.checkpoint, args.out, tokenizer_dir=args.tokenizer, shard_mb=args.shard_mb
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"tether export: {exc}", file=sys.stderr)
        return 2
    print(f"exported a Hugging Face model directory to {out} (loads with transformers and vLLM)")
    return 0


def bench_on_path(clone: Path = CLONE) -> bool:
    """Whether ``bench`` can be imported, putting the clone this command runs from on the path
    when it is one. The benchmarks are not part of the installed package: ``python -m tether.cli``
    from the clone's top directory finds them already; the ``tether`` script of an editable
    install does not (the install maps only tether/, common/ and services/), so the clone beside
    ``tether/`` is added to the path. Outside a clone (an installed wheel) this is False."""
    if importlib.util.find_spec("bench") is not None:
        return True
    if not (clone / "bench" / "runner.py").is_file():
        return False
    sys.path.insert(0, str(clone))
    return True


def _bench(args: argparse.Namespace) -> int:
    if not bench_on_path():
        print(NOT_IN_A_CLONE, file=sys.stderr)
        return 2
    # Imported here: bench/ exists only in a clone, never in the installed wheel (bench_on_path).
    from bench.runner import run_bench

    return int(run_bench(args))


def _number_over(least: float, asks: str):
    """An argparse type: a number over ``least``; otherwise the error (argparse turns it into
    exit 2) names ``asks``, what to give."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = least
        if not value > least:
            raise argparse.ArgumentTypeError(f"{text!r}: give {asks}")
        return value

    return parse


# --hosts-mbit R and --slow-link F
_link_mbit = _number_over(0, "each emulated host's link rate in Mbit/s, a number > 0, e.g. 200")
_slowdown = _number_over(1, "how many times slower one generator's link is, a number > 1, e.g. 10")


def add_tool_verbs(sub: argparse._SubParsersAction) -> None:
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
    demo.add_argument(
        "--task",
        choices=("arithmetic", "tools", "smollm2", "smollm2-tools"),
        default="arithmetic",
        help="arithmetic (default): column addition, RL fixes a sloppy teacher's carries; "
        "tools: products of 3- and 4-digit numbers, RL learns to use the calculator; "
        "smollm2: a real pretrained model (SmolLM2-135M-Instruct, staged from the package "
        "registry once), grade-school arithmetic with no warm-up; smollm2-tools: the same model, "
        "the products and the calculator, with no teacher",
    )
    demo.add_argument(
        "--agent",
        action="store_true",
        help="with --task tools: run the episodes as user code through the generator's "
        "OpenAI-compatible endpoint (tether/demo/tool_agent.py) instead of the built-in loop",
    )
    demo.add_argument(
        "--warmup-steps",
        type=_warmup_steps,
        metavar="N",
        default=None,
        help="cap each stage of the tiny model's supervised warm-up at N steps: a quicker, "
        "weaker start than the README's runs (arithmetic: 300 steps; tools: up to 800 + 100)",
    )
    demo.set_defaults(func=_demo)

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
    exp.add_argument(
        "--shard-mb",
        type=float,
        default=2048.0,
        help="largest weight file in MB; tensors are read one at a time and written as each "
        "file fills, so this (and one decoder layer) is what the export holds in memory",
    )
    exp.set_defaults(func=_export)

    bench = sub.add_parser(
        "bench",
        help="benchmarks, from a clone of the repository (bench/ is not installed): ratios "
        "measured side by side, JSON under bench/results/",
    )
    bench.add_argument("what", choices=[*BENCHMARKS, "all"], help="which benchmark")
    bench.add_argument(
        "--size",
        choices=["quick", "medium", "full", "tests", "s4", "smoke", "slice", "lora", "scale"],
        default=None,
        help="workload preset for pipeline/peer (quick, medium, full); staleness: full (the "
        "pre-registered study, 21 arms × 8 seeds), tests (its 7 arms of the pre-registered tests "
        "× 8 seeds), s4 (those and every other S = 4 arm: 14 arms × 8 seeds), slice (4 of its "
        "arms × 2 seeds, to time it) or "
        "smoke (every arm kind once, a few minutes); memory: full (default), lora (a LoRA "
        "policy, 1 vs 2 ranks) or scale (the 32B shapes under fake tensors, world size 8, "
        "against `tether plan --memory`) "
        "(default: full, or the smallest with --quick)",
    )
    bench.add_argument(
        "--threads", type=int, default=None, help="OpenMP threads per benchmarked process"
    )
    bench.add_argument(
        "--work-dir", default="bench/work", help="where models and run directories are built"
    )
    bench.add_argument(
        "--generators",
        default=None,
        metavar="N,N,...",
        help="weights: numbers of receiving generators to publish to, chain against pairwise "
        "(default 1,2,4; 1,2 with --quick)",
    )
    bench.add_argument(
        "--hosts-mbit",
        type=_link_mbit,
        default=None,
        metavar="R",
        help="weights: the learner and each generator on an emulated host of its own (a network "
        "namespace, needs root), each link shaped to R Mbit/s; publish seconds at N = 1,2,4,8 "
        "down the chain against pairwise, to <out>/weights_hosts.json",
    )
    bench.add_argument(
        "--slow-link",
        type=_slowdown,
        default=None,
        metavar="F",
        help="weights with --hosts-mbit: instead, three generators on links of R Mbit/s and one "
        "on a link F times slower; publish seconds with weights.slow_link_fraction on, on "
        "again (the control) and off, against the three alone, to "
        "<out>/weights_slow_link.json",
    )
    bench.add_argument(
        "--lr",
        type=float,
        default=None,
        help="staleness: replace the design's learning rate (a different study, with its own "
        "runs; results go to staleness[_smoke]_lrLR.json)",
    )
    bench.add_argument(
        "--kind",
        choices=DEMO_KINDS,
        default=None,
        help="demos: which `tether demo` to run (default arithmetic); results go to "
        "<out>/demos/<kind>.json",
    )
    bench.add_argument(
        "--seeds",
        type=_seeds,
        default=None,
        metavar="N,N,...",
        help="demos: the seeds to run (default: the kind's table's, e.g. 0,1,2,3,4,5 for tools); "
        "runs of other seeds at the same clean commit already in the file are kept. race: the "
        "seeds to run (default 0)",
    )
    bench.add_argument(
        "--families",
        type=_families,
        default=None,
        metavar="NAME,NAME,...",
        help="models: only these families (default: every one, the fixture families of "
        "fixtures/model_families.py and smollm2-135m, the real pretrained model; with --quick the "
        "fixture families only); results go to <out>/models_NAME+NAME.json, so models.json keeps "
        "every family's row",
    )
    bench.add_argument("--out", default="bench/results", help="directory for JSON results")
    bench.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    bench.set_defaults(func=_bench)
