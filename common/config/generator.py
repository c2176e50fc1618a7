"""``[generator]``: the vLLM sampling service's own settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.config.shared import Section


class GeneratorConfig(Section):
    replicas: int = Field(1, ge=1, description="generator processes (one vLLM engine each)")
    gpus_per_replica: int = Field(0, ge=0, description="GPUs per generator (0 on CPU)")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallel size")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    top_k: int = Field(-1, ge=-1, description="top-k sampling; -1 = off")
    stop: list[str] = Field(default_factory=list, description="stop strings")
    ignore_eos: bool = Field(False, description="always generate max_response_tokens (benchmarks)")
    eval_temperature: float = Field(
        0.0, ge=0.0, description="sampling temperature for validation (0 = greedy)"
    )
    gpu_memory_utilization: float = Field(
        0.3, gt=0.0, le=1.0, description="vLLM memory fraction (on CPU: of RAM; keep ≤ 0.3)"
    )
    kv_cache_gib: int = Field(
        1, ge=1, description="KV cache size in whole GiB (on CPU: VLLM_CPU_KVCACHE_SPACE)"
    )
    max_num_seqs: int = Field(256, ge=1, description="concurrent sequences in the engine")
    enforce_eager: bool = Field(True, description="disable CUDA graphs / compilation")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="engine dtype; auto = float32 on CPU, bfloat16 on GPU"
    )
    max_prompts_in_flight: int = Field(
        64, ge=1, description="prompts taken from the bus but not yet published"
    )
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus/health port; 0 = pick a free one"
    )
    liveness_s: float = Field(
        60.0,
        gt=0.0,
        description="seconds the main loop or the vLLM engine may not answer before /healthz "
        "answers 503; a weight transfer counts as progress until its deadline (weights.timeout_s)",
    )
