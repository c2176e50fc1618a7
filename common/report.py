"""`tether report RUN_DIR`: one self-contained HTML file that shows what a run did.

Reads ``metrics.jsonl`` (per-step and held-out evaluation records written by the learner),
``config.toml`` (the resolved config) and, when present, ``status.json`` (the last status
snapshot, written by the launcher at the end of a run: time breakdown per service, counters,
queues). Plots are PNGs drawn with matplotlib's Agg backend and embedded as base64, so the file
can be mailed or attached to an issue as is.
"""

from __future__ import annotations

import json
import logging
import tomllib
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SECTIONS = {
    "reward": "Reward and held-out accuracy",
    "throughput": "Throughput per stage",
    "staleness": "Staleness",
    "mismatch": "Behaviour vs learner mismatch",
    "time": "Where each service spends its time",
    "accounting": "Accounting: nothing lost",
    "config": "Resolved config",
}


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step records, eval records) from ``metrics.jsonl``; unreadable lines are skipped."""
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return steps, evals
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            rec = json.loads(line)
        except ValueError:
            log.warning("%s line %d is not JSON (a write cut short?); skipped", path, n)
            continue
        if rec.get("kind") == "step" and "step" in rec:
            steps.append(rec)
        elif rec.get("kind") == "eval" and "accuracy" in rec:
            evals.append(rec)
    return sorted(steps, key=lambda r: r["step"]), sorted(evals, key=lambda r: r["eval_round"])


def read_config(run_dir: Path) -> tuple[dict[str, Any], str]:
    """(parsed, text) of the run's resolved ``config.toml``; empty when it is missing."""
    path = run_dir / "config.toml"
    if not path.exists():
        return {}, ""
    text = path.read_text(encoding="utf-8")
    return tomllib.loads(text), text


def service_rates(service: dict[str, Any], *, responses_per_prompt: int) -> dict[str, float]:
    """Lifetime rates of one service replica from its heartbeat counters (per second of uptime)."""
    uptime = max(float(service.get("heartbeat", 0)) - float(service.get("started", 0)), 1e-9)
    out: dict[str, float] = {"uptime_s": uptime}
    if "tokens" in service:
        out["tokens_per_s"] = service["tokens"] / uptime
    if "groups" in service:
        out["groups_per_s"] = service["groups"] / uptime
    trained = (service.get("counters") or {}).get("trained_samples")
    if trained is not None:
        out["samples_per_s"] = trained / uptime
        out["groups_per_s"] = trained / max(responses_per_prompt, 1) / uptime
    return out


def accounting_rows(
    status: dict[str, Any], *, responses_per_prompt: int, passes_per_cycle: int, eval_groups: int
) -> list[tuple[str, str, int, str]]:
    """The identity generated = trained + dropped + filtered + dead-lettered + in flight, in
    trajectories (responses), as (key, label, value, source) rows; the last row is the unexplained
    remainder (0 when the books balance).

    Generators count groups (training and evaluation alike); evaluation groups (one response each)
    are known from ``metrics.jsonl`` and taken out. The learner counts a sample once per pass."""
    acc, streams, n = status.get("accounting", {}), status.get("streams", {}), responses_per_prompt
    generated = (acc.get("groups_generated_by_live_generators", 0) - eval_groups) * n
    trained = acc.get("trained_samples", 0) // max(passes_per_cycle, 1)
    dropped = acc.get("dropped_stale_samples", 0)
    filtered = acc.get("filtered_samples", 0)
    dead = acc.get("dead_letters", 0) * n
    queued = sum(
        streams.get(s, {}).get(k, 0)
        for s, k in (("groups", "lag"), ("groups", "pending"), ("scored", "lag"))
    )
    in_flight = queued * n
    rest = generated - trained - dropped - filtered - dead - in_flight
    return [
        (
            "generated",
            "generated for training",
            generated,
            f"generator groups − {eval_groups} eval groups, × {n} responses",
        ),
        ("trained", "trained", trained, f"learner trained samples ÷ {passes_per_cycle} pass(es)"),
        (
            "dropped_stale",
            "dropped for staleness",
            dropped,
            "older than max_staleness when their step came",
        ),
        ("filtered", "filtered (equal-reward groups)", filtered, "no learning signal"),
        ("dead_lettered", "dead-lettered", dead, "dead-letter entries × responses per group"),
        (
            "in_flight",
            "in flight (queued)",
            in_flight,
            "groups waiting for a scorer or the learner",
        ),
        (
            "unaccounted",
            "unaccounted",
            rest,
            "0 when the books balance (in the learner's buffer while running)",
        ),
    ]


def write_report(run_dir: str | Path, *, out: str | Path | None = None) -> Path:
    """Write the HTML report (default ``<run_dir>/report.html``) and return its path."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists() and not (run_dir / "config.toml").exists():
        raise ValueError(
            f"{run_dir}: not a Tether run directory (no metrics.jsonl or config.toml); pass runs/<name>"
        )
    steps, evals = read_metrics(run_dir)
    cfg, cfg_text = read_config(run_dir)
    snap = run_dir / "status.json"
    status = json.loads(snap.read_text(encoding="utf-8")) if snap.exists() else None
    from common.report_html import render

    page = render(
        run_dir=run_dir, steps=steps, evals=evals, cfg=cfg, cfg_text=cfg_text, status=status
    )
    path = Path(out) if out else run_dir / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    log.info("report written to %s", path)
    return path
