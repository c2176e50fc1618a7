"""Sharded start-up loads every family to the values ``from_pretrained`` gives (the path the
learner used before), on 1 and 2 real gloo ranks, from a single safetensors file and from an
indexed multi-file checkpoint; each rank holds only its shards.

One torchrun per world size runs ``tests/procs/sharded_load_worker.py`` over every family of
``tether bench models`` (tiny models, built once per clone under ``.cache/families``) plus two
re-saved as indexed multi-file checkpoints (a tied-embedding model and the MoE).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.model_families import FAMILIES, build_family, default_root
from tests.paths import REPO

WORKER = REPO / "tests" / "procs" / "sharded_load_worker.py"
INDEXED = ("qwen3", "qwen3-moe")  # tied embeddings; routed experts stored one tensor per expert


def _indexed_copy(model_dir: Path, out: Path) -> Path:
    """``model_dir`` re-saved in bf16 as several safetensors files plus the index."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    model.save_pretrained(str(out), max_shard_size="1MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (model_dir / name).exists():
            shutil.copyfile(model_dir / name, out / name)
    assert (out / "model.safetensors.index.json").exists()
    assert len(list(out.glob("model-*.safetensors"))) > 2
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> list[Path]:
    dirs = [build_family(name, default_root()) for name in FAMILIES]
    root = tmp_path_factory.mktemp("indexed")
    dirs += [_indexed_copy(build_family(n, default_root()), root / n) for n in INDEXED]
    return dirs


@pytest.mark.parametrize("world", [1, 2])
def test_sharded_start_up_equals_from_pretrained(
    model_dirs: list[Path], world: int, tmp_path: Path
) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
           str(WORKER), "--out", str(tmp_path), *map(str, model_dirs)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for model_dir in map(str, model_dirs):
        name = Path(model_dir).name
        per_rank = [r[model_dir] for r in ranks]
        for rank, res in enumerate(per_rank):
            assert res["mismatched"] == [], (name, rank)
            assert res["reference_mismatched"] == [], (name, rank)
            assert res["reference_trainable"] == 0, (name, rank)
            assert res["tied_still_tied"] in (None, True), (name, rank)
            assert res["fsdp_params"] == res["parameters"], (name, rank)
            assert res["max_logit_diff"] < 1e-4, (name, rank, res["max_logit_diff"])
        held = [res["held_elements"] for res in per_rank]
        total = per_rank[0]["total_elements"]
        assert sum(held) == total, (name, held, total)  # every element exactly once
        if world > 1:  # nobody holds the whole model: at most one uneven row per tensor extra
            assert max(held) < 0.52 * total, (name, held, total)
