"""What `tether status` shows: a run's status live from its Redis (``--redis-url``,
``run.redis_url``, ``TETHER_REDIS_URL``, else the embedded server a local ``tether train``
started, whose port is in ``<run dir>/redis/server.conf``), else the snapshot the launcher saved
in its run directory; with per-replica rates and the accounting in trajectories added. Heavy
imports (the bus) stay inside the functions."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from common.protocol.books import BooksError
from common.protocol.run_dir import RunDir
from tether.runs.status import format_status, load_status_snapshot
from common.bus.server import EmbeddedRedis
from common.bus.client import Bus
from common.bus.settings import BusUnavailable
from tether.runs.status import collect_status
from tether.runs.report.data import accounting_rows, read_metrics, service_rates
import redis
from common.service.settings import bus_settings_for

log = logging.getLogger(__name__)


def embedded_redis_url(run_dir: Path) -> str | None:
    """The URL of the embedded server a local run started (``redis/server.conf``), if any."""
    conf = RunDir(run_dir).redis / "server.conf"
    if not conf.exists():
        return None
    port = next(
        (ln.split()[1] for ln in conf.read_text().splitlines() if ln.startswith("port ")), None
    )
    return f"redis://127.0.0.1:{port}/0" if port else None


@contextmanager
def run_redis(cfg: Any, run_dir: Path) -> Iterator[str | None]:
    """The URL of the run's Redis: run.redis_url / TETHER_REDIS_URL, else the embedded server of
    a local run, started for the caller (and stopped after) when it no longer runs; None when
    there is none."""
    url = cfg.run.redis_url or os.environ.get("TETHER_REDIS_URL") or embedded_redis_url(run_dir)
    if url and (cfg.run.redis_url or os.environ.get("TETHER_REDIS_URL") or redis_answers(url)):
        yield url
        return
    if not RunDir(run_dir).redis.is_dir():
        yield None
        return

    server = EmbeddedRedis(RunDir(run_dir).redis, binary=cfg.run.redis_server_binary or None)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def redis_answers(url: str) -> bool:
    """Whether the Redis at ``url`` answers a PING within ~2 s."""
    probe = redis.Redis.from_url(url, socket_connect_timeout=2.0, socket_timeout=2.0)
    try:
        return bool(probe.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        probe.close()


def live_status(cfg: Any, url: str) -> dict[str, Any] | None:
    """``collect_status`` from the Redis at ``url``; None when it does not answer within ~2 s."""
    if not redis_answers(url):  # a quick look first: the bus itself retries for reconnect_max_s
        log.debug("no live status from %s", url)
        return None
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
    n, passes = cfg.run.responses_per_prompt, cfg.run.passes_per_cycle
    for s in st.get("services", []):
        s["rates"] = service_rates(s, responses_per_prompt=n)
    evals = read_metrics(run_dir)[1] if run_dir is not None else []
    try:
        rows = accounting_rows(
            st,
            responses_per_prompt=n,
            passes_per_cycle=passes,
            eval_groups=sum(int(e.get("n", 0)) for e in evals),
        )
    except BooksError as exc:  # a snapshot another Tether wrote: the rest still shows
        st["accounting_trajectories"] = None
        st["accounting_refused"] = str(exc)
        return st
    st["accounting_trajectories"] = {key: value for key, _, value, _ in rows}
    return st


def format_full(st: dict[str, Any]) -> str:
    """``format_status`` plus rates, accounting and where the numbers came from."""

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
    if st.get("accounting_refused"):
        lines.append(f"  accounting: not read ({st['accounting_refused']})")
    a = st.get("accounting_trajectories")
    if a:
        lines.append(
            f"  accounting (trajectories): generated {a['generated']} = trained {a['trained']} + dropped stale {a['dropped_stale']} "
            f"+ filtered {a['filtered']} + dead-lettered {a['dead_lettered']} + in flight {a['in_flight']}"
            + (" (balanced)" if a["unaccounted"] == 0 else f" + unaccounted {a['unaccounted']}")
        )
    return "\n".join(lines)


def status_of(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """Live status when the run's Redis answers, else the run directory's snapshot; with rates
    and accounting. ``LookupError`` when neither is there."""
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
                f"no status for run {cfg.run.name!r}: {where} and {RunDir(run_dir).status_snapshot} "
                "does not exist. Pass --run with the run's name or directory, and --redis-url for a remote run."
            )
    return enrich(st, cfg=cfg, run_dir=run_dir if run_dir.is_dir() else None)
