"""``[scorer]``: the reward service's own settings, its solver engine's included (the solver
never borrows the generator's)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.config.shared import DERIVED, Section


class ScorerConfig(Section):
    replicas: int = Field(1, ge=1, description="scorer processes")
    mode: Literal["rule", "solver"] = Field(
        "rule", description="rule = grade the response; solver = a frozen LLM answers using it"
    )
    grader_workers: int = Field(2, ge=1, description="math-verify worker processes per scorer")
    grader_timeout_s: float = Field(
        5.0, gt=0.0, description="hard per-item math-verify timeout in seconds"
    )
    answer_fallbacks: list[str] = Field(
        default_factory=lambda: ["boxed", "answer_is", "last_number"],
        description="answer extraction order",
    )
    answer_form: Literal["any", "number"] = Field(
        "any",
        description="`number`: when the ground truth is a plain number, an answer that is not "
        "one (an expression such as `3*4`, which math-verify would evaluate) scores 0 with "
        "reason `not_a_number`; `any` = math-verify alone decides",
    )
    correct_weight: float = Field(1.0, description="weight of correctness in the reward")
    format_weight: float = Field(0.0, description="reward for a well-formed \\boxed{} answer")
    overlong_buffer_tokens: int = Field(
        0, ge=0, description="soft length penalty starts this many tokens before the limit; 0 = off"
    )
    overlong_penalty: float = Field(1.0, ge=0.0, description="penalty at the length limit")
    tool_error_penalty: float = Field(
        0.0,
        ge=0.0,
        description="episodes: reward term `tool_errors` = −penalty × the episode's failed tool "
        "calls (malformed, unknown tool, bad arguments, errors, timeouts); 0 = off",
    )
    custom_reward: str = Field(
        "", description="dotted path `package.module:function` of an extra reward"
    )
    solver_model: str = Field(
        "",
        description="frozen solver model directory (solver mode); empty = the policy's initial weights",
    )
    solver_samples: int = Field(1, ge=1, description="solver answers per response")
    solver_aggregation: Literal["mean", "majority"] = Field(
        "mean", description="how several solver answers become one reward"
    )
    solver_temperature: float = Field(0.0, ge=0.0, description="solver sampling temperature")
    solver_max_tokens: int = Field(128, ge=1, description="solver answer length in tokens")
    solver_template: str = Field(
        "Question: {question}\nGuideline: {response}\nAnswer with \\boxed{{}}.",
        description="solver prompt; {question} and {response} are filled in",
    )
    solver_kv_cache_gib: int = Field(
        1,
        ge=1,
        description="solver engine's KV cache in whole GiB (on CPU: VLLM_CPU_KVCACHE_SPACE)",
    )
    solver_gpu_memory_utilization: float = Field(
        0.3,
        gt=0.0,
        le=1.0,
        description="solver engine's memory fraction (on CPU: of RAM; keep ≤ 0.3)",
    )
    solver_max_model_len: int = Field(
        DERIVED,
        ge=1,
        description="solver engine's context in tokens (its prompt and answer); default "
        "run.max_prompt_tokens + run.max_response_tokens + solver_max_tokens",
    )
    solver_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="solver engine dtype; auto = the solver model's own (vLLM's choice)"
    )
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus/health port; 0 = pick a free one"
    )
    liveness_s: float = Field(
        600.0,
        gt=0.0,
        description="seconds the main loop may make no progress (one scoring batch included) "
        "before /healthz answers 503",
    )
