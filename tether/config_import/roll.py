"""ROLL: a pipeline YAML."""

from __future__ import annotations

from tether.config_import.mapping import Mapper, to_loss_agg, to_lr_schedule, to_one_path
from tether.config_import.sources import device_count

_T = "actor_train."


def _roll_step(m: Mapper) -> tuple[int | None, str, tuple[str, ...]]:
    """ROLL's responses per optimizer step: per_device × grad_accum × world / (tp × pp × cp × ulysses)."""
    sc = _T + "strategy_args.strategy_config."
    pd_k, ga_k, dm_k = (
        _T + "training_args.per_device_train_batch_size",
        _T + "training_args.gradient_accumulation_steps",
        _T + "device_mapping",
    )
    split_keys = (
        sc + "tensor_model_parallel_size",
        sc + "pipeline_model_parallel_size",
        sc + "context_parallel_size",
        _T + "model_args.ulysses_size",
    )
    pd, ga = m.batch_knob(pd_k, 8), m.batch_knob(ga_k, 1)
    world = device_count(m.get(dm_k))
    splits = [m.batch_knob(k, 1) for k in split_keys]
    keys = (pd_k, ga_k, dm_k) + tuple(k for k in split_keys if m.given(k))
    if world is None:
        m.drop(dm_k, "could not count its devices; write it as a list or list(range(a, b))")
    if None in (pd, ga, world, *splits):
        return None, "", keys
    denom = splits[0] * splits[1] * splits[2] * splits[3]
    text = (
        f"per_device_train_batch_size {pd} × gradient_accumulation_steps {ga} × {world} GPUs / "
        f"(tp {splits[0]} × pp {splits[1]} × cp {splits[2]} × ulysses {splits[3]})"
    )
    if pd * ga * world % denom:
        m.problem(
            f"ROLL's global train batch {text} = {pd * ga * world / denom:g} is not a whole number; "
            "make the device count a multiple of the model-parallel sizes."
        )
        return None, text, keys
    return pd * ga * world // denom, text, keys


def _roll_batches(m: Mapper) -> int | None:
    """The cycle vocabulary and the staleness bound; returns train_steps_per_cycle if known."""
    pk, nk, ek = "rollout_batch_size", "num_return_sequences_in_group", "ppo_epochs"
    prompts, n, passes = m.batch_knob(pk, 128), m.batch_knob(nk, 1), m.batch_knob(ek, 1)
    for key, tkey, value, default in (
        (pk, "run.prompts_per_cycle", prompts, 128),
        (nk, "run.responses_per_prompt", n, 1),
        (ek, "run.passes_per_cycle", passes, 1),
    ):
        if value is not None:
            m.put(tkey, value, key, m.default_note(key, default))
    step, text, keys = _roll_step(m)
    steps = None
    if step:
        m.put("run.train_batch_size", step, keys, f"{text} = {step} responses")
    if step and None not in (prompts, n, passes):
        behaviour = (
            "What ROLL does: each rank's share must divide by per_device_train_batch_size × "
            "gradient_accumulation_steps (DataProto.make_iterator asserts it), so this run stops with "
            "an AssertionError at its first training step."
        )
        steps = m.check_division(
            prompts=prompts,
            n=n,
            step=step,
            passes=passes,
            cycle_text=f"rollout_batch_size {prompts} × num_return_sequences_in_group {n}",
            step_text=text,
            behaviour=behaviour,
            knob=lambda d: f"ROLL: gradient_accumulation_steps giving {d} responses per step",
        )
    if steps:
        m.put("run.train_steps_per_cycle", steps, (pk, nk, ek, *keys[:2]))
        ratio = m.get("async_generation_ratio", 0)
        if ratio:
            m.drop(
                "async_generation_ratio",
                f"ROLL generates up to {ratio} cycle(s) ahead of training; set "
                f"run.max_staleness ≥ {int(-(-ratio // 1)) * steps + steps - 1} to match",
            )
        else:
            m.put_staleness(steps, (pk, nk), "ROLL without async_generation_ratio is synchronous")
    return steps


