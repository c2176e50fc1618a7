"""`tether report RUN_DIR`: one self-contained HTML file that shows what a run did.

Reads ``metrics.jsonl`` (per-step and held-out evaluation records written by the learner),
``config.toml`` (the resolved config) and, when present, ``status.json`` (the last status
snapshot, written by the launcher at the end of a run: time breakdown per service, counters,
queues). Sections, tables and summary cards surround the plots of ``plots``, PNGs drawn with
matplotlib's Agg backend and embedded as base64: everything is inline (CSS too), so the file can
be mailed or attached to an issue as is.
"""

from __future__ import annotations

import html
import json
import logging
import time
from pathlib import Path
from typing import Any

from common.protocol.books import BooksError
from common.protocol.run_dir import RunDir
from tether.runs.report import plots as rp
from tether.runs.report.data import (
    SECTIONS,
    accounting_rows,
    read_config,
    read_metrics,
    service_rates,
)

log = logging.getLogger(__name__)

NO_SNAPSHOT = (
    "no status snapshot (status.json) in the run directory: the launcher writes it when a run ends"
)


def esc(x: Any) -> str:
    return html.escape(str(x))


def when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1140px;margin:24px auto;
padding:0 16px;color:#212121}h1{margin-bottom:4px}.sub{color:#616161;margin-top:0}
section{margin:28px 0;border-top:1px solid #e0e0e0}h2{font-size:1.2em;margin:16px 0 8px}
img{max-width:100%}.note{color:#616161;font-size:.9em;margin:4px 0 8px}
.cards{display:flex;flex-wrap:wrap;gap:10px}.card{border:1px solid #e0e0e0;border-radius:6px;
padding:8px 14px;min-width:140px}.card b{display:block;font-size:1.3em}.card span{color:#616161;font-size:.85em}
table{border-collapse:collapse;font-size:.92em}td,th{border-bottom:1px solid #eee;padding:4px 12px;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}tr.bad td{color:#c62828;font-weight:600}
tr.ok td{color:#2e7d32;font-weight:600}pre{background:#fafafa;border:1px solid #eee;padding:10px;overflow:auto;font-size:.85em}
"""


def img_tag(b64: str | None, alt: str, missing: str) -> str:
    if b64 is None:
        return f'<p class="note">{esc(missing)}</p>'
    return f'<img src="data:image/png;base64,{b64}" alt="{esc(alt)}">'


def _section(key: str, body: str, note: str = "") -> str:
    note_html = f'<p class="note">{esc(note)}</p>' if note else ""
    return f'<section id="{key}"><h2>{esc(SECTIONS[key])}</h2>{note_html}{body}</section>'


def html_table(head: list[str], rows: list[list[Any]], *, classes: list[str] | None = None) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f'<td class="num">{v:,.3g}</td>'
        return f'<td class="num">{v:,}</td>' if isinstance(v, int) else f"<td>{esc(v)}</td>"

    cls = classes or [""] * len(rows)
    body = "".join(
        f'<tr class="{c}">' + "".join(cell(v) for v in r) + "</tr>"
        for c, r in zip(cls, rows, strict=True)
    )
    return "<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + f"</tr>{body}</table>"


def _summary(steps: list[dict], evals: list[dict], status: dict | None) -> str:
    cards = [("optimizer steps", str(steps[-1]["step"]) if steps else "0")]
    if steps:
        tail = steps[-max(1, len(steps) // 10) :]
        cards.append(
            (
                "reward, last 10% of steps",
                f"{sum(s.get('reward_mean', 0) for s in tail) / len(tail):.3f}",
            )
        )
    if evals:
        cards.append(
            ("held-out accuracy", f"{evals[0]['accuracy']:.1%} → {evals[-1]['accuracy']:.1%}")
        )
    times = [r["time"] for r in steps + evals if r.get("time")]
    if len(times) > 1:
        cards.append(
            ("wall time (first to last record)", f"{(max(times) - min(times)) / 60:.1f} min")
        )
    if status:
        cards.append(("dead letters", str(status.get("dead_letters", 0))))
        b = status.get("bottleneck") or {}
        if b:
            cards.append(
                ("bottleneck (busiest stage)", f"{b['service']} {b['busy_fraction']:.0%} busy")
            )
    return (
        '<div class="cards">'
        + "".join(f'<div class="card"><b>{esc(v)}</b><span>{esc(k)}</span></div>' for k, v in cards)
        + "</div>"
    )


def _rates(status: dict, n: int) -> str:
    rows = []
    for s in status.get("services", []):
        r = service_rates(s, responses_per_prompt=n)
        rows.append(
            [
                s["service"],
                s["id"],
                r["uptime_s"],
                r.get("groups_per_s", "-"),
                r.get("tokens_per_s", "-"),
                r.get("samples_per_s", "-"),
            ]
        )
    return html_table(
        ["service", "replica", "uptime s", "groups/s", "tokens/s", "trained responses/s"], rows
    )


def _status_sections(status: dict | None, evals: list[dict], run: dict) -> dict[str, str]:
    """Throughput-per-stage extras, time breakdown and accounting: they need the snapshot."""
    if not status:
        return {
            k: f'<p class="note">{esc(NO_SNAPSHOT)}</p>' for k in ("rates", "time", "accounting")
        }
    n, passes = int(run.get("responses_per_prompt", 1)), int(run.get("passes_per_cycle", 1))
    services = sorted(
        status.get("services", []), key=lambda s: (s.get("service", ""), s.get("id", ""))
    )
    status = {**status, "services": services}
    sections = {
        "rates": img_tag(rp.plot_stage_rates(services, n), "rates per stage", "no rates")
        + _rates(status, n),
        "time": img_tag(
            rp.plot_time(services), "time breakdown", "no phase timings in the snapshot"
        ),
    }
    try:
        rows = accounting_rows(
            status,
            responses_per_prompt=n,
            passes_per_cycle=passes,
            eval_groups=sum(int(e.get("n", 0)) for e in evals),
        )
    except BooksError as exc:  # a snapshot another Tether wrote: the rest of the page stands
        return {**sections, "accounting": f'<p class="note">{esc(f"books not read: {exc}")}</p>'}
    cls = [""] * (len(rows) - 1) + ["ok" if rows[-1][2] == 0 else "bad"]
    table = html_table(["", "trajectories", "from"], [list(r[1:]) for r in rows], classes=cls)
    return {**sections, "accounting": table}


def render(
    *,
    run_dir: Path,
    steps: list[dict],
    evals: list[dict],
    cfg: dict,
    cfg_text: str,
    status: dict | None,
) -> str:
    """The whole page; sections follow ``SECTIONS``."""
    run = cfg.get("run", {})
    batch = int(
        run.get("train_batch_size")
        or run.get("prompts_per_cycle", 1) * run.get("responses_per_prompt", 1)
    )
    extra = _status_sections(status, evals, run)
    snap_note = (
        f"in trajectories (responses), from the status snapshot of {when(status.get('time'))}"
        if status
        else ""
    )
    parts = [
        _section(
            "reward",
            img_tag(
                rp.plot_reward(steps, evals),
                "reward and accuracy",
                "no steps or evaluations recorded yet",
            ),
        ),
        _section(
            "throughput",
            img_tag(rp.plot_throughput(steps, batch), "throughput", "no steps recorded yet")
            + extra["rates"],
            f"{batch} responses per optimizer step; stage rates are lifetime averages of each replica",
        ),
        _section(
            "staleness",
            img_tag(rp.plot_staleness(steps), "staleness", "no staleness recorded"),
            f"max_staleness = {run.get('max_staleness', '?')}: each step's oldest trajectory, in optimizer steps behind the learner",
        ),
        _section(
            "mismatch",
            img_tag(rp.plot_mismatch(steps), "mismatch", "no mismatch statistics recorded"),
            "log-probs of the sampled tokens under the generator (behaviour) vs the learner, before the update",
        ),
        *(
            [
                _section(
                    "episodes",
                    img_tag(rp.plot_episodes(steps), "episodes", "no episodes recorded"),
                    "per optimizer step, over the episodes it trained; the staleness above counts "
                    "from each episode's oldest sampled token",
                )
            ]
            if rp.episodes_recorded(steps)
            else []
        ),  # fmt: skip
        _section("time", extra["time"]),
        _section("accounting", extra["accounting"], snap_note),
        _section(
            "config",
            f"<pre>{esc(cfg_text) or 'no config.toml'}</pre>",
            str(RunDir(run_dir).config),
        ),
    ]
    title = f"Tether run {run.get('name', run_dir.name)}"
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{esc(title)}</title><style>{CSS}</style></head><body>'
        f'<h1>{esc(title)}</h1><p class="sub">{esc(run_dir)} · report drawn {when(time.time())}</p>'
        f'<section id="summary">{_summary(steps, evals, status)}</section>'
        + "".join(parts)
        + "</body></html>\n"
    )


def write_report(run_dir: str | Path, *, out: str | Path | None = None) -> Path:
    """Write the HTML report (default ``<run_dir>/report.html``) and return its path."""
    run_dir = Path(run_dir)
    paths = RunDir(run_dir)
    if not paths.metrics.exists() and not paths.config.exists():
        raise ValueError(
            f"{run_dir}: not a Tether run directory (no metrics.jsonl or config.toml); pass runs/<name>"
        )
    steps, evals = read_metrics(run_dir)
    cfg, cfg_text = read_config(run_dir)
    snap = paths.status_snapshot
    status = json.loads(snap.read_text(encoding="utf-8")) if snap.exists() else None
    page = render(
        run_dir=run_dir, steps=steps, evals=evals, cfg=cfg, cfg_text=cfg_text, status=status
    )
    path = Path(out) if out else paths.report
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    log.info("report written to %s", path)
    return path
