"""What a report (and `tether status`) reads from a run directory: the learner's
``metrics.jsonl`` (per-step and held-out evaluation records), the resolved ``config.toml``, and
the figures derived from a status document (per-replica rates; the accounting identity)."""

from __future__ import annotations

import json
import logging
import tomllib
from pathlib import Path
from typing import Any

from common.protocol.books import LearnerBooks, RunBooks
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
    if "books" in service:  # the learner's heartbeat
        trained = LearnerBooks.from_dict(service["books"]).trained_samples
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

    Generators count groups, evaluation groups apart (one response each: taken out), rounds a
    dead learner never recorded included (at least the recorded rounds of ``metrics.jsonl``,
    ``eval_groups``). The learner counts a sample once per pass. ``status["accounting"]`` is
    the run's books (``common.protocol.books.RunBooks``), read whole or refused."""
    books, streams, n = (
        RunBooks.from_dict(status["accounting"]),
        status.get("streams", {}),
        responses_per_prompt,
    )
    lb = books.learner
    eval_groups = max(books.eval_groups_generated, eval_groups)
    # an agent's episode whose turn continuity broke adds a sample per extra segment
    segments = lb.segment_samples
    generated = (books.groups_generated - eval_groups) * n + segments
    trained = lb.trained_samples // max(passes_per_cycle, 1)
    dropped = lb.dropped_stale_samples
    filtered = lb.filtered_samples
    overlong = lb.overlong_masked_samples
    refused = lb.refused_template_samples
    surplus = lb.surplus_samples
    failed = lb.agent_failed_samples
    dead = books.dead_letter_groups * n
    queued = sum(
        streams.get(s, {}).get(k, 0)
        for s, k in (("groups", "lag"), ("groups", "pending"), ("scored", "lag"))
    )
    in_flight = queued * n
    rest = (
        generated
        - trained
        - dropped
        - filtered
        - overlong
        - refused
        - surplus
        - failed
        - dead
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