def _roll_direct(m: Mapper) -> None:
    """The keys that map one to one: model, data, lengths, sampling, optimizer."""
    ta, gen, infer = _T + "training_args.", "actor_infer.generating_args.", "actor_infer."
    m.simple(
        [
            ("pretrain", "run.model", str),
            (_T + "model_args.model_name_or_path", "run.model", str),
            ("seed", "run.seed"),
            ("exp_name", "run.name", str),
            ("max_steps", "run.num_cycles", None, "ROLL's pipeline steps are cycles"),
            ("prompt_length", "run.max_prompt_tokens"),
            ("response_length", "run.max_response_tokens"),
            (_T + "data_args.file_name", "data.train_path", to_one_path),
            (_T + "data_args.prompt", "data.prompt_key"),
            ("validation.data_args.file_name", "data.eval_path", to_one_path),
            (gen + "temperature", "generator.temperature"),
            (gen + "top_p", "generator.top_p"),
            (gen + "top_k", "generator.top_k"),
            ("validation.generating_args.temperature", "generator.eval_temperature"),
            (
                infer + "strategy_args.strategy_config.gpu_memory_utilization",
                "generator.gpu_memory_utilization",
            ),
            (ta + "learning_rate", "learner.lr"),
            (ta + "weight_decay", "learner.weight_decay"),
            (ta + "warmup_steps", "learner.warmup_steps"),
            (ta + "warmup_ratio", "learner.warmup_ratio"),
            (ta + "lr_scheduler_type", "learner.lr_schedule", to_lr_schedule),
            (ta + "max_grad_norm", "learner.grad_clip"),
            (
                ta + "per_device_train_batch_size",
                "learner.micro_batch_size",
                None,
                "responses per GPU",
            ),
            ("entropy_loss_coef", "learner.entropy_coef"),
            ("loss_agg_mode", "learner.loss_agg", to_loss_agg),
        ]
    )
    m.drop(
        "actor_infer.generating_args.max_new_tokens",
        "Tether uses run.max_response_tokens (ROLL's response_length)",
    )
    gc = _T + "model_args.disable_gradient_checkpointing"
    if m.given(gc):
        m.put("learner.gradient_checkpointing", not m.get(gc), gc)


def _roll_placement(m: Mapper) -> None:
    """The learner's nodes and GPUs, and the generators, from ROLL's device mappings."""
    infer = "actor_infer."
    world, gpn = device_count(m.get(_T + "device_mapping")), m.get("num_gpus_per_node", 8)
    if world:
        nnodes = -(-world // gpn)
        m.put(
            "learner.nnodes",
            nnodes,
            (_T + "device_mapping", "num_gpus_per_node"),
            f"{world} GPUs, {gpn} per node",
        )
        m.put(
            "learner.nproc_per_node", min(world, gpn), (_T + "device_mapping", "num_gpus_per_node")
        )
    infer_n, gpw = (
        device_count(m.get(infer + "device_mapping")),
        m.get(infer + "num_gpus_per_worker", 1),
    )
    if infer_n:
        m.put(
            "generator.gpus_per_replica",
            gpw,
            infer + "num_gpus_per_worker",
            m.default_note(infer + "num_gpus_per_worker", 1),
        )
        m.put("generator.tensor_parallel_size", gpw, infer + "num_gpus_per_worker")
        m.put(
            "generator.replicas",
            infer_n // gpw,
            (infer + "device_mapping", infer + "num_gpus_per_worker"),
        )


def _roll_policy_loss(m: Mapper) -> None:
    """Clip ranges, KL (as a loss or in the reward) and the advantage estimator."""
    low, high = (
        ("pg_clip_low", "pg_clip_high")
        if m.get("use_pg_clip_range", False)
        else ("pg_clip", "pg_clip")
    )
    if m.given(low) or m.given(high):
        m.put("learner.clip_low", m.get(low, 0.2), low)
        m.put("learner.clip_high", m.get(high, 0.2), high)
    if m.get("use_kl_loss", False):
        m.put_kl_loss(kind="kl_penalty", kind_default="kl")
    elif m.get("add_token_level_kl", False):
        m.put_kl(
            coef="init_kl_coef",
            kind="kl_penalty",
            in_reward=True,
            coef_default=0.2,
            kind_default="kl",
            keys=("add_token_level_kl",),
        )
    est = m.peer_estimator("adv_estimator", {"grpo": "grpo"}, "gae")
    if est:
        m.put("learner.advantage_estimator", est, "adv_estimator")


def _roll_schedule(m: Mapper, steps: int | None) -> None:
    """How often to checkpoint and evaluate."""
    m.put_per_cycle(
        "save_steps", "learner.checkpoint_every_steps", steps, "pipeline steps (cycles)"
    )
    m.put_per_cycle("eval_steps", "learner.eval_every_steps", steps, "pipeline steps (cycles)")


def map_roll(m: Mapper) -> None:
    steps = _roll_batches(m)
    _roll_direct(m)
    _roll_placement(m)
    _roll_policy_loss(m)
    _roll_schedule(m, steps)
