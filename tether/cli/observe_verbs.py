"""`tether status [--run NAME|DIR] [--json]`, `tether report RUN_DIR [--out FILE]`, `tether bus
inspect`, `tether bus redrive` and `tether finish`: what a running or finished run is doing
(``tether.runs.status_view``, ``tether.runs.report``, ``common.bus.inspect``), dead letters
returned to their streams (``common.bus.redrive``), and a run asked to end early
(``common.service.run_end``). Heavy imports stay inside the handlers."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common.protocol.run_dir import RunDir
from tether.cli.args import add_config_args, load_from_args


def _resolve(args: argparse.Namespace) -> tuple[Any, Path]:
    """(config, run dir) for ``--run`` (a run directory or a run name) and the config flags; the
    run's own saved ``config.toml`` when no ``--config`` is given."""
    given = getattr(args, "run", None)
    run_dir = Path(given) if given and Path(given).is_dir() else None
    if given and run_dir is None and getattr(args, "cfg:run.name", None) is None:
        setattr(args, "cfg:run.name", given)
    if args.config is None:
        saved = RunDir(run_dir or Path(load_from_args(args).config.run.run_dir) / (given or ""))
        if given and saved.config.exists():
            args.config = str(saved.config)
    cfg = load_from_args(args).config
    return cfg, run_dir or RunDir.of(cfg.run).root


