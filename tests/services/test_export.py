"""``tether export`` writes the HF layout transformers saves, in several files when asked, from a
sharded checkpoint of every model family (MoE experts back to one tensor per expert, tied
embeddings left out), and the export loads to the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures.model_families import FAMILIES, build_family, default_root
from services.learner.checkpoint import save_checkpoint
from services.learner.export import export_hf
from services.learner.model import attention_kwargs, load_policy
from services.learner.optim import build_optimizer, build_schedule, build_scheduler


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_of_a_checkpoint_is_the_saved_layout(family: str, tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model_dir = build_family(family, default_root())
    model = load_policy(model_dir, device=torch.device("cpu"), fsdp=False)
    optimizer = build_optimizer(model, lr=1e-3)
    scheduler = build_scheduler(optimizer, build_schedule(warmup_steps=1))
    save_checkpoint(tmp_path / "run", 1, model=model, optimizer=optimizer, scheduler=scheduler,
                    extra_state={})  # fmt: skip
    out = export_hf(tmp_path / "run", tmp_path / "out", shard_bytes=1 << 20)
    assert out is not None
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((out / f).exists() for f in files)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        original = set(f.keys())
    assert set(index["weight_map"]) == original  # the names (and count) save_pretrained wrote
    kwargs = attention_kwargs(model_dir)
    want = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **kwargs)
    got = AutoModelForCausalLM.from_pretrained(str(out), **kwargs)
    assert got.dtype == torch.float32
    ids = torch.arange(3, 30).reshape(1, -1)
    with torch.no_grad():
        diff = (got(input_ids=ids).logits - want(input_ids=ids).logits).abs().max()
    assert float(diff) == 0.0
