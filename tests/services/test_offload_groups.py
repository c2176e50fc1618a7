"""learner.cpu_offload on a GPU: host tensors must never reach NCCL.

With offload the parameter shards, their gradients and AdamW's state are host tensors, and the
collectives the learner runs outside FSDP's all-gather / reduce-scatter take tensors made from
them. ``model.process_group_backend`` then gives the process group a gloo backend for host
tensors beside the device's. The 2-rank run (tests/procs/offload_worker.py) replaces NCCL with a
named fake registered as NCCL is (for CUDA only), since no GPU is here: with the group the
learner used to build (the device backend alone) the offload path fails at its first host
tensor (here FSDP's own first all-gather, since this CPU computes on host tensors too; on a GPU
the gradient norm's all-reduce, the first collective outside FSDP); with the group it builds now
it runs start-up, a step, a checkpoint, a publish's gather and a resume. What no CPU can show:
that device tensors reach NCCL (``make gpu-check`` runs the offload path on a GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.learner.model import process_group_backend
from tests.paths import REPO
from tether.demo.tiny_model import build_tiny_model

WORKER = REPO / "tests" / "procs" / "offload_worker.py"


def test_backend_string() -> None:
    assert process_group_backend("cuda", "nccl", offload=True) == "cpu:gloo,cuda:nccl"
    assert process_group_backend("cuda", "nccl", offload=False) == "nccl"
    assert process_group_backend("cpu", "gloo", offload=True) == "gloo"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=64, num_layers=2)


def _run(groups: str, model: Path, out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           str(WORKER), "--model", str(model), "--out", str(out), "--groups", groups]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)


@pytest.mark.slow
def test_offload_path_keeps_host_tensors_off_the_device_backend(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    old = _run("old", tiny_model_dir, tmp_path / "old")
    assert old.returncode != 0
    assert "No backend type associated with device type cpu" in old.stderr, old.stderr[-3000:]
    new = _run("new", tiny_model_dir, tmp_path / "new")
    assert new.returncode == 0, new.stdout[-2000:] + new.stderr[-5000:]
    report = json.loads((tmp_path / "new" / "report.json").read_text())
    assert report["backend"] == "cpu:gloo,cuda:fake_nccl"
    assert report["grad_norm"] > 0 and report["loss"] > 0
    assert report["published"] > 0 and report["resumed_step"] == 1
