"""A run's status: what a running or finished run is doing, read from Redis.

Every service writes a heartbeat (``status`` hash: phase seconds, counters, version); this module
combines it with the streams' lag/pending and the dead-letter count into one document, and says
which stage is the bottleneck — the service that is busiest while the others wait — which answers
"why only ~4 steps in 3 hours?" for any run. A finished local run's embedded server is gone, so
the launcher saves the last status as ``<run dir>/status.json`` (``save_status_snapshot``).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from common.bus.dead_letters import holds_responses
from common.bus.redrive import redrivable
from common.protocol import streams as names
from common.protocol.books import LearnerBooks, RunBooks
from common.protocol.run_dir import RunDir
from common.service import run_end

STREAMS = list(names.PIPELINE)
BUSY_PHASES = ("working", "syncing_weights", "checkpointing")


def _services(bus) -> list[dict[str, Any]]:
    out = []
    for _, v in sorted(bus.read_statuses().items()):
        try:
            out.append(json.loads(v))
        except ValueError:
            continue
    return out


def breakdown(phases: dict[str, float]) -> dict[str, float]:
    total = sum(phases.values()) or 1.0
    return {k: v / total for k, v in sorted(phases.items(), key=lambda kv: -kv[1])}


def grading(services: list[dict[str, Any]]) -> dict[str, int]:
    """Responses scored, by grading reason (``correct``, ``wrong``, ``no_answer``,
    ``not_a_number``, ...), summed over the scorers' heartbeats. Each scorer counts since its
    process started, as its ``tether_scorer_items_total`` does: a restarted one starts at 0."""
    total: Counter[str] = Counter()
    for s in services:
        if s.get("service") == "scorer":
            total.update({str(k): int(v) for k, v in (s.get("reasons") or {}).items()})
    return dict(sorted(total.items()))


def bottleneck(services: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The service kind with the largest busy fraction (mean over its replicas); None until some
    service has been busy (at a run's start every busy fraction is 0, and naming one of them
    the bottleneck would be a guess)."""
    by_kind: dict[str, list[float]] = {}
    for s in services:
        frac = breakdown(s.get("phases", {}))
        by_kind.setdefault(s["service"], []).append(sum(frac.get(p, 0.0) for p in BUSY_PHASES))
    if not by_kind:
        return None
    kind, fracs = max(by_kind.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))
    if sum(fracs) <= 0.0:
        return None
    return {"service": kind, "busy_fraction": sum(fracs) / len(fracs)}


def collect_status(bus) -> dict[str, Any]:
    now = time.time()
    services = _services(bus)
    for s in services:
        s["age_s"] = now - s.get("heartbeat", 0)
        s["alive"] = s["age_s"] < 15
        s["time_breakdown"] = breakdown(s.get("phases", {}))
    streams = {}
    for stream, group in STREAMS:
        lag, pending = bus.backlog(stream, group) if bus.groups_info(stream) else (0, 0)
        streams[stream] = {"group": group, "lag": lag, "pending": pending}
    dead_entries = bus.call(lambda: bus.redis.xrange(bus.key(names.DEAD)), what="XRANGE dead")
    dead = len(dead_entries)
    # the dead-lettered entries that are generated groups: their responses are in the books
    # (a dead-lettered prompt was never generated; an undecodable entry is not a generator's)
    dead_groups = sum(1 for _, fields in dead_entries if holds_responses(fields))
    learner = next((s for s in services if s["service"] == "learner"), {})
    cycle = learner.get("cycle")
    redrivable_n = sum(
        1
        for _, fields in dead_entries
        if redrivable(fields, learner_cycle=cycle if isinstance(cycle, int) else None)
    )
    # every generator id's run-long count (Redis), not the live processes' own counters, which
    # start again at 0 when a generator restarts
    by_field = bus.generated_groups()
    generated = sum(by_field.values())
    eval_generated = sum(n for k, n in by_field.items() if k.endswith(names.EVAL_SUFFIX))
    return {
        "run": bus.settings.run,
        "time": now,
        "learner_version": learner.get("version"),
        "cycle": learner.get("cycle"),
        "last_step": learner.get("last_step", {}),
        "generator_versions": {
            s["id"]: s.get("version") for s in services if s["service"] == "generator"
        },
        "services": services,
        "streams": streams,
        "dead_letters": dead,
        "dead_letters_redrivable": redrivable_n,  # `tether bus redrive` can return them
        # the weight chain: the version being (or last) published and the membership epoch the
        # last publish ran under (it grows when a generator joins or is dropped)
        "weights": {
            "publishing": _int_or_none(bus.get(names.WEIGHTS_PUBLISHING)),
            "chain_epoch": _int_or_none(bus.get(names.WEIGHTS_EPOCH)),
        },
        # the run's books (common.protocol.books): the learner's counts under their own names
        "accounting": RunBooks(
            groups_generated=generated,
            eval_groups_generated=eval_generated,  # counted apart by the generators
            dead_letters=dead,
            dead_letter_groups=dead_groups,
            learner=LearnerBooks.from_dict(learner["books"])
            if "books" in learner
            else LearnerBooks(),  # no heartbeat from the learner yet
        ).to_dict(),
        "bottleneck": bottleneck(services),
        "grading": grading(services),
        # seconds the learner has waited without a scored group, dead letter or step
        "no_progress_s": learner.get("no_progress_s"),
        "redis": _redis_memory(bus),
        "end": _run_end(bus, learner),
    }


