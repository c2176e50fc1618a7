"""`tether bench WHAT [--out DIR] [--quick]`: run benchmarks, write JSON, regenerate their README.

Every benchmark measures Tether's path and a baseline in the same run; each writes
``<out>/<what>[_quick].json``, stamped with the clone's git commit and dirty flag
(``bench.provenance``). ``all`` runs every benchmark whose module exists. Then the README of
every JSON file in ``<out>`` is written: ``bench/README.md`` for the clone's own
``bench/results``, ``<out>/README.md`` for any other folder (never a file outside the folder
the user named). SIGTERM, SIGHUP and Ctrl-C stop a benchmark the way an error does: what it
started (servers, services, worker processes) is stopped on the way out.
"""

from __future__ import annotations

import importlib
import logging
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.provenance import CLONE, git_state, stamp
from bench.real_models import family_names
from bench.results_md import write_readme
from bench.staleness_design import OF_RECORD
from bench.workload import machine_info

log = logging.getLogger(__name__)


class Interrupted(KeyboardInterrupt):
    """A benchmark was told to stop (SIGTERM, SIGHUP): raised where it runs, so every
    ``finally`` and ``with`` on the way out stops what it started."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signal.Signals(signum).name}")
        self.signum = signum


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into ``Interrupted`` while benchmarks run (Ctrl-C already raises
    KeyboardInterrupt); the previous handlers come back afterwards."""

    def interrupt(signum: int, _frame: Any) -> None:
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def readme_for(out_dir: Path) -> Path:
    """Where the README of the results in ``out_dir`` goes: the clone's bench/README.md for its
    own bench/results, else ``out_dir/README.md`` (inside the folder the user named)."""
    if out_dir.resolve() == (CLONE / "bench" / "results").resolve():
        return CLONE / "bench" / "README.md"
    return out_dir / "README.md"


ORDER = (
    "bus", "weights", "scorer", "generator", "episodes", "learner", "pipeline", "peer", "quality",
    "staleness", "reproducibility", "models", "memory", "lora", "demos", "replay", "race",
)  # fmt: skip


def _quick_kwargs(what: str, quick: bool) -> dict[str, Any]:
    if not quick:
        return {}
    presets: dict[str, dict[str, Any]] = {
        "bus": {"n_messages": 50, "repeats": 1},
        "weights": {"total_mb": 64, "repeats": 2, "pair_repeats": 2},
        "scorer": {"rule_items": 400, "answer_tokens": (0, 64)},
        "generator": {"max_tokens": 32, "rounds": 1, "hidden_size": 128, "num_layers": 2},
        "episodes": {"prompts": 8, "n": 4, "rounds": 1},
        "learner": {
            "cycles": 3,
            "prompts": 8,
            "response_tokens": 64,
            "hidden": 128,
            "layers": 2,
            "repeats": 1,
        },
        "pipeline": {"quick": True},
        "peer": {"quick": True},
        "quality": {"quick": True},
        "staleness": {"size": "smoke"},
        "reproducibility": {"quick": True},
        "models": {"quick": True},
        "memory": {"quick": True},
        "lora": {"quick": True, "steps": 2, "repeats": 2},
        "demos": {"quick": True},
        "replay": {"quick": True},
        "race": {"quick": True},
    }
    return presets[what]


def _bench_fn(what: str) -> Callable[..., dict[str, Any]] | None:
    """``bench.<what>.run_<what>_bench``, or None when that module is not written yet."""
    try:
        mod = importlib.import_module(f"bench.{what}")
    except ModuleNotFoundError as exc:
        if exc.name == f"bench.{what}":
            return None
        raise
    return getattr(mod, f"run_{what}_bench", None)


