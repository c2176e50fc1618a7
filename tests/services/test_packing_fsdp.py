"""Sequence packing under FSDP2 on 2 real gloo ranks (a ``torchrun`` subprocess,
tests/procs/packing_worker.py): the start-up probe passes on sharded weights and a packed step
has the padded step's loss and gradient norm."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO
from tether.demo.tiny_model import build_tiny_model

WORKER = REPO / "tests" / "procs" / "packing_worker.py"


@pytest.mark.slow
def test_packed_step_matches_padded_on_two_fsdp_ranks(tmp_path):
    model = build_tiny_model(tmp_path / "model", hidden_size=64, num_layers=2)
    out = tmp_path / "report.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
        str(WORKER), "--model", str(model), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads(out.read_text())
    assert r["padded"]["packed_micro_batches"] == 0 and r["packed"]["packed_micro_batches"] > 0
    assert r["packed"]["loss"] == pytest.approx(r["padded"]["loss"], abs=1e-6)
    assert abs(r["padded"]["loss"]) > 1e-5
    assert r["packed"]["grad_norm"] == pytest.approx(r["padded"]["grad_norm"], rel=1e-5)
