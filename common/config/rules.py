"""Cross-field rules of the Tether config: the cycle invariant, derived values, staleness.

Each rule either derives a value the user left out (recorded in the returned set, so
``tether config explain`` can say "derived") or refuses the config with a ``ConfigError`` whose
message shows the user's numbers and how to fix them. A user's explicit setting is never changed.
"""

from __future__ import annotations

import re
from typing import Protocol

from common.config.agent import AgentConfig, agent_rules
from common.config.errors import ConfigError
from common.config.generator import GeneratorConfig
from common.config.learner import OFF_POLICY_DEFAULTS, LearnerConfig
from common.config.scorer import ScorerConfig
from common.config.shared import (
    BUCKET_MB,
    BUCKET_MB_NCCL,
    CHUNK_MB,
    CHUNK_MB_NCCL,
    BusConfig,
    DataConfig,
    RunConfig,
    WeightsConfig,
)


class TetherConfig(Protocol):
    """The sections the rules read (``schema.TetherConfig``, which runs them at validation)."""

    run: RunConfig
    data: DataConfig
    generator: GeneratorConfig
    scorer: ScorerConfig
    learner: LearnerConfig
    bus: BusConfig
    weights: WeightsConfig
    agent: AgentConfig

    @property
    def dp_world_size(self) -> int: ...


EQUATION = "prompts_per_cycle × responses_per_prompt × passes_per_cycle = train_batch_size × train_steps_per_cycle"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _invariant_fixes(p: int, r: int, e: int, b: int, s: int) -> list[str]:
    """Two concrete ways to balance the equation, each changing one side only."""
    fixes: list[str] = []
    produced = p * r * e
    if produced % s == 0:
        fixes.append(
            f"set train_batch_size = {produced // s} (keeps train_steps_per_cycle = {s}: {p} × {r} × {e} = {produced // s} × {s})"
        )
    elif produced % b == 0:
        fixes.append(
            f"set train_steps_per_cycle = {produced // b} (keeps train_batch_size = {b}: {p} × {r} × {e} = {b} × {produced // b})"
        )
    consumed = b * s
    if consumed % (r * e) == 0:
        fixes.append(
            f"set prompts_per_cycle = {consumed // (r * e)} (keeps train_batch_size × train_steps_per_cycle = {b} × {s} = {consumed})"
        )
    if len(fixes) < 2:
        near = min(_divisors(produced), key=lambda d: (abs(d - b), d))
        fixes.append(
            f"set train_batch_size = {near} and train_steps_per_cycle = {produced // near} ({p} × {r} × {e} = {near} × {produced // near})"
        )
    return fixes[:2]


def _resolve_batch(cfg: TetherConfig, derived: set[str]) -> tuple[int, int]:
    run = cfg.run
    p, r, e = run.prompts_per_cycle, run.responses_per_prompt, run.passes_per_cycle
    produced = p * r * e
    b, s = run.train_batch_size, run.train_steps_per_cycle
    if b is None and s is None:
        s = 1
        derived.add("run.train_steps_per_cycle")
    if b is None:
        assert s is not None
        if produced % s:
            raise ConfigError(
                f"run.train_batch_size cannot be derived: {p} × {r} × {e} = {produced} responses per cycle "
                f"do not split into train_steps_per_cycle = {s} equal optimizer steps. "
                f"Choose train_steps_per_cycle from the divisors of {produced} "
                f"({', '.join(map(str, _divisors(produced)[:12]))}…) or set train_batch_size yourself."
            )
        b = produced // s
        derived.add("run.train_batch_size")
    elif s is None:
        if produced % b:
            near = min(_divisors(produced), key=lambda d: (abs(d - b), d))
            raise ConfigError(
                f"run.train_steps_per_cycle cannot be derived: {p} × {r} × {e} = {produced} responses per cycle "
                f"are not a whole number of optimizer steps of train_batch_size = {b}. "
                f"Fix: set train_batch_size = {near} ({produced // near} steps per cycle), or set prompts_per_cycle "
                f"so that prompts_per_cycle × {r} × {e} is a multiple of {b}."
            )
        s = produced // b
        derived.add("run.train_steps_per_cycle")
    if produced != b * s:
        fixes = _invariant_fixes(p, r, e, b, s)
        raise ConfigError(
            "The cycle settings do not balance: responses generated per cycle must equal responses "
            f"consumed per cycle ({EQUATION}). With your numbers: {p} × {r} × {e} = {produced}, but "
            f"{b} × {s} = {b * s}. Fix it one of two ways: {fixes[0]}; or {fixes[1]}."
        )
    run.train_batch_size, run.train_steps_per_cycle = b, s
    return b, s


