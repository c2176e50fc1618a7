"""The generator's side of an update at the sizes users train (issue 44, item 4): a receiver
stages one unit at a time in one buffer, so its peak memory over an update is its own model
plus about the largest unit, not a second (or, as before, a third) copy of the model. Real
TCPStore, real gloo, a real receiver process running the vLLM worker's load loop
(``tests/procs/update_memory.py``); the model is Qwen2.5-0.5B's shape in bf16."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from bench.memory import SHAPES  # noqa: E402
from common.weights.publisher import WeightPublisher  # noqa: E402
from tests.paths import REPO  # noqa: E402
from tests.weights_support import wait_for  # noqa: E402

pytestmark = pytest.mark.slow


def qwen_shape_specs(shape: dict) -> list[tuple[str, list[int]]]:
    """The tensors of a Qwen2 decoder of ``shape`` (tied embeddings), Hugging Face names."""
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_kv_heads"] * (h // shape["num_heads"])
    specs = [("model.embed_tokens.weight", [vocab, h]), ("model.norm.weight", [h])]
    for i in range(shape["num_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "self_attn.q_proj.weight", [h, h]), (p + "self_attn.q_proj.bias", [h]),
            (p + "self_attn.k_proj.weight", [kv, h]), (p + "self_attn.k_proj.bias", [kv]),
            (p + "self_attn.v_proj.weight", [kv, h]), (p + "self_attn.v_proj.bias", [kv]),
            (p + "self_attn.o_proj.weight", [h, h]),
            (p + "mlp.gate_proj.weight", [inter, h]), (p + "mlp.up_proj.weight", [inter, h]),
            (p + "mlp.down_proj.weight", [h, inter]),
            (p + "input_layernorm.weight", [h]), (p + "post_attention_layernorm.weight", [h]),
        ]  # fmt: skip
    return specs


def test_generator_peak_memory_over_an_update_is_one_unit_not_the_model(tmp_path):
    specs = qwen_shape_specs(SHAPES["qwen2.5-0.5b"])
    g = torch.Generator().manual_seed(0)
    named = [(n, torch.randn(shape, generator=g, dtype=torch.float32).bfloat16())
             for n, shape in specs]  # fmt: skip
    (tmp_path / "specs.json").write_text(json.dumps([[n, "bfloat16", s] for n, s in specs]))
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=120.0)  # the default bucket (64 MB)
    out = tmp_path / "result.json"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "procs" / "update_memory.py"), "--port",
         str(pub.port), "--specs", str(tmp_path / "specs.json"), "--out", str(out)],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    try:
        wait_for(lambda: "mem" in pub.members(), timeout_s=120, what="the receiver's join")
        report = pub.publish(named, 1)
        assert report.per_member == {"mem": "ok"}
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.close()
    res = json.loads(out.read_text())
    print(f"\ngenerator side of a 0.5B-shape update: {res}")
    assert res["error"] == "" and res["version"] == 1
    assert res["checksum"] == report.checksum  # every tensor landed, exactly
    # the largest unit is the embedding (151936 x 896 bf16, 272 MB) against 988 MB of model
    assert res["largest_unit_bytes"] < res["model_bytes"] / 3
    assert res["staging_allocations"] == 1  # one buffer, taken by every unit in turn
    assert res["peak_extra_bytes"] <= 1.1 * res["largest_unit_bytes"], res
