"""``[generator]``: the vLLM sampling service's own settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.config.shared import DERIVED, Section


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
    enforce_eager: bool = Field(
        True,
        description="disable CUDA graphs and torch.compile (on CPU with one worker, also of the "
        "sampler helpers vLLM compiles in its engine core)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="engine dtype; auto = float32 on CPU, bfloat16 on GPU"
    )
    max_lora_rank: int = Field(
        DERIVED,
        ge=0,
        description="vLLM's max_lora_rank for the learner's adapter: one of 1, 8, 16, 32, 64, 128, "
        "256, 320, 512, at least learner.lora_rank; derived as the smallest such; 0 = no LoRA",
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
    # ---- multi-turn episodes and tools (README "Multi-turn episodes and tools")
    max_turns: int = Field(
        1,
        ge=1,
        description="assistant turns per episode; 1 = single-turn responses. An episode ends when "
        "the model answers without a tool call, at max_turns (cut: finish 'max_turns'), or when "
        "its ids after the prompt, sampled and tool, reach run.max_response_tokens",
    )
    tools: list[str] = Field(
        default_factory=list,
        description="tools offered to the model: calculator, python (code in the sandbox), "
        "package.module:function, path/file.py:function, or package.module:Class (each public "
        "method); schemas from signatures and docstrings; needs max_turns ≥ 2",
    )
    tool_format: Literal["auto", "hermes", "llama3_json", "mistral", "qwen3_xml", "phi4_mini"] = (
        Field(
            "auto",
            description="how the model writes tool calls; auto = from the model's model_type "
            "(Qwen2.5/Qwen3 → hermes, Llama 3.x → llama3_json, Mistral → mistral, Phi-4-mini → "
            "phi4_mini; Gemma 2, Phi-3 and SmolLM2 have none: auto refuses them, set one, e.g. "
            "hermes, and tool_prompt writes it into the prompt); qwen3_xml "
            "(Qwen3-Coder) is never chosen by auto",
        )
    )
    tool_prompt: Literal["auto", "template", "system"] = Field(
        "auto",
        description="where the tool list goes: template = the chat template renders it (refused "
        "when it ignores tools); system = Tether writes it into the system message, with an "
        "example call in tool_format's syntax, and writes past calls into the assistant turns' "
        "text (for templates without tool support, e.g. SmolLM2's); auto = template where the "
        "template renders a tool list, else system",
    )
    tool_timeout_s: float = Field(
        10.0, gt=0.0, description="wall-clock and CPU-time limit of one tool call in seconds"
    )
    tool_memory_mb: int = Field(
        512, ge=16, description="memory one tool call may use in MiB (beyond its worker's own)"
    )
    tool_workers: int = Field(
        4, ge=1, le=64, description="sandbox worker processes: tool calls run at once"
    )
    tool_output_max_chars: int = Field(
        2000,
        ge=16,
        description="characters of a tool's output shown to the model; the rest is cut with a "
        "note (verl max_tool_response_length)",
    )
    tool_sandbox: Literal["auto", "namespaces", "rlimits"] = Field(
        "auto",
        description="namespaces = no network, a private read-only file view and a user per "
        "worker (root on Linux); rlimits = per-call limits only; auto = namespaces where "
        "possible, else rlimits with a warning",
    )
    template_check: Literal["warn", "strict", "off"] = Field(
        "warn",
        description="re-render each episode's conversation through the chat template and count "
        "episodes whose re-render differs from the ids, by kind (warn); strict also trains with "
        "no loss the episodes whose re-render would show the model something else than what it "
        "wrote (not a re-serialised call, not a malformed one); off skips it. Tether trains on "
        "the ids as generated either way",
    )
