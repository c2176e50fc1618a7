"""The report's plots: matplotlib figures (Agg backend) returned as base64 PNG strings, or None
when the run has no data for them. Imported by ``page`` only when a report is drawn."""

from __future__ import annotations

import base64
import io
from typing import Any

from tether.runs.report.data import service_rates

UNTIMED = "not timed (start-up)"
# One colour per phase, shared by every bar so the legend reads the same across services.
PHASE_COLOURS = {
    "working": "#2e7d32",
    "syncing_weights": "#1565c0",
    "checkpointing": "#6a1b9a",
    "waiting_input": "#bdbdbd",
    "blocked_staleness": "#ef6c00",
    "blocked_backpressure": "#c62828",
    "idle": "#eeeeee",
    UNTIMED: "#fff3b0",
}


def png_b64(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def figure(ncols: int = 1, *, height: float = 3.4, integer_x: bool = True) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(11, height), squeeze=False)
    from matplotlib.ticker import MaxNLocator

    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
        if integer_x:  # optimizer steps
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, axes[0]


def plot_reward(steps: list[dict[str, Any]], evals: list[dict[str, Any]]) -> str | None:
    if not steps and not evals:
        return None
    fig, (ax,) = figure()
    if steps:
        ax.plot(
            [s["step"] for s in steps],
            [s.get("reward_mean", float("nan")) for s in steps],
            "o-",
            ms=3,
            label="training reward (mean per step)",
        )
    if evals:
        ax.plot(
            [e["eval_round"] for e in evals],
            [e["accuracy"] for e in evals],
            "s--",
            color="#d84315",
            label="held-out accuracy",
        )
    ax.set(xlabel="optimizer step (policy version)", ylabel="reward / accuracy")
    ax.legend(loc="best")
    return png_b64(fig)


def plot_throughput(steps: list[dict[str, Any]], batch: int) -> str | None:
    if not steps:
        return None
    fig, (ax,) = figure()
    xs = [s["step"] for s in steps]
    trained = [batch - s.get("dropped_stale", 0) for s in steps]
    ax.plot(
        xs,
        [t / max(s.get("seconds", 0), 1e-9) for t, s in zip(trained, steps, strict=True)],
        "o-",
        ms=3,
        label="learner compute: responses / step seconds",
    )
    wall = [
        (b["step"], t / (b["time"] - a["time"]))
        for a, b, t in zip(steps, steps[1:], trained[1:], strict=False)
        if b.get("time", 0) > a.get("time", 0)
    ]
    if wall:
        ax.plot(
            *zip(*wall, strict=True),
            "s--",
            ms=3,
            label="end to end: responses / wall seconds between steps",
        )
    ax.set(xlabel="optimizer step", ylabel="responses trained per second")
    ax.legend(loc="best")
    return png_b64(fig)


def plot_staleness(steps: list[dict[str, Any]]) -> str | None:
    values = [int(s["staleness_max"]) for s in steps if s.get("staleness_max") is not None]
    if not values:
        return None
    fig, (ax,) = figure(height=2.8)
    ks = list(range(min(values), max(values) + 1))
    ax.bar(ks, [values.count(k) for k in ks], color="#5c6bc0", width=0.6)
    ax.set_xticks(ks)
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="largest staleness in the step (optimizer steps behind)", ylabel="steps")
    return png_b64(fig)


def plot_mismatch(steps: list[dict[str, Any]]) -> str | None:
    keys = [
        ("mismatch_kl_k3_mean", "KL(behaviour ‖ learner), k3 mean"),
        ("mismatch_abs_diff_mean", "mean |log p_behaviour − log p_learner|"),
    ]
    present = [(k, t) for k, t in keys if any(k in s for s in steps)]
    if not present:
        return None
    fig, axes = figure(len(present))
    for ax, (key, title) in zip(axes, present, strict=True):
        pts = [(s["step"], s[key]) for s in steps if key in s]
        ax.plot(*zip(*pts, strict=True), "o-", ms=3, color="#00838f")
        if all(v > 0 for _, v in pts):
            ax.set_yscale("log")
        ax.set(title=title, xlabel="optimizer step")
    return png_b64(fig)