def _run_end(bus, learner: dict[str, Any]) -> dict[str, Any]:
    """How the run ends: its configured cycles and the cycle the learner ends it before (fewer
    once asked to end early: `tether finish`), whether such a request waits for the learner
    (it looks once a cycle), and the run-finished record once written (``run_end``)."""
    return {
        "num_cycles": learner.get("num_cycles"),
        "end_cycle": learner.get("end_cycle"),
        "finish_requested": run_end.finish_requested(bus),
        "finished": run_end.record(bus),
    }


def _end_line(st: dict[str, Any]) -> str | None:
    """The run's end, when there is something to say about it: finished, ending early, or
    asked to end early."""
    end = st.get("end") or {}
    record = end.get("finished")
    if record:
        early = record.get("ended_early_at_cycle")
        how = (
            f"ended early after cycle {early} of {record.get('num_cycles')} (tether finish)"
            if early is not None
            else f"all {record.get('num_cycles')} cycles"
        )
        return f"  run end: finished at policy version v{record.get('version')}, {how}"
    n, last = end.get("num_cycles"), end.get("end_cycle")
    if isinstance(n, int) and isinstance(last, int) and last < n:
        return (
            f"  run end: ending early (tether finish): no new cycle is dispatched; the run ends "
            f"after cycle {last} of {n}, once the cycles dispatched are trained"
        )
    if end.get("finish_requested"):
        return (
            "  run end: asked to end early (tether finish); the learner takes the request at "
            "its next cycle"
        )
    return None


def _redis_memory(bus) -> dict[str, Any] | None:
    """Redis's memory against ``maxmemory`` (INFO memory), or None when it cannot be read."""
    try:
        mem = bus.memory()
    except Exception:  # noqa: BLE001 - INFO may be refused to this user: the rest still shows
        return None
    return {"used_bytes": mem.used_bytes, "max_bytes": mem.max_bytes, "policy": mem.policy}


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.lstrip("-").isdigit() else None