def run_one(
    what: str,
    *,
    out_dir: Path,
    quick: bool,
    work_dir: Path,
    reuse: dict[str, Any] | None = None,
    threads: int | None = None,
    size: str | None = None,
    generators: tuple[int, ...] = (),
    lr: float | None = None,
    kind: str | None = None,
    seeds: tuple[int, ...] | None = None,
    hosts_mbit: float | None = None,
    families: tuple[str, ...] = (),
    slow_link: float | None = None,
) -> dict[str, Any] | None:
    fn = _bench_fn(what)
    if fn is None:
        log.warning(
            "bench %s: module bench.%s (run_%s_bench) not available; skipped",
            what,
            what,
            what,
        )
        return None
    e2e = what in ("pipeline", "peer", "quality", "staleness", "reproducibility")
    suffix = f"_{size}" if size and e2e else "_quick" if quick else ""
    if what == "staleness":  # the study of record is staleness.json, a smaller one _smoke / _slice
        suffix = "" if (size or "full") in OF_RECORD and not quick else f"_{size or 'smoke'}"
    if what == "memory" and size in ("lora", "scale"):
        suffix = f"_{size}" + ("_quick" if quick else "")
    suffix += f"_t{threads}" if threads and e2e else ""
    suffix += f"_lr{lr:g}" if lr is not None and what == "staleness" else ""
    out = out_dir / f"{what}{suffix}.json"
    hosts_mbit = hosts_mbit if what == "weights" else None
    slow_link = slow_link if hosts_mbit else None
    if hosts_mbit:  # the chain on emulated hosts (bench.weights_hosts): a result of its own
        name = "weights_slow_link" if slow_link else "weights_hosts"  # bench.weights_slow_link
        out = out_dir / f"{name}{'_quick' if quick else ''}.json"
    if what == "demos":  # one file per demo kind, each a README table (bench.demos_report)
        out = out_dir / "demos" / f"{kind or 'arithmetic'}{'_quick' if quick else ''}.json"
    families = families if what == "models" else ()
    if families:  # a file of its own: models.json, the full result, keeps every family's row
        out = out_dir / f"models_{'+'.join(families)}{'_quick' if quick else ''}.json"
    kwargs = _quick_kwargs(what, quick)
    if e2e:
        kwargs["work_dir"] = work_dir
        kwargs["threads"] = threads
        kwargs["size"] = size
    if what in ("models", "learner", "episodes", "memory", "lora", "demos", "replay", "race"):
        kwargs["work_dir"] = work_dir
    if what == "race":
        kwargs.update(seeds=seeds, threads=threads)
    if what == "memory" and size:
        kwargs["mode"] = size
    if what == "demos":
        kwargs.update(kind=kind, seeds=seeds)
    if families:
        kwargs["families"] = list(families)
    if what == "peer" and reuse is not None:
        kwargs["tether_result"] = reuse
    if what == "weights" and generators:
        kwargs["generators"] = generators
    if hosts_mbit:
        kwargs.update(hosts_mbit=hosts_mbit, work_dir=work_dir, quick=quick, slow_link=slow_link)
    if what == "staleness" and lr is not None:
        kwargs["lr"] = lr
    if what == "staleness" and size is None and quick:
        kwargs["size"] = "smoke"

    machine = machine_info()  # its load average is the load when the benchmark started
    result = fn(out_path=out, **kwargs)
    command = command_line(what, quick=quick, size=size, threads=threads, generators=generators,
                           lr=lr, kind=kind, seeds=seeds, hosts_mbit=hosts_mbit,
                           families=families, slow_link=slow_link)  # fmt: skip
    stamp(out, git_state(), command=command, machine=machine)
    if isinstance(result, dict):
        result.setdefault("git", git_state())
    return result


def command_line(
    what: str, *, quick: bool = False, size: str | None = None, threads: int | None = None,
    generators: tuple[int, ...] = (), lr: float | None = None, kind: str | None = None,
    seeds: tuple[int, ...] | None = None, hosts_mbit: float | None = None,
    families: tuple[str, ...] = (), slow_link: float | None = None,
) -> str:  # fmt: skip
    """The ``tether bench`` command that runs ``what`` with these settings."""
    parts = ["tether bench", what]
    parts += ["--quick"] if quick else []
    parts += [f"--size {size}"] if size else []
    parts += [f"--threads {threads}"] if threads else []
    parts += (
        [f"--generators {','.join(map(str, generators))}"]
        if what == "weights" and generators and not slow_link  # three and one with --slow-link
        else []
    )
    parts += [f"--hosts-mbit {hosts_mbit:g}"] if hosts_mbit and what == "weights" else []
    parts += [f"--slow-link {slow_link:g}"] if slow_link and hosts_mbit else []
    parts += [f"--lr {lr:g}"] if lr is not None and what == "staleness" else []
    parts += [f"--kind {kind}"] if kind and what == "demos" else []
    parts += [f"--seeds {','.join(map(str, seeds))}"] if seeds and what in ("demos", "race") else []
    parts += [f"--families {','.join(families)}"] if families and what == "models" else []
    return " ".join(parts)


