"""One run of the staleness study at a toy size (a random tiny model, 2 prompts × 8 responses
per step, η = 1): the learner's code trains on responses from the policy one cycle old, the
records carry every diagnostic, and a run is deterministic (the same numbers twice)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.staleness import run_all
from bench.staleness_design import Arm, Study
from bench.staleness_report import write_report
from bench.staleness_run import _Policies, arm_config, run_arm
from bench.staleness_stats import per_arm
from common.data.prompts import encode_prompt
from tether.demo.tasks import ArithmeticTask, write_task
from tether.demo.tiny_model import build_tiny_model
from tether.demo.warmup import warmup_sft


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    base = build_tiny_model(root / "base", hidden_size=32, num_layers=1, num_heads=2)
    task = ArithmeticTask(digits=1, num_train=40, num_eval=8, prompt_style="short")
    paths = write_task(root / "data", task)
    # a short supervised pass so some answers are right and the rewards of a group differ
    model = root / "model"
    warmup_sft(base, paths["train"], steps=60, lr=1e-2, batch_size=32, seed=0, out_dir=model)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    rows = [json.loads(x) for x in paths["eval"].read_text().splitlines()]
    held = root / "held_out.jsonl"
    held.write_text("".join(
        json.dumps({"prompt_token_ids": encode_prompt(tok, r["prompt"]), "answer": r["answer"]}) + "\n"
        for r in rows
    ))  # fmt: skip
    return {"model_dir": str(model), "train_path": str(paths["train"]), "held_out_path": str(held)}


def test_a_lagged_run_records_its_diagnostics_and_repeats_exactly(assets):
    arm = Arm(correction="decoupled", eta=1, steps_per_cycle=1)
    study = Study(arms=(arm,), steps=3, prompts_per_step=2, lr=3e-3, eval_every=3, held_out=8)
    first = run_arm(arm, study, seed=1, assets=assets)
    again = run_arm(arm, study, seed=1, assets=assets)
    assert [e[0] for e in first["evals"]] == [0, 3] and len(first["steps"]) == 3
    keys = {"reward_mean", "kl_behaviour_learner", "kl_step", "is_weight_mean", "is_weight_max",
            "is_over_2_frac", "is_over_5_frac", "ess_frac", "clip_frac", "masked_or_capped_frac",
            "grad_norm"}  # fmt: skip
    assert set(first["steps"][0]) == keys
    # step 1 (cycle 0) is synchronous: behaviour = proximal, every weight 1 (to float error)
    assert first["steps"][0]["is_weight_max"] == pytest.approx(1.0, abs=1e-3)
    assert 0 < sum(s["reward_mean"] for s in first["steps"]) < 3, first["steps"]
    # steps 2 and 3 train on responses of the policy one step older: the weights move off 1
    assert first["steps"][2]["is_weight_max"] > 1.001 and first["steps"][2]["kl_step"] > 0
    assert first["steps"][2]["kl_behaviour_learner"] > 0
    assert first["evals"] == again["evals"] and first["steps"] == again["steps"]


def test_the_behaviour_policy_is_the_one_eta_cycles_back(assets):
    """η = 2: cycles 0 and 1 sample from themselves, cycle c ≥ 2 from the weights at the start
    of cycle c − 2, and only the weights a later cycle needs are kept."""
    import torch

    arm = Arm(correction="none", eta=2, steps_per_cycle=1)
    study = Study(arms=(arm,), steps=4, prompts_per_step=2, eval_every=4)
    cfg = arm_config(arm, study, seed=0, model_dir=Path(assets["model_dir"]),
                     train_path=Path(assets["train_path"]))  # fmt: skip
    models = _Policies(cfg, Path(assets["model_dir"]))
    weight = next(iter(models.policy.parameters()))
    seen = []
    for cycle in range(5):
        with torch.no_grad():
            weight.fill_(float(cycle))  # stands for the policy's training in cycle c − 1
        got = models.start_cycle(cycle, eta=2)
        behaviour = next(iter(models.behaviour.parameters()))
        seen.append((got, float(behaviour.detach().flatten()[0])))
        assert set(models.snapshots) == {c for c in range(cycle + 1) if c > cycle - 2}
    assert seen == [(0, 0.0), (1, 1.0), (0, 0.0), (1, 1.0), (2, 2.0)]


def test_the_driver_keeps_finished_runs_and_resumes(assets, tmp_path):
    """Two arms × two seeds in worker processes; a second invocation finds all four and runs
    nothing (an interrupted study resumes from the files); the tests and report run on them."""
    arms = (Arm(correction="sync", eta=0, steps_per_cycle=1),
            Arm(correction="none", eta=1, steps_per_cycle=1))  # fmt: skip
    study = Study(arms=arms, seeds=(0, 1), steps=2, prompts_per_step=2, eval_every=2,
                  held_out=8, workers=2)  # fmt: skip
    runs, made = run_all(study, tmp_path, assets=assets)
    assert len(runs) == 4 and made["runs_reused"] == 0
    files = sorted(Path(made["runs_dir"]).glob("*.json"))
    assert [f.name for f in files] == [f"{a.name}-seed{s}.json" for a in arms for s in (0, 1)]
    assert all(json.loads(f.read_text())["git"]["commit"] for f in files)
    again, made2 = run_all(study, tmp_path, assets=assets)
    assert made2["runs_reused"] == 4 and made2["runs_dir"] == made["runs_dir"]
    key = lambda r: (r["arm"], r["seed"])  # noqa: E731
    assert sorted(again, key=key) == sorted(runs, key=key)
    arm_stats = per_arm(runs)
    assert set(arm_stats) == {a.name for a in arms}
    png = write_report({"arms": arm_stats}, tmp_path / "staleness.json")["png"]
    assert png.exists() and png.stat().st_size > 1000
