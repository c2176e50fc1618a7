"""`tether demo` with LoRA, reduced: the real command, every real service, the learner training
a LoRA adapter and the generator serving each version of it from memory (adapter-only
publishes). The three-seed numbers are in the README ("LoRA")."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e_support import demo_assets_dir

CYCLES = 8  # 16 optimizer steps of 64 responses
LORA = ["learner.lora_rank=16", "learner.lora_alpha=32", "learner.lr=5e-4"]


@pytest.mark.slow
def test_reduced_lora_demo_learns_through_adapter_only_updates(tmp_path: Path):
    cmd = [sys.executable, "-m", "tether.cli", "demo", "--num-cycles", str(CYCLES),
           "--assets", str(demo_assets_dir(tmp_path.parent))]  # fmt: skip
    for setting in [
        'run.name="demo-lora-test"',
        f"run.run_dir={json.dumps(str(tmp_path))}",
        "learner.eval_every_steps=0",
        "learner.checkpoint_every_steps=0",
        *LORA,
    ]:
        cmd += ["--set", setting]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    run = tmp_path / "demo-lora-test"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert evals[0]["eval_round"] == 0 and evals[-1]["eval_round"] == 2 * CYCLES
    assert evals[-1]["accuracy"] >= evals[0]["accuracy"] + 0.1, evals
    logs = "\n".join(p.read_text(errors="replace") for p in (run / "logs").glob("*.log"))
    assert "LoRA rank 16 (alpha 32)" in logs  # the learner trained an adapter
    # the generator applied every version as an adapter, never a full update
    assert f"now on policy version {2 * CYCLES} (adapter," in logs
    assert "(weights," not in logs
    checkpoints = sorted((run / "checkpoints").glob("step-*"))
    assert (checkpoints[-1] / "adapter_model.safetensors").exists()
