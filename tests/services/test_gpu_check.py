"""`make gpu-check` (``bench/gpu/gpu_check.py``) in its CPU dry run: every section of the GPU
check (start-up, step, save, resume, publish to a receiver; the offload path; packed against
padded) runs through the learner's own functions at a tiny shape, so the script that only a GPU
machine runs for real cannot rot here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.slow


def test_gpu_check_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, "-m", "bench.gpu.gpu_check", "--dry-run", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["dry_run"] and r["ok"] and r["git"]["commit"]
    full = r["full"]
    assert full["resumed_loss_abs_diff"] == 0.0  # the resumed step repeats the second exactly
    assert full["publish"]["checksum_matches"] and full["publish"]["per_member"] == {"mem-0": "ok"}
    assert set(full["phases"]) == {"load", "step", "save", "resume", "publish"}
    assert set(full["versus_plan"]) == {"step", "save", "publish"}
    assert r["offload"]["loss"] == pytest.approx(full["losses"][0], rel=1e-5)
    assert r["packing"]["logp_max_abs_diff"] < 1e-4
