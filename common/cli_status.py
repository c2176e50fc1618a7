"""`tether status [--run NAME] [--json]` and `tether report RUN_DIR [--out FILE]`.

Status is read live from the run's Redis: ``--redis-url`` / ``run.redis_url`` /
``TETHER_REDIS_URL``, else the embedded server a local ``tether train`` started (its port is in
``<run dir>/redis/server.conf``). A finished local run's embedded server is gone, so the launcher
saves the last status as ``<run dir>/status.json`` (``save_status_snapshot``); ``tether status``
falls back to it and says so. Heavy imports (matplotlib, the bus) stay inside the handlers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SNAPSHOT = "status.json"
AddConfigArgs = Callable[[argparse.ArgumentParser], None]


def save_status_snapshot(run_dir: str | Path, status: dict[str, Any]) -> Path:
    """Write ``status`` (from ``common.status.collect_status``) to ``<run_dir>/status.json``
    atomically (temporary file, fsync, rename), so a reader never sees half a file."""
    path = Path(run_dir) / SNAPSHOT
    tmp = path.with_name(f".{SNAPSHOT}.{os.getpid()}.tmp")
    doc = {**status, "snapshot_time": time.time()}
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return path


def finish_run(run_dir: str | Path, bus: Any) -> Path | None:
    """For the launcher, after the services stopped and before Redis stops: save the status
    snapshot and write ``report.html``. Best effort: a failure is logged, never raised, so a
    finished run is not turned into a failed one by its report. Returns the report's path."""
    from common.report import write_report
    from common.status import collect_status

    try:
        save_status_snapshot(run_dir, collect_status(bus))
    except Exception as exc:  # Redis gone or a service wrote an odd heartbeat: report without it
        log.warning("could not save the status snapshot in %s: %s", run_dir, exc)
    try:
        path = write_report(run_dir)
    except Exception as exc:
        log.warning(
            "could not write the run report in %s: %s (retry: tether report %s)",
            run_dir,
            exc,
            run_dir,
        )
        return None
    log.info("run report: %s", path)
    return path


def load_status_snapshot(run_dir: str | Path) -> dict[str, Any] | None:
    path = Path(run_dir) / SNAPSHOT
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(
            f"{path} is not valid JSON ({exc}); delete it, or run `tether status` while the run is live"
        ) from exc


def embedded_redis_url(run_dir: Path) -> str | None:
    """The URL of the embedded server a local run started (``redis/server.conf``), if any."""
    conf = run_dir / "redis" / "server.conf"
    if not conf.exists():
        return None
    port = next(
        (ln.split()[1] for ln in conf.read_text().splitlines() if ln.startswith("port ")), None
    )
    return f"redis://127.0.0.1:{port}/0" if port else None


def live_status(cfg: Any, url: str) -> dict[str, Any] | None:
    """``collect_status`` from the Redis at ``url``; None when it does not answer within ~2 s."""
    import redis

    from common.bus.client import Bus
    from common.bus.settings import BusUnavailable, bus_settings_for
    from common.status import collect_status

    probe = redis.Redis.from_url(url, socket_connect_timeout=2.0, socket_timeout=2.0)
    try:
        probe.ping()  # a quick look first: the bus itself retries for reconnect_max_s
    except (redis.RedisError, OSError) as exc:
        log.debug("no live status from %s: %s", url, exc)
        return None
    finally:
        probe.close()
    settings = replace(
        bus_settings_for(cfg, redis_url=url), reconnect_max_s=2.0, connect_timeout_s=2.0
    )
    bus = Bus(settings, service="status")
    try:
        return collect_status(bus)
    except (BusUnavailable, redis.RedisError, OSError) as exc:
        log.debug("no live status from %s: %s", url, exc)
        return None
    finally:
        bus.close()


def enrich(st: dict[str, Any], *, cfg: Any, run_dir: Path | None) -> dict[str, Any]:
    """Add per-replica rates and the accounting in trajectories (``accounting_trajectories``)."""
    from common.report import accounting_rows, read_metrics, service_rates

    n, passes = cfg.run.responses_per_prompt, cfg.run.passes_per_cycle
    for s in st.get("services", []):
        s["rates"] = service_rates(s, responses_per_prompt=n)
    evals = read_metrics(run_dir)[1] if run_dir is not None else []
    rows = accounting_rows(
        st,
        responses_per_prompt=n,
        passes_per_cycle=passes,
        eval_groups=sum(int(e.get("n", 0)) for e in evals),
    )
    st["accounting_trajectories"] = {key: value for key, _, value, _ in rows}
    return st


