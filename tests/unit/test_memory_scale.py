"""``bench/memory_scale.py``: the learner's step under fake tensors with a fake process group and
torch's FSDP memory tracker (what `tether bench memory --size scale` runs at 32B), here at a
small dense shape where the bytes of each phase can be written down exactly."""

from __future__ import annotations

import pytest

from tether.runs import memory_plan

pytestmark = pytest.mark.slow  # ~1 min: a fake-tensor step of a 2-layer model at world size 8


def test_the_fake_tensor_step_counts_the_model_states_exactly(monkeypatch) -> None:
    from bench import memory_scale  # noqa: PLC0415 - loads torch

    shape = memory_plan.ModelShape(name="test-small", hidden=256, layers=2, heads=4, kv_heads=2,
                                   head_dim=64, intermediate=512, vocab=4096)  # fmt: skip
    monkeypatch.setitem(memory_plan.MODELS, shape.name, shape)
    m = memory_scale.measure(shape.name, offload=False, tokens=128, world=8)
    phases = m["phases"]
    assert set(phases) == {"forward_backward", "optimizer", "checkpoint", "publish"}
    local = phases["checkpoint"]["Sharded Param"]  # this rank's fp32 shards (padded by FSDP)
    assert shape.params * 4 / 8 <= local < shape.params * 4 / 8 * 1.05
    # a save's state dict is views: the weights and AdamW's two moments, nothing more
    assert phases["checkpoint"]["Total"] == pytest.approx(3 * local, rel=0.01)
    # the step: weights, gradients, moments, and the multi-tensor step's temporary (4P/R)
    assert phases["optimizer"]["Sharded Grad"] == local
    assert phases["optimizer"]["Total"] == pytest.approx(5 * local, rel=0.02)
    # forward/backward gathers the units (bf16) and holds activations on top of the states
    assert phases["forward_backward"]["Total"] > 3 * local
    assert phases["forward_backward"]["Unsharded Param"] > 0