def episodes_recorded(steps: list[dict[str, Any]]) -> bool:
    """Whether the run trained episodes with tools (a single-turn run has one turn and no
    tool calls in every step)."""
    return any(
        s.get("tool_calls_per_episode", 0) > 0 or s.get("episode_turns_mean", 1) > 1 for s in steps
    )


def plot_episodes(steps: list[dict[str, Any]]) -> str | None:
    """Tool use over steps: the share of episodes that called a tool and tool calls per
    episode; turns per episode and the share of failed calls."""
    if not episodes_recorded(steps):
        return None
    fig, (left, right) = figure(2)
    x = [s["step"] for s in steps if "tool_call_rate" in s]
    for ax, keys in (
        (left, (("tool_call_rate", "episodes that called a tool"),
                ("tool_calls_per_episode", "tool calls per episode"))),
        (right, (("episode_turns_mean", "assistant turns per episode"),
                 ("tool_error_rate", "failed share of tool calls"))),
    ):  # fmt: skip
        for key, label in keys:
            ax.plot(x, [s[key] for s in steps if "tool_call_rate" in s], "o-", ms=3, label=label)
        ax.set(xlabel="optimizer step")
        ax.legend(loc="best", fontsize=8)
    return png_b64(fig)


def _with_untimed(service: dict[str, Any]) -> dict[str, float]:
    """Phase seconds plus the uptime no phase covers (start-up: loading the model, warm-up)."""
    phases = dict(service.get("phases") or {})
    uptime = float(service.get("heartbeat", 0)) - float(service.get("started", 0))
    if uptime > sum(phases.values()) > 0:
        phases[UNTIMED] = uptime - sum(phases.values())
    return phases


def plot_time(services: list[dict[str, Any]]) -> str | None:
    """One stacked bar per replica: the fraction of its uptime spent in each phase."""
    rows = [(f"{s['service']} {s['id']}", _with_untimed(s)) for s in services]
    rows = [(name, ph) for name, ph in rows if sum(ph.values()) > 0]
    if not rows:
        return None
    fig, (ax,) = figure(height=0.5 * len(rows) + 1.6, integer_x=False)
    phases = [p for p in PHASE_COLOURS if any(p in ph for _, ph in rows)]
    phases += sorted({p for _, ph in rows for p in ph} - set(phases))
    for i, (_, ph) in enumerate(rows):
        total, left = sum(ph.values()), 0.0
        for p in phases:
            frac = ph.get(p, 0.0) / total
            ax.barh(i, frac, left=left, color=PHASE_COLOURS.get(p, "#8d6e63"), label=p)
            left += frac
        ax.text(1.01, i, f"{total:.0f} s", va="center")
    ax.set_yticks(range(len(rows)), [name for name, _ in rows])
    ax.invert_yaxis()
    ax.set(xlim=(0, 1), xlabel="fraction of the replica's uptime (total on the right)")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=True))
    ax.legend(
        uniq.values(),
        uniq.keys(),
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=len(uniq),
        frameon=False,
        fontsize="small",
    )
    return png_b64(fig)


def plot_stage_rates(services: list[dict[str, Any]], responses_per_prompt: int) -> str | None:
    """Groups per second of each replica over its lifetime: generated, scored, trained."""
    bars = [
        (
            f"{s['service']} {s['id']}",
            service_rates(s, responses_per_prompt=responses_per_prompt).get("groups_per_s"),
        )
        for s in services
    ]
    bars = [(k, v) for k, v in bars if v is not None]
    if not bars:
        return None
    fig, (ax,) = figure(height=0.45 * len(bars) + 1.2, integer_x=False)
    colours = {"generator": "#1565c0", "scorer": "#6a1b9a", "learner": "#2e7d32"}
    ax.barh(
        range(len(bars)),
        [v for _, v in bars],
        color=[colours.get(k.split()[0], "#757575") for k, _ in bars],
    )
    ax.set_yticks(range(len(bars)), [k for k, _ in bars])
    ax.invert_yaxis()
    ax.set(xlabel="groups per second (lifetime average; generators include evaluation groups)")
    return png_b64(fig)