def format_full(st: dict[str, Any]) -> str:
    """``common.status.format_status`` plus rates, accounting and where the numbers came from."""
    from common.status import format_status

    lines = []
    if st.get("source") == "snapshot":
        when = time.strftime(
            "%Y-%m-%d %H:%M:%S", time.localtime(st.get("snapshot_time", st.get("time", 0)))
        )
        lines.append(f"(snapshot of {when} from status.json: the run's Redis is not reachable)")
    lines.append(format_status(st))
    for s in st.get("services", []):
        r = s.get("rates") or {}
        parts = [
            f"{r[k]:.2f} {label}"
            for k, label in (
                ("groups_per_s", "groups/s"),
                ("tokens_per_s", "tokens/s"),
                ("samples_per_s", "trained responses/s"),
            )
            if k in r
        ]
        lines.append(
            f"  rate {s['service']:9s} {s['id']:14s} {', '.join(parts) or '-'} over {r.get('uptime_s', 0):.0f} s"
        )
    a = st.get("accounting_trajectories")
    if a:
        lines.append(
            f"  accounting (trajectories): generated {a['generated']} = trained {a['trained']} + dropped stale {a['dropped_stale']} "
            f"+ filtered {a['filtered']} + dead-lettered {a['dead_lettered']} + in flight {a['in_flight']}"
            + (" (balanced)" if a["unaccounted"] == 0 else f" + unaccounted {a['unaccounted']}")
        )
    return "\n".join(lines)


def _resolve(args: argparse.Namespace) -> tuple[Any, Path]:
    """(config, run dir) for ``--run`` (a run directory or a run name) and the config flags."""
    from common.cli import load_from_args

    given = getattr(args, "run", None)
    run_dir = Path(given) if given and Path(given).is_dir() else None
    if given and run_dir is None and getattr(args, "cfg:run.name", None) is None:
        setattr(args, "cfg:run.name", given)
    if args.config is None:
        saved = (
            run_dir or Path(load_from_args(args).config.run.run_dir) / (given or "")
        ) / "config.toml"
        if given and saved.exists():
            args.config = str(saved)
    cfg = load_from_args(args).config
    return cfg, run_dir or Path(cfg.run.run_dir) / cfg.run.name


def get_status(args: argparse.Namespace) -> dict[str, Any]:
    """Live status when the run's Redis answers, else the run directory's snapshot."""
    cfg, run_dir = _resolve(args)
    url = cfg.run.redis_url or os.environ.get("TETHER_REDIS_URL") or embedded_redis_url(run_dir)
    st = live_status(cfg, url) if url else None
    if st is not None and st["services"]:
        st["source"] = "live"
    else:
        snap = load_status_snapshot(run_dir)
        if snap is not None:
            st = {**snap, "source": "snapshot"}
        elif st is not None:
            st["source"] = "live"  # Redis answers but no service of this run has reported yet
        else:
            where = f"Redis at {url} does not answer" if url else "no Redis URL is known"
            raise LookupError(
                f"no status for run {cfg.run.name!r}: {where} and {run_dir / SNAPSHOT} "
                "does not exist. Pass --run with the run's name or directory, and --redis-url for a remote run."
            )
    return enrich(st, cfg=cfg, run_dir=run_dir if run_dir.is_dir() else None)


def _cmd_status(args: argparse.Namespace) -> int:
    try:
        st = get_status(args)
    except (LookupError, ValueError) as exc:
        print(f"tether status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(st, indent=2, default=str) if args.json else format_full(st))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from common.report import write_report

    try:
        path = write_report(args.run_dir, out=args.out)
    except ValueError as exc:
        print(f"tether report: {exc}", file=sys.stderr)
        return 2
    print(f"report written to {path}")
    return 0


def add_status_verbs(sub: argparse._SubParsersAction, add_config_args: AddConfigArgs) -> None:
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
    st.set_defaults(func=_cmd_status)

    rep = sub.add_parser("report", help="write a self-contained HTML report with plots for a run")
    rep.add_argument("run_dir", metavar="RUN_DIR", help="the run directory, e.g. runs/<name>")
    rep.add_argument("--out", metavar="FILE", help="output file (default: RUN_DIR/report.html)")
    rep.set_defaults(func=_cmd_report)