def families_problem(what: str, families: tuple[str, ...]) -> str:
    """Why ``--families`` cannot be run as given ("" when it can)."""
    if not families:
        return ""
    if what != "models":
        return f"--families picks the families of `tether bench models`, not of {what}; drop it"

    known = family_names()
    unknown = [f for f in families if f not in known]
    if unknown:
        return f"--families: no family {', '.join(unknown)}; choose from {', '.join(known)}"
    return ""


def _generators(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise ValueError(f"--generators {text!r}: give counts >= 1 separated by commas, e.g. 1,2,4")
    return counts


def run_bench(args: Any) -> int:
    """CLI entry: ``args.what`` in bus|weights|scorer|generator|pipeline|peer|all, ``args.out``,
    ``args.quick``; optional ``args.size`` (quick|medium|full, pipeline and peer), ``args.threads`` (OMP threads per benchmarked process, pipeline and
    peer only), ``args.lr`` (the staleness study's learning rate) and ``args.work_dir``. Returns
    the exit code."""
    what = args.what
    if what not in (*ORDER, "all"):
        raise ValueError(f"bench {what!r}: choose one of {', '.join(ORDER)} or all")
    families = tuple(getattr(args, "families", None) or ())
    if problem := families_problem(what, families):
        print(f"tether bench {what}: {problem}", file=sys.stderr)
        return 2
    if getattr(args, "slow_link", None) and not (what == "weights" and args.hosts_mbit):
        print(f"tether bench {what}: --slow-link puts one generator behind a slower link among "
              "emulated hosts: it goes with `weights --hosts-mbit R` (e.g. `tether bench "
              "weights --hosts-mbit 200 --slow-link 10`)", file=sys.stderr)  # fmt: skip
        return 2
    out_dir = Path(getattr(args, "out", None) or "bench/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    quick = bool(getattr(args, "quick", False))
    work_dir = Path(getattr(args, "work_dir", None) or "bench/work")
    threads = getattr(args, "threads", None)
    size = getattr(args, "size", None)
    hosts_mbit = getattr(args, "hosts_mbit", None)  # checked by the CLI: > 0
    slow_link = getattr(args, "slow_link", None)  # checked by the CLI: > 1
    default = "1,2" if quick else "1,2,4,8" if hosts_mbit else "1,2,4"
    generators = _generators(getattr(args, "generators", None) or default)
    lr = getattr(args, "lr", None)
    demos = {"kind": getattr(args, "kind", None), "seeds": getattr(args, "seeds", None)}
    try:
        with stop_on_signals():
            _run(what, out_dir=out_dir, quick=quick, work_dir=work_dir, threads=threads, size=size,
                 generators=generators, lr=lr, demos=demos, hosts_mbit=hosts_mbit,
                 families=families, slow_link=slow_link)  # fmt: skip
    except Interrupted as exc:
        print(f"tether bench {what}: {exc}; what it had started is stopped", file=sys.stderr)
        return 128 + exc.signum
    except LookupError as exc:  # a benchmark module missing from this checkout
        print(f"bench {what}: {exc}")
        return 1
    readme = write_readme(out_dir, readme_for(out_dir))
    print(f"wrote {readme}")
    return 0


def _run(what: str, *, out_dir: Path, quick: bool, work_dir: Path, threads: int | None,
         size: str | None, generators: tuple[int, ...], lr: float | None,
         demos: dict[str, Any] | None = None, hosts_mbit: float | None = None,
         families: tuple[str, ...] = (), slow_link: float | None = None) -> None:  # fmt: skip
    """Run ``what`` (or every benchmark); LookupError when its module is not in this checkout.
    ``demos``: the demos benchmark's ``kind`` and ``seeds``; ``families``: the models
    benchmark's (default every one)."""
    if what != "all":
        result = run_one(
            what, out_dir=out_dir, quick=quick, work_dir=work_dir, threads=threads, size=size,
            generators=generators, lr=lr, hosts_mbit=hosts_mbit, families=families,
            slow_link=slow_link, **(demos or {}),
        )  # fmt: skip
        if result is None:
            raise LookupError("its module is not available in this checkout")
        return
    pipeline = None
    for name in ORDER:
        # peer reuses the pipeline bench's async run of the same workload (minutes saved)
        reuse = pipeline["async"] if name == "peer" and pipeline else None
        result = run_one(
            name, out_dir=out_dir, quick=quick, work_dir=work_dir, reuse=reuse, threads=threads,
            size=size, generators=generators,
        )  # fmt: skip
        if name == "pipeline":
            pipeline = result
