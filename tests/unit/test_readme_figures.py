"""Figures the README cites in its prose, pinned to their source: each test reads the README's
sentence or table and recomputes what it says from the committed result JSON or from the tool
that prints it. A figure changed in the README, or a result measured again, fails here until the
other follows. (The benchmark and demo tables are generated instead: test_results_provenance.py,
test_bench_demos.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tether.cli.main import main

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def _row(label: str) -> list[str]:
    """The cells of the README table row whose first cell starts with ``label``."""
    for line in README.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and cells[0].startswith(label):
            return cells[1:]
    raise AssertionError(f"no README table row starts with {label!r}")


def test_the_lora_measured_table_is_lora_json():
    r = json.loads((REPO / "bench" / "results" / "lora.json").read_text())
    lo, fu = r["lora"], r["full"]
    mib = 2**20

    def ratio(key: str, digits: int) -> str:
        return f"{r[f'{key}_lora_over_full']:.{digits}f}"

    assert _row("bytes per publish") == [
        f"{lo['publish_bytes'] / 1e6:.2f} MB",
        f"{fu['publish_bytes'] / 1e6:.1f} MB",
        ratio("publish_bytes", 3),
    ]
    assert _row("seconds per publish") == [
        f"{lo['publish_seconds_median']:.3f}",
        f"{fu['publish_seconds_median']:.3f}",
        ratio("publish_seconds_median", 2),
    ]
    assert _row("seconds per optimizer step") == [
        f"{lo['step_seconds_median']:.2f}",
        f"{fu['step_seconds_median']:.2f}",
        ratio("step_seconds_median", 2),
    ]
    assert _row("learner tensors") == [
        f"{lo['learner_state_bytes'] / mib:.0f} MiB",
        f"{fu['learner_state_bytes'] / mib:.0f} MiB",
        ratio("learner_state_bytes", 2),
    ]
    assert _row("peak resident memory") == [
        f"{lo['peak_rss_bytes'] / mib:,.0f} MiB",
        f"{fu['peak_rss_bytes'] / mib:,.0f} MiB",
        ratio("peak_rss_bytes", 2),
    ]
    s = r["settings"]
    assert (
        f"{s['num_layers']} layers), rank {s['rank']} on every linear layer" in README
        and f"{s['responses']} × {s['tokens']} tokens per step" in README
    )


def test_the_redis_figures_are_what_tether_plan_prints(capsys):
    assert main(["plan"]) == 0  # the seed 001 shape on H100 rates, as the README says
    out = capsys.readouterr().out
    m = re.search(r"([\d.]+) MB per cycle; a checkpoint every 30 min ≈ \d+ cycles: ≈ (\d+) MB", out)
    assert m, out
    per_cycle, peak = m.group(1), m.group(2)
    said = " ".join(README.split())  # the README wraps the sentence
    assert (
        f"(the seed 001 shape on H100s: {per_cycle} MB per cycle, ≈ {peak} MB at the peak" in said
    )
    # checkpoints only at the end: a thousand cycles' worth
    assert f"grows by {float(per_cycle):.1f} GB per 1,000 cycles" in said


def test_the_packing_ratios_are_learner_json():
    r = json.loads((REPO / "bench/results/learner.json").read_text())
    budget = r["packing_token_budget"]["ratio_packed_over_padded"]
    rows = r["packing"]["ratio_packed_over_padded"]
    said = " ".join(README.split())
    assert f"(`tether bench learner` at commit {r['git']['commit'][:7]}," in said
    assert f"packing trains **{budget:.2f}×** the tokens/s of padding with a token budget" in said
    assert (
        f"and **{rows:.2f}×** with micro-batches of {r['packing']['micro_batching']['micro_batch_size']} samples"
        in said
    )
    assert "`bench/results/learner.json`" in said


def test_the_lora_prose_figures_are_lora_json():
    r = json.loads((REPO / "bench" / "results" / "lora.json").read_text())
    said = " ".join(README.split())
    ref = r["full"]["reference_bytes"] / 2**20
    higher = (r["peak_rss_bytes_lora_over_full"] - 1) * 100
    assert f"no reference copy ({ref:.0f} MiB)" in said
    assert f"so the process peaked {higher:.0f} % higher" in said
    assert f"instead of {r['full']['trainable_parameters'] / 1e6:.1f} M" in said


def test_the_lora_memory_figures_are_memory_lora_json():
    r = json.loads((REPO / "bench" / "results" / "memory_lora.json").read_text())

    def peak(ranks: str, phase: str) -> float:  # the largest rank's peak RSS, GiB
        return max(x["phases"][phase]["peak_rss"] for x in r["ranks"][ranks]) / 2**30

    said = " ".join(README.split())
    up, step, save = ((peak("1", p), peak("2", p)) for p in ("startup", "step", "save"))
    assert (
        f"start-up {up[0]:.2f} → {up[1]:.2f} GiB per rank ({up[1] / up[0]:.2f}×), "
        f"save {save[1] / save[0]:.2f}×, the step's peak {step[0]:.2f} → {step[1]:.2f} GiB "
        f"({step[1] / step[0]:.2f}×" in said
    )
    assert f"rank {r['lora_rank']}, 1 vs 2 gloo ranks" in said


def test_the_routing_replay_figures_are_replay_json():
    r = json.loads((REPO / "bench" / "results" / "replay.json").read_text())
    moe, dense = r["arms"]["qwen3-moe/bfloat16"], r["arms"]["qwen3/bfloat16"]
    b, a = moe["before_update"], moe["after_update"]
    rl, bus = r["rl_runs"], r["bus"]
    text = " ".join(README.split())
    for figure in (
        f"{b['differing_frac']:.2%} of the MoE fixture's routing decisions differ",
        f"({a['differing_frac']:.2%} after an update)",
        f"the mean |Δ| from {b['own_mean_abs']:.4f} to {b['replay_mean_abs']:.4f}",
        f"the k3 KL from {b['own_k3']:.5f} to {b['replay_k3']:.5f}",
        f"from {b['own_max_abs']:.3f} to {b['replay_max_abs']:.3f}, lower on every seed",
        f"(after: {a['own_mean_abs']:.4f} to {a['replay_mean_abs']:.4f})",
        f"level in bf16 ({dense['before_update']['own_mean_abs']:.4f})",
        f"costs {r['wire']['qwen3-30b-a3b']['bytes_per_token']:.0f} B per token",
        f"mean |Δ| of {rl['mean_abs_diff_r3']:.4f} with replay against {rl['mean_abs_diff_off']:.4f}",
        f"lower at {rl['steps_replay_lower']} of {rl['steps_compared']} steps",
        f"({rl['step_seconds_r3']:.2f} s against {rl['step_seconds_off']:.2f} s)",
        f"grows from {bus['plain']['bytes_per_message'] / 1e3:.0f} kB to "
        f"{bus['routing']['bytes_per_message'] / 1e6:.2f} MB",
        f"{bus['messages_per_s_routing_over_plain']:.2f}× as many of them per second "
        f"({bus['routing']['mb_per_s']:.0f} MB/s against {bus['plain']['mb_per_s']:.0f})",
    ):
        assert figure in text, figure
    for phase in (b, a):  # "lower on every seed"
        assert all(s["replay"]["mean_abs"] < s["own"]["mean_abs"] for s in phase["seeds"])
    assert r["control"]["equal"] and r["settings"]["seeds"] == [0, 1, 2]


def test_the_race_figures_are_race_json():
    r = json.loads((REPO / "bench" / "results" / "race.json").read_text())
    n, c = r["noise"], r["control"]
    ratios = [x["time_ratio_rl_s"] for x in r["runs"]]
    half = (n["ci"][1] - n["ci"][0]) / 2
    text = " ".join(README.split())
    for figure in (
        f"over {len(n['seeds'])} seeds Tether minus TRL is {n['diff']:.3f}".replace("-", "−"),
        f"with a 95 % interval of ±{half:.2f}",
        f"from {min(ratios):.2f}× to {max(ratios):.2f}× between seeds",
    ):
        assert figure.replace("over 3", "over three") in text, figure
    # "the control reproduced the first run's every held-out point"
    first = next(x for x in r["runs"] if x["seed"] == c["seed"])["curves"][c["arm"]]
    assert [p["accuracy"] for p in c["curve"]] == [p["accuracy"] for p in first]
    assert "cannot tell at this scale" in n["verdict"]


def test_the_tools_reward_hack_figures_are_the_grading_any_json():
    """The hack's figures: the runs made before ``scorer.answer_form``, kept apart."""
    r = json.loads((REPO / "bench" / "results" / "demos" / "smollm2-tools-grading-any.json")
                   .read_text())  # fmt: skip
    hacked = [x for x in r["runs"] if x["seed"] in (1, 2)]
    text = " ".join(README.split())
    finals = " and ".join(f"{x['evals'][-1]['accuracy']:.2f}" for x in hacked)
    assert f"accuracy reaches {finals} while their tool-call rate stays at or below 0.031" in text
    assert max(s["tool_call_rate"] for x in hacked for s in x["steps"]) < 0.0315