def _check_passes(cfg: TetherConfig, b: int) -> None:
    per_pass = cfg.run.prompts_per_cycle * cfg.run.responses_per_prompt
    if cfg.run.passes_per_cycle > 1 and per_pass % b:
        raise ConfigError(
            f"run.passes_per_cycle = {cfg.run.passes_per_cycle} needs every pass over a cycle's "
            f"{per_pass} responses to be whole optimizer steps, but train_batch_size = {b} does not "
            f"divide {per_pass}. Fix: choose train_batch_size from {_divisors(per_pass)}."
        )


def _resolve_micro_batches(cfg: TetherConfig, b: int, derived: set[str]) -> None:
    world = cfg.dp_world_size
    ln = cfg.learner
    if b % world:
        raise ConfigError(
            f"run.train_batch_size = {b} responses cannot be shared evenly by {world} learner ranks "
            f"(learner.nnodes × learner.nproc_per_node = {ln.nnodes} × {ln.nproc_per_node}). "
            f"Fix: make train_batch_size a multiple of {world}, or change the number of learner ranks."
        )
    per_rank = b // world
    if ln.micro_batch_size is not None and ln.max_tokens_per_micro_batch is not None:
        raise ConfigError(
            "learner.micro_batch_size and learner.max_tokens_per_micro_batch are both set: micro-batches "
            "are cut either by count or by a token budget. Fix: remove one of them."
        )
    if ln.max_tokens_per_micro_batch is not None:
        longest = cfg.run.max_prompt_tokens + cfg.run.max_response_tokens
        if ln.max_tokens_per_micro_batch < longest:
            raise ConfigError(
                f"learner.max_tokens_per_micro_batch = {ln.max_tokens_per_micro_batch} is smaller than the "
                f"longest possible sequence (run.max_prompt_tokens + run.max_response_tokens = {longest}); "
                f"such a sequence could never be trained. Fix: set it to at least {longest}."
            )
        return
    if ln.micro_batch_size is None:
        ln.micro_batch_size = max(d for d in _divisors(per_rank) if d <= 8)
        derived.add("learner.micro_batch_size")
    if per_rank % ln.micro_batch_size:
        raise ConfigError(
            f"learner.micro_batch_size = {ln.micro_batch_size} does not divide the per-rank share of an "
            f"optimizer step: train_batch_size {b} / {world} ranks = {per_rank} responses per rank. "
            f"Fix: choose micro_batch_size from {_divisors(per_rank)} (gradient accumulation is derived "
            f"as {per_rank} / micro_batch_size), or use learner.max_tokens_per_micro_batch."
        )


def default_max_staleness(train_steps_per_cycle: int) -> int:
    """``run.max_staleness`` when the user sets none: 2S − 1 for S optimizer steps per cycle, so
    that generating the next cycle overlaps one cycle of training (S − 1 is fully synchronous)."""
    return 2 * train_steps_per_cycle - 1


