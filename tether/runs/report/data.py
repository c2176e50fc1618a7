"""What a report (and `tether status`) reads from a run directory: the learner's
``metrics.jsonl`` (per-step and held-out evaluation records), the resolved ``config.toml``, and
the figures derived from a status document (per-replica rates; the accounting identity)."""

from __future__ import annotations

import json
import logging
import tomllib
from pathlib import Path
from typing import Any

from common.protocol.run_dir import RunDir

log = logging.getLogger(__name__)

SECTIONS = {
    "reward": "Reward and held-out accuracy",
    "throughput": "Throughput per stage",
    "staleness": "Staleness",
    "mismatch": "Behaviour vs learner mismatch",
    "episodes": "Episodes and tool use",
    "time": "Where each service spends its time",
    "accounting": "Accounting: nothing lost",
    "config": "Resolved config",
}


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step records, eval records) from ``metrics.jsonl``; unreadable lines are skipped."""
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    path = RunDir(run_dir).metrics
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
    path = RunDir(run_dir).config
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
    """The identity generated = trained + dropped + filtered + masked over-long + surplus +
    dead-lettered + in flight, in
    trajectories (responses), as (key, label, value, source) rows; the last row is the unexplained
    remainder (0 when the books balance).

    Generators count groups, evaluation groups apart (one response each: taken out); older
    snapshots know the evaluation groups only from ``metrics.jsonl`` (``eval_groups``). The learner counts a sample once per pass."""
    acc, streams, n = status.get("accounting", {}), status.get("streams", {}), responses_per_prompt
    # snapshots written before the run-long count called it groups_generated_by_live_generators
    total = acc.get("groups_generated", acc.get("groups_generated_by_live_generators", 0))
    # the generators count held-out groups apart, rounds a dead learner never recorded included
    # (at least the recorded rounds of metrics.jsonl); counts written before that have 0 there
    eval_groups = max(acc.get("eval_groups_generated", 0), eval_groups)
    # an agent's episode whose turn continuity broke adds a sample per extra segment
    segments = acc.get("segment_samples", 0)
    generated = (total - eval_groups) * n + segments
    trained = acc.get("trained_samples", 0) // max(passes_per_cycle, 1)
    dropped = acc.get("dropped_stale_samples", 0)
    filtered = acc.get("filtered_samples", 0)
    overlong = acc.get("overlong_masked_samples", 0)
    refused = acc.get("refused_template_samples", 0)
    surplus = acc.get("surplus_samples", 0)
    failed = acc.get("agent_failed_samples", 0)
    # snapshots written before dead letters were told apart count every entry as a group
    dead = acc.get("dead_letter_groups", acc.get("dead_letters", 0)) * n
    queued = sum(
        streams.get(s, {}).get(k, 0)
        for s, k in (("groups", "lag"), ("groups", "pending"), ("scored", "lag"))
    )
    in_flight = queued * n
    rest = (
        generated - trained - dropped - filtered - overlong - refused - surplus - failed - dead
        - in_flight
    )
    return [
        (
            "generated",
            "generated for training",
            generated,
            f"generator groups − {eval_groups} eval groups, × {n} responses"
            + (f", + {segments} extra segments of agents' episodes" if segments else ""),
        ),
        ("trained", "trained", trained, f"learner trained samples ÷ {passes_per_cycle} pass(es)"),
        (
            "dropped_stale",
            "dropped for staleness",
            dropped,
            "older than max_staleness when their step came",
        ),
        ("filtered", "filtered (equal-reward groups)", filtered, "no learning signal"),
        (
            "overlong_masked",
            "masked (cut off at max_response_tokens)",
            overlong,
            "learner.overlong_filter",
        ),
        (
            "refused_template",
            "refused (re-render mismatch)",
            refused,
            "episodes generator.template_check = strict refused",
        ),
        (
            "surplus",
            "surplus (dynamic sampling)",
            surplus,
            "informative groups beyond prompts_per_cycle",
        ),
        (
            "agent_failed",
            "agent code failed",
            failed,
            "episodes whose agent raised or timed out: recorded, not trained",
        ),
        (
            "dead_lettered",
            "dead-lettered",
            dead,
            "dead-lettered groups × responses per group (prompts and undecodable entries hold none)",
        ),
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