def test_the_tools_rerun_figures_are_the_smollm2_tools_json():
    """The rerun with ``scorer.answer_form = "number"``: the prose says nothing moved."""
    demos = REPO / "bench" / "results" / "demos"
    r = json.loads((demos / "smollm2-tools.json").read_text())
    before = json.loads((demos / "smollm2-tools-grading-any.json").read_text())
    runs = r["runs"]
    text = " ".join(README.split())
    assert [x["seed"] for x in runs] == [0, 1, 2]
    # another config than the hack's runs (the answer form), the same for every seed
    assert {x["config_digest"] for x in runs} & {
        x["config_digest"] for x in before["runs"]
    } == set()
    assert len({x["config_digest"] for x in runs}) == 1
    assert "every seed's held-out accuracy is 0.00 before, at v6 and after 12 steps" in text
    assert all([e["round"] for e in x["evals"]] == [0, 6, 12] for x in runs)
    assert all(e["accuracy"] == 0.0 for x in runs for e in x["evals"])
    assert "the reward is 0 at every step of every seed" in text
    assert all(len(x["steps"]) == 12 for x in runs)
    assert all(s["reward_mean"] == 0.0 for x in runs for s in x["steps"])
    rate = max(s["tool_call_rate"] for x in runs for s in x["steps"])
    assert "and the tool-call rate stays at or below 0.031" in text and rate < 0.0315