def _resolve_staleness(cfg: TetherConfig, s: int, derived: set[str]) -> None:
    run = cfg.run
    pub = cfg.learner.publish_every_steps
    if pub is None:
        cfg.learner.publish_every_steps = s  # once per cycle
        derived.add("learner.publish_every_steps")
    elif s % pub:
        raise ConfigError(
            f"learner.publish_every_steps = {pub} does not divide run.train_steps_per_cycle = {s}: the "
            f"weights a cycle starts from would never be published. Fix: choose publish_every_steps "
            f"from {_divisors(s)}."
        )
    if run.max_staleness is None:
        run.max_staleness = default_max_staleness(s)
        derived.add("run.max_staleness")
    elif run.max_staleness < s - 1:
        raise ConfigError(
            f"run.max_staleness = {run.max_staleness} is below train_steps_per_cycle − 1 = {s - 1}. A cycle's "
            f"data is generated by one policy version v and trained in {s} optimizer steps, the last of "
            f"which turns version v + {s - 1} into v + {s}; that step would find every trajectory "
            f"{s - 1} steps stale and drop it. Fix: set max_staleness ≥ {s - 1} ({s - 1} = fully "
            f"synchronous; {default_max_staleness(s)} lets generation overlap one cycle of training)."
        )


def _resolve_solver(cfg: TetherConfig, derived: set[str]) -> None:
    """The solver engine's context: its prompt (template + question + the policy's response)
    and its answer. Derived from the lengths when unset."""
    s, run = cfg.scorer, cfg.run
    if s.solver_max_model_len is None:
        s.solver_max_model_len = (
            run.max_prompt_tokens + run.max_response_tokens + s.solver_max_tokens
        )
        derived.add("scorer.solver_max_model_len")
    elif s.solver_max_model_len <= s.solver_max_tokens:
        raise ConfigError(
            f"scorer.solver_max_model_len = {s.solver_max_model_len} leaves no room for the "
            f"solver's prompt next to its answer (scorer.solver_max_tokens = "
            f"{s.solver_max_tokens}). Fix: raise it (the default is run.max_prompt_tokens + "
            f"run.max_response_tokens + solver_max_tokens = "
            f"{run.max_prompt_tokens + run.max_response_tokens + s.solver_max_tokens}) or remove it."
        )


def _resolve_auto(cfg: TetherConfig, derived: set[str]) -> None:
    """The ``"auto"`` settings that the config alone decides, settled here so that no service
    decides them again: the generator's dtype (float32 on CPU, where log-probs are compared
    exactly; bfloat16 on GPU) and the weight broadcast's backend (gloo: host memory over TCP
    works for every placement; nccl is opt-in). Three stay "auto" on purpose: ``learner.dtype``
    and ``weights.dtype`` follow the device each learner rank finds at start-up, and
    ``scorer.solver_dtype`` is vLLM's own "auto" (the solver model's dtype)."""
    g = cfg.generator
    if g.dtype == "auto":
        g.dtype = "float32" if g.gpus_per_replica == 0 else "bfloat16"
        derived.add("generator.dtype")
    w = cfg.weights
    if w.backend == "auto":
        w.backend = "gloo"
        derived.add("weights.backend")
    nccl = w.backend == "nccl"
    if w.chunk_mb is None:
        w.chunk_mb = CHUNK_MB_NCCL if nccl else CHUNK_MB
        derived.add("weights.chunk_mb")
    if w.bucket_mb is None:
        w.bucket_mb = BUCKET_MB_NCCL if nccl else BUCKET_MB
        derived.add("weights.bucket_mb")