def _status(args: argparse.Namespace) -> int:
    from tether.runs.status_view import format_full, status_of

    try:
        st = status_of(*_resolve(args))
    except (LookupError, ValueError) as exc:
        print(f"tether status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(st, indent=2, default=str) if args.json else format_full(st))
    return 0


def _report(args: argparse.Namespace) -> int:
    from tether.runs.report.page import write_report

    try:
        path = write_report(args.run_dir, out=args.out)
    except ValueError as exc:
        print(f"tether report: {exc}", file=sys.stderr)
        return 2
    print(f"report written to {path}")
    return 0


def _bus_inspect(args: argparse.Namespace) -> int:
    from common.bus.inspect import format_inspect, inspect_bus
    from common.service.settings import bus_settings_for

    cfg = load_from_args(args).config
    report = inspect_bus(bus_settings_for(cfg, redis_url=cfg.run.redis_url or None))
    print(json.dumps(report, indent=2, default=str) if args.json else format_inspect(report))
    return 0


@contextmanager
def _run_bus(args: argparse.Namespace, verb: str) -> Iterator[tuple[Any, Any]]:
    """(config, a bus on the run's Redis) for a verb that writes to a run: its Redis, started for
    the command for a stopped local run; (config, None) after one paragraph on stderr when no
    Redis is known or it does not answer (in ~2 s, not the bus's reconnect time)."""
    from common.bus.client import Bus
    from common.service.settings import bus_settings_for
    from tether.runs.status_view import redis_answers, run_redis

    cfg, run_dir = _resolve(args)
    with run_redis(cfg, run_dir) as url:
        if url is None or not redis_answers(url):
            where = "no Redis is known" if url is None else f"Redis at {url} does not answer"
            print(
                f"tether {verb}: {where} for run {cfg.run.name!r}: pass --redis-url with the "
                "run's Redis, or --run with the run's directory (a stopped local run's embedded "
                "server is started for the command)",
                file=sys.stderr,
            )
            yield cfg, None
            return
        bus = Bus(bus_settings_for(cfg, redis_url=url), service=verb.split()[-1])
        try:
            yield cfg, bus
        finally:
            bus.close()


def _bus_redrive(args: argparse.Namespace) -> int:
    from common.bus.redrive import RedriveRefused, format_redrive, redrive

    with _run_bus(args, "bus redrive") as (_, bus):
        if bus is None:
            return 2
        try:
            result = redrive(bus, reasons=set(args.reason or ()) or None, dry_run=args.dry_run)
        except RedriveRefused as exc:
            print(f"tether bus redrive: {exc}", file=sys.stderr)
            return 2
    print(json.dumps(result, indent=2) if args.json else format_redrive(result))
    return 0


def _finish(args: argparse.Namespace) -> int:
    from common.bus.redrive import ALIVE_S, heartbeat_age, learner_heartbeat
    from common.service import run_end

    beat: dict[str, Any] = {}
    with _run_bus(args, "finish") as (cfg, bus):
        if bus is None:
            return 2
        ended = run_end.finished(bus, num_cycles=cfg.run.num_cycles)
        if ended is None:
            run_end.request_finish(bus)
            beat = learner_heartbeat(bus)
    if ended is not None:
        print(f"tether finish: run {cfg.run.name!r} is finished already (policy version "
              f"{ended.get('version')})")  # fmt: skip
        return 0
    age = heartbeat_age(beat)
    if age is None or age >= ALIVE_S:
        when = "it never reported" if age is None else f"its last heartbeat was {age:.0f} s ago"
        print(
            f"tether finish: asked run {cfg.run.name!r} to end early, but no learner of it is "
            f"running ({when}). The request stays in Redis: once the run resumes (`tether train "
            "--resume`), the learner trains the cycles already dispatched and finishes"
        )
        return 0
    print(
        f"tether finish: asked run {cfg.run.name!r} to end early: the learner dispatches no new "
        "cycle, trains the cycles it has dispatched, runs the last held-out round and finishes "
        "(every service exits 0; the learner's log names the cycle it ends after)"
    )
    return 0


def add_observe_verbs(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser(
        "status",
        help="what a running or finished run is doing: versions, rates, queues, time breakdown",
        description="Reads the run's Redis (--redis-url, run.redis_url, or the embedded server of a "
        "local run); for a finished local run, the status.json snapshot in its run directory.",
    )
    st.add_argument(
        "--run", metavar="NAME|DIR", help="run name (under run.run_dir) or run directory"
    )
    st.add_argument("--json", action="store_true", help="machine-readable output")
    add_config_args(st)
    st.set_defaults(func=_status)

    rep = sub.add_parser("report", help="write a self-contained HTML report with plots for a run")
    rep.add_argument("run_dir", metavar="RUN_DIR", help="the run directory, e.g. runs/<name>")
    rep.add_argument("--out", metavar="FILE", help="output file (default: RUN_DIR/report.html)")
    rep.set_defaults(func=_report)

    bus = sub.add_parser(
        "bus", help="inspect the trajectory bus (streams, groups, lag, dead letters)"
    )
    bus_sub = bus.add_subparsers(dest="bus_verb", metavar="ACTION", required=True)
    insp = bus_sub.add_parser("inspect", help="streams, groups, lag, pending, dead-letter counts")
    add_config_args(insp)
    insp.add_argument("--json", action="store_true", help="machine-readable output")
    insp.set_defaults(func=_bus_inspect)
    rd = bus_sub.add_parser(
        "redrive",
        help="return dead letters to their stream once their cause is fixed (run stopped)",
        description="Moves every re-drivable dead letter (a whole training prompt or group of a "
        "cycle the learner has still to train) back onto its stream, then `tether train --resume` "
        "trains it. Refused while the learner runs. For a local run whose embedded server is "
        "stopped, --run starts it for the command.",
    )
    rd.add_argument(
        "--run", metavar="NAME|DIR", help="run name (under run.run_dir) or run directory"
    )
    rd.add_argument(
        "--reason", action="append", metavar="REASON",
        help="only dead letters with this reason (repeatable), e.g. max_deliveries, unscorable",
    )  # fmt: skip
    rd.add_argument("--dry-run", action="store_true", help="say what would be re-driven")
    rd.add_argument("--json", action="store_true", help="machine-readable output")
    add_config_args(rd)
    rd.set_defaults(func=_bus_redrive)

    fin = sub.add_parser(
        "finish",
        help="end a running run early and cleanly: the cycles dispatched are trained, then it "
        "finishes as at its end",
        description="Asks the run's learner to dispatch no new cycle, train the cycles it has "
        "dispatched (every prompt sent out is trained, filtered or dropped as stale), checkpoint, "
        "run the last held-out round and write the run-finished record: every service exits 0. "
        "A stopped run ends so at its next resume. Raise run.num_cycles and resume to go on.",
    )
    fin.add_argument(
        "--run", metavar="NAME|DIR", help="run name (under run.run_dir) or run directory"
    )
    add_config_args(fin)
    fin.set_defaults(func=_finish)
