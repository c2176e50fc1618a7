"""Sharded checkpoints across numbers of ranks (real gloo ranks under torchrun): a checkpoint
written by 2 ranks resumes on 1 and one written by 1 resumes on 2, and the next steps' losses are
those of the run that went on without stopping (``tests/procs/reshard_worker.py``; the save is
asynchronous, started before a training step that changes the weights in place)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO
from tether.demo.tiny_model import build_tiny_model

WORKER = REPO / "tests" / "procs" / "reshard_worker.py"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    # 259-row embedding: uneven shards over 2 ranks (the padded path)
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=64, num_layers=2)


def _run(world: int, model: Path, run_dir: Path, out: Path, mode: str) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
           "--standalone", str(WORKER), "--model", str(model), "--run-dir", str(run_dir),
           "--out", str(out), f"--{mode}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["world"] == world
    return report["losses"]


@pytest.mark.parametrize(("saved_by", "resumed_by"), [(2, 1), (1, 2)])
def test_resume_on_another_number_of_ranks(
    tiny_model_dir: Path, tmp_path: Path, saved_by: int, resumed_by: int
) -> None:
    run_dir = tmp_path / "run"
    straight = _run(saved_by, tiny_model_dir, run_dir, tmp_path / "save.json", "save")
    meta = json.loads((run_dir / "checkpoints" / "step-1" / "meta.json").read_text())
    assert meta["world_size"] == saved_by and meta["format_version"] == 2
    shards = list((run_dir / "checkpoints" / "step-1" / "state").glob("shard-*.safetensors"))
    assert len({p.name.split("-model-")[0] for p in shards}) == saved_by  # every rank wrote
    files = [p for p in (run_dir / "checkpoints" / "step-1").rglob("*") if p.is_file()]
    assert {p.suffix for p in files} == {".json", ".safetensors"}  # no pickled DCP .metadata
    resumed = _run(resumed_by, tiny_model_dir, run_dir, tmp_path / "resume.json", "resume")
    print(f"{saved_by} -> {resumed_by} ranks: went on {straight}, resumed {resumed}")
    assert resumed == pytest.approx(straight, abs=2e-5)