def format_status(st: dict[str, Any]) -> str:
    lines = [f"run {st['run']}: learner v{st['learner_version']} cycle {st['cycle']}"]
    end = _end_line(st)
    if end:
        lines.append(end)
    ls = st.get("last_step") or {}
    if ls:
        lines.append(
            f"  last step {ls.get('step')}: loss {ls.get('loss', 0):.4f} reward {ls.get('reward_mean', 0):.3f} staleness ≤ {ls.get('staleness_max')}"
        )
    if ls.get("tool_calls_per_episode", 0) > 0 or ls.get("episode_turns_mean", 1) > 1:
        lines.append(
            f"  episodes: {ls['episode_turns_mean']:.2f} turns, {ls['tool_calls_per_episode']:.2f} "
            f"tool calls ({ls['tool_call_rate']:.0%} called one, {ls['tool_error_rate']:.0%} "
            f"failed, {ls['tool_seconds_per_episode']:.3f} s in tools) per episode; "
            f"{ls['episodes_cut_max_turns']:.0f} cut at max_turns, "
            f"{ls['template_mismatches']:.0f} re-render mismatches; versions within an "
            f"episode span ≤ {ls['episode_version_span_max']:.0f} (staleness counts from the "
            "oldest)"
        )
    for s in st["services"]:
        tb = ", ".join(f"{k} {v:.0%}" for k, v in list(s["time_breakdown"].items())[:4])
        state = "alive" if s["alive"] else f"silent {s['age_s']:.0f}s"
        lines.append(
            f"  {s['service']:9s} {s['id']:14s} v{s.get('version')} {state:10s} time: {tb}"
        )
    for name, q in st["streams"].items():
        lines.append(
            f"  stream {name:8s} group {q['group']:10s} lag {q['lag']:5d} pending {q['pending']:5d}"
        )
    w = st.get("weights") or {}
    if w.get("publishing") is not None:
        lines.append(
            f"  weights: v{w['publishing']} published last, chain epoch {w.get('chain_epoch')}"
        )
    groups = st.get("accounting", {}).get("dead_letter_groups")
    held = f" ({groups} generated group(s); the rest prompts or undecodable)" if groups else ""
    again = st.get("dead_letters_redrivable")
    if again:
        held += f"; {again} re-drivable once their cause is fixed (`tether bus redrive`)"
    lines.append(f"  dead letters: {st['dead_letters']}{held}")
    graded = {k: n for k, n in (st.get("grading") or {}).items() if n}
    if graded:
        lines.append(
            "  scored responses by reason: "
            + ", ".join(f"{k} {n}" for k, n in sorted(graded.items(), key=lambda kv: -kv[1]))
            + " (since each scorer started)"
        )
    lines += _health_lines(st)
    acc = st.get("accounting") or {}
    if acc:
        lines.append(
            f"  learner responses: trained {acc.get('trained_samples', 0)} (per pass), dropped "
            f"stale {acc.get('dropped_stale_samples', 0)}, filtered {acc.get('filtered_samples', 0)} "
            f"(equal rewards), masked over-long {acc.get('overlong_masked_samples', 0)}, surplus "
            f"{acc.get('surplus_samples', 0)} (dynamic sampling)"
            + (
                f", refused (re-render) {acc['refused_template_samples']}"
                if acc.get("refused_template_samples")
                else ""
            )
            + (
                f"; tool calls in them {acc['episode_tool_calls']}"
                if acc.get("episode_tool_calls")
                else ""
            )
        )
        if acc.get("segment_samples") or acc.get("agent_failed_samples"):
            lines.append(
                f"  agents: {acc.get('segment_samples', 0)} extra segment(s) (requests that did "
                f"not extend their episode's ids), {acc.get('agent_failed_samples', 0)} "
                "episode(s) whose agent code failed or timed out (not trained)"
            )
    b = st.get("bottleneck")
    if b:
        lines.append(f"  bottleneck: {b['service']} (busy {b['busy_fraction']:.0%} of its time)")
    return "\n".join(lines)


def save_status_snapshot(run_dir: str | Path, status: dict[str, Any]) -> Path:
    """Write ``status`` (from ``collect_status``) to ``<run_dir>/status.json`` atomically
    (temporary file, fsync, rename), so a reader never sees half a file."""
    path = RunDir(Path(run_dir)).status_snapshot
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    doc = {**status, "snapshot_time": time.time()}
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return path


def load_status_snapshot(run_dir: str | Path) -> dict[str, Any] | None:
    path = RunDir(Path(run_dir)).status_snapshot
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(
            f"{path} is not valid JSON ({exc}); delete it, or run `tether status` while the run is live"
        ) from exc


def _health_lines(st: dict[str, Any]) -> list[str]:
    """Redis memory against maxmemory, and a learner waiting without progress."""
    out = []
    r = st.get("redis")
    if r:
        used = r["used_bytes"] / 2**20
        if r["max_bytes"]:
            share = r["used_bytes"] / r["max_bytes"]
            limit = f"of maxmemory {r['max_bytes'] / 2**20:.1f} MiB ({share:.0%})"
        else:
            limit = "(no maxmemory)"
        out.append(f"  redis: used {used:.1f} MiB {limit}, policy {r['policy']}")
    waited = st.get("no_progress_s")
    if isinstance(waited, (int, float)) and waited >= 60:
        out.append(
            f"  learner: no scored group, dead letter or step for {waited:.0f} s "
            "(its log says where the queues stand; learner.no_progress_s)"
        )
    return out