def _check_names_and_timeouts(cfg: TetherConfig) -> None:
    """The run's name (it prefixes every Redis key), the bus's socket timeout, Adam's betas."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", cfg.run.name):
        raise ConfigError(
            f"run.name = {cfg.run.name!r} must be 1-64 letters, digits, '.', '_' or '-' (it names the "
            "run directory and prefixes every Redis key as '<name>:…'). Fix: pick a name like 'gsm8k-grpo'."
        )
    if cfg.bus.socket_timeout_s * 1000 <= cfg.bus.block_ms:
        raise ConfigError(
            f"bus.socket_timeout_s = {cfg.bus.socket_timeout_s} s must exceed bus.block_ms = "
            f"{cfg.bus.block_ms} ms, or every blocking stream read would time out (redis-py's default "
            f"socket timeout is 5 s). Fix: raise socket_timeout_s or lower block_ms."
        )
    if len(cfg.learner.adam_betas) != 2 or not all(0 <= x < 1 for x in cfg.learner.adam_betas):
        raise ConfigError(
            f"learner.adam_betas = {cfg.learner.adam_betas} must be two numbers in [0, 1), e.g. [0.9, 0.999]."
        )


def _check_samples_per_request(cfg: TetherConfig) -> None:
    """Several samples of one request need a temperature (and, for the solver, solver mode)."""
    if cfg.scorer.solver_samples > 1 and cfg.scorer.solver_temperature == 0:
        raise ConfigError(
            f"scorer.solver_samples = {cfg.scorer.solver_samples} with scorer.solver_temperature = 0: greedy "
            "answers are all identical (and vLLM refuses n > 1 greedy requests). Fix: set "
            "solver_temperature > 0 (e.g. 0.7) or solver_samples = 1."
        )
    if cfg.run.responses_per_prompt > 1 and cfg.generator.temperature == 0:
        raise ConfigError(
            f"run.responses_per_prompt = {cfg.run.responses_per_prompt} with generator.temperature = 0: greedy "
            "responses of one prompt are identical, so every group advantage is 0 (and vLLM refuses n > 1 "
            "greedy requests). Fix: set generator.temperature > 0 (e.g. 1.0)."
        )
    if cfg.scorer.solver_samples > 1 and cfg.scorer.mode != "solver":
        raise ConfigError(
            'scorer.solver_samples > 1 only applies to scorer.mode = "solver". Fix: set mode = "solver" or solver_samples = 1.'
        )


def _check_health(cfg: TetherConfig) -> None:
    """Heartbeat limits that would call a healthy service dead, or a collective that would time
    out while rank 0 is merely idle."""
    ln = cfg.learner
    if ln.keepalive_s * 2 > ln.collective_timeout_s:
        raise ConfigError(
            f"learner.keepalive_s = {ln.keepalive_s} s must be at most half of "
            f"learner.collective_timeout_s = {ln.collective_timeout_s} s: the other ranks wait for "
            "rank 0's keepalive in a collective. Fix: lower keepalive_s (e.g. 30)."
        )
    block_s = cfg.bus.block_ms / 1000
    for name, limit in (
        ("learner", ln.liveness_s),
        ("scorer", cfg.scorer.liveness_s),
        ("generator", cfg.generator.liveness_s),
    ):
        if limit <= 2 * block_s:
            raise ConfigError(
                f"{name}.liveness_s = {limit} s must exceed twice bus.block_ms ({block_s:g} s): "
                "an idle loop beats once per blocking read. Fix: raise liveness_s."
            )


def _check_algorithm(cfg: TetherConfig) -> None:
    """Learner settings that would silently do nothing with the others as they are."""
    ln = cfg.learner
    if ln.kl_in_reward and ln.kl_coef == 0:
        raise ConfigError(
            "learner.kl_in_reward = true has no effect while learner.kl_coef = 0. Fix: set kl_coef > 0 "
            "(e.g. 0.001) or remove kl_in_reward."
        )
    if ln.kl_clamp is not None and ln.kl_coef == 0:
        raise ConfigError(
            f"learner.kl_clamp = {ln.kl_clamp} has no effect while learner.kl_coef = 0 (there is no KL "
            "term to clamp). Fix: set kl_coef > 0 or remove kl_clamp."
        )
    est = ln.advantage_estimator
    uses_std = est in ("reinforce_pp", "reinforce_pp_baseline") or (
        est == "grpo" and ln.norm_adv_by_std
    )
    if ln.std_estimator == "unbiased" and not uses_std:
        what = "grpo with norm_adv_by_std = false" if est == "grpo" else f'"{est}"'
        raise ConfigError(
            f'learner.std_estimator = "unbiased" has no effect: advantage_estimator = {what} divides by '
            "no standard deviation (only grpo with norm_adv_by_std = true, reinforce_pp and "
            "reinforce_pp_baseline do). Fix: remove std_estimator, or choose one of those estimators."
        )


def _check_policy_loss(cfg: TetherConfig) -> None:
    ln = cfg.learner
    if ln.clip_low >= 1.0 and ln.policy_loss != "cispo":
        raise ConfigError(
            f"learner.clip_low = {ln.clip_low} clips the ratio at 1 − clip_low ≤ 0, which only "
            f'policy_loss = "cispo" accepts (no lower bound). Fix: set clip_low < 1 (e.g. 0.2) '
            f'or policy_loss = "cispo".'
        )
    if ln.dual_clip is not None and ln.policy_loss != "ppo":
        raise ConfigError(
            f'learner.dual_clip applies to policy_loss = "ppo" only, not "{ln.policy_loss}". '
            "Fix: remove dual_clip."
        )
    for name in ("mismatch_mask_token", "mismatch_mask_sequence", "mismatch_mask_geometric"):
        bounds = getattr(ln, name)
        if bounds is not None and not (
            len(bounds) == 2 and 0 < bounds[0] <= 1 <= bounds[1] and bounds[0] < bounds[1]
        ):
            raise ConfigError(
                f"learner.{name} = {bounds} must be [low, high] with 0 < low ≤ 1 ≤ high and "
                "low < high (ratios of learner to behaviour probabilities, e.g. [0.5, 2.0]). "
                "Fix: give two such numbers, or remove it."
            )


def _resolve_off_policy(cfg: TetherConfig, derived: set[str]) -> None:
    """``is_cap`` and ``is_over_cap`` from the correction's own definition when unset
    (``OFF_POLICY_DEFAULTS``); refused where they would do nothing or drop nearly every token."""
    ln = cfg.learner
    if ln.off_policy == "none":
        given = [k for k in ("is_cap", "is_over_cap") if getattr(ln, k) is not None]
        if given:
            raise ConfigError(
                f"learner.{' and learner.'.join(given)} has no effect while learner.off_policy = "
                '"none" (no behaviour importance weight is computed). Fix: remove it, or choose '
                'off_policy = "decoupled" or "tis".'
            )
        return
    cap, over = OFF_POLICY_DEFAULTS[ln.off_policy]
    if ln.is_cap is None:
        ln.is_cap = cap
        derived.add("learner.is_cap")
    if ln.is_over_cap is None:
        ln.is_over_cap = over
        derived.add("learner.is_over_cap")
    if ln.is_over_cap == "mask" and ln.is_cap <= 1.0:
        raise ConfigError(
            f'learner.is_cap = {ln.is_cap} with is_over_cap = "mask" drops every token whose '
            "behaviour weight π_prox / π_behav is above it, and on fresh data half the tokens sit "
            "above 1. AReaL requires behav_imp_weight_cap > 1. Fix: set is_cap > 1 (AReaL's "
            'examples use 5), or is_over_cap = "truncate".'
        )


def _resolve_dynamic_sampling(cfg: TetherConfig, derived: set[str]) -> None:
    ln = cfg.learner
    if not ln.dynamic_sampling:
        if ln.max_extra_prompts_per_cycle is not None:
            raise ConfigError(
                f"learner.max_extra_prompts_per_cycle = {ln.max_extra_prompts_per_cycle} has no "
                "effect while learner.dynamic_sampling = false. Fix: set dynamic_sampling = true "
                "or remove it."
            )
        return
    if not ln.filter_equal_reward_groups:
        raise ConfigError(
            "learner.dynamic_sampling = true replaces the groups that filter_equal_reward_groups "
            "drops, but that filter is off, so nothing would be replaced. Fix: set "
            "learner.filter_equal_reward_groups = true (or dynamic_sampling = false)."
        )
    if cfg.run.responses_per_prompt < 2:
        raise ConfigError(
            "learner.dynamic_sampling = true with run.responses_per_prompt = 1: a group of one "
            "response always has equal rewards, so every group would be filtered. Fix: set "
            "responses_per_prompt ≥ 2."
        )
    if ln.max_extra_prompts_per_cycle is None:
        ln.max_extra_prompts_per_cycle = 2 * cfg.run.prompts_per_cycle
        derived.add("learner.max_extra_prompts_per_cycle")


def _check_episodes(cfg: TetherConfig) -> None:
    g = cfg.generator
    if g.tools and g.max_turns < 2:
        raise ConfigError(
            f"generator.tools = {g.tools} with generator.max_turns = {g.max_turns}: the model "
            "could call a tool but never read its answer. Fix: set generator.max_turns ≥ 2 "
            "(e.g. 4), or remove the tools."
        )
    if g.max_turns > 1 and not g.tools:
        raise ConfigError(
            f"generator.max_turns = {g.max_turns} without generator.tools: nothing answers the "
            "model between its turns, so every episode would end after one. Fix: name the tools "
            '(generator.tools = ["calculator"]) or set max_turns = 1.'
        )
    if g.max_turns > 1 and not cfg.data.apply_chat_template:
        raise ConfigError(
            "generator.max_turns > 1 needs the chat template: tool turns are rendered through it. "
            "Fix: set data.apply_chat_template = true (and use a tokenizer with a tool-aware "
            "template)."
        )


# vLLM's allowed ``max_lora_rank`` values (``vllm.config.lora.MaxLoRARanks``; a test pins them).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _resolve_lora(cfg: TetherConfig, derived: set[str]) -> None:
    """``generator.max_lora_rank``: the smallest rank vLLM allows that holds the learner's
    adapter (0 without LoRA); a given one must be allowed and large enough."""
    ln, g = cfg.learner, cfg.generator
    rank = ln.lora_rank
    if rank == 0:
        if g.max_lora_rank:
            raise ConfigError(
                f"generator.max_lora_rank = {g.max_lora_rank} without learner.lora_rank: the "
                "learner trains every weight and publishes them all, so there is no adapter to "
                "serve. Fix: set learner.lora_rank (e.g. 16), or remove generator.max_lora_rank."
            )
        if g.max_lora_rank is None:
            g.max_lora_rank = 0
            derived.add("generator.max_lora_rank")
        return
    if not ln.lora_target_modules or any(not m.strip() for m in ln.lora_target_modules):
        raise ConfigError(
            f"learner.lora_target_modules = {ln.lora_target_modules} names no module. Fix: "
            'leave it out (["all-linear"]) or name modules, e.g. ["q_proj", "v_proj"].'
        )
    if "all-linear" in ln.lora_target_modules and len(ln.lora_target_modules) > 1:
        raise ConfigError(
            f'learner.lora_target_modules = {ln.lora_target_modules}: "all-linear" already '
            'means every linear layer. Fix: give ["all-linear"] alone, or only module names.'
        )
    fits = min(r for r in VLLM_LORA_RANKS if r >= rank)
    if g.max_lora_rank is None:
        g.max_lora_rank = fits
        derived.add("generator.max_lora_rank")
    elif g.max_lora_rank not in VLLM_LORA_RANKS or g.max_lora_rank < rank:
        raise ConfigError(
            f"generator.max_lora_rank = {g.max_lora_rank} cannot serve learner.lora_rank = "
            f"{rank}: vLLM allows only {', '.join(map(str, VLLM_LORA_RANKS))}, and it must be "
            f"at least the adapter's rank. Fix: set it to {fits}, or remove it (derived)."
        )


def apply_cycle_rules(cfg: TetherConfig) -> set[str]:
    """Validate and fill in derived values; returns the dotted names that were derived."""
    derived: set[str] = set()
    b, s = _resolve_batch(cfg, derived)
    _check_passes(cfg, b)
    _resolve_micro_batches(cfg, b, derived)
    _resolve_staleness(cfg, s, derived)
    _resolve_solver(cfg, derived)
    _resolve_auto(cfg, derived)
    _check_names_and_timeouts(cfg)
    _check_samples_per_request(cfg)
    _check_health(cfg)
    _check_algorithm(cfg)
    _check_policy_loss(cfg)
    _resolve_off_policy(cfg, derived)
    _resolve_dynamic_sampling(cfg, derived)
    _check_episodes(cfg)
    _resolve_lora(cfg, derived)
    agent_rules(cfg, derived)
    return derived
