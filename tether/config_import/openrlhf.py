"""OpenRLHF: ``--flag value`` arguments of ``openrlhf.cli.train_*``."""

from __future__ import annotations

from tether.config_import.lora import map_openrlhf_lora
from tether.config_import.mapping import Mapper, Skip, to_lr_schedule, to_one_path
from tether.config_import.sources import coerce


def _openrlhf_batches(m: Mapper) -> int | None:
    """The cycle vocabulary and the staleness bound; returns train_steps_per_cycle if known."""
    pk, nk, tk, ek = "rollout_batch_size", "n_samples_per_prompt", "train_batch_size", "max_epochs"
    prompts, n, step, passes = (
        m.batch_knob(pk, 1024),
        m.batch_knob(nk, 1),
        m.batch_knob(tk, 128),
        m.batch_knob(ek, 1),
    )
    for key, tkey, value, default, note in (
        (pk, "run.prompts_per_cycle", prompts, 1024, "prompts per rollout batch"),
        (nk, "run.responses_per_prompt", n, 1, ""),
        (
            tk,
            "run.train_batch_size",
            step,
            128,
            "OpenRLHF's --train_batch_size counts responses (all GPUs)",
        ),
        (ek, "run.passes_per_cycle", passes, 1, ""),
    ):
        if value is not None:
            m.put(tkey, value, key, m.default_note(key, default, note))
    steps = None
    if None not in (prompts, n, step, passes):
        micro = m.get("micro_train_batch_size", 8)
        behaviour = (
            f"What OpenRLHF does: each GPU walks its share in micro-batches of {micro} and DeepSpeed steps "
            f"the optimizer every {step} responses, counting micro-batches across epochs and cycles, so the "
            f"{prompts * n % step} responses left over are accumulated into the first step of the next epoch "
            "or cycle (mixing two batches) and step boundaries drift (with --use_dynamic_batch they are "
            "dropped instead)."
        )
        steps = m.check_division(
            prompts=prompts,
            n=n,
            step=step,
            passes=passes,
            cycle_text=f"--rollout_batch_size {prompts} × --n_samples_per_prompt {n}",
            step_text="--train_batch_size",
            behaviour=behaviour,
            knob=lambda d: f"OpenRLHF: --train_batch_size {d}",
        )
    if steps:
        m.put(
            "run.train_steps_per_cycle",
            steps,
            (pk, nk, tk, ek),
            f"{prompts} × {n} / {step} × {passes} epochs",
        )
    if m.get("async_train", False):
        queue = m.get("async_queue_size", 1)
        bound = (
            f"{queue * steps + steps - 1}"
            if steps
            else f"{queue} × train_steps_per_cycle + train_steps_per_cycle − 1"
        )
        m.drop(
            "async_train",
            f"OpenRLHF keeps up to {queue} rollout batch(es) queued ahead of training; "
            f"the matching Tether setting is run.max_staleness ≥ {bound}",
        )
        m.drop("async_queue_size", "see --async_train")
    elif steps:
        m.put_staleness(steps, (pk, tk), "OpenRLHF (without --async_train) is synchronous")
    return steps


def _openrlhf_direct(m: Mapper) -> None:
    """The flags that map one to one: model, data, lengths, sampling, placement, optimizer."""
    m.simple(
        [
            ("pretrain", "run.model", str),
            ("prompt_data", "data.train_path", to_one_path),
            ("eval_dataset", "data.eval_path", to_one_path),
            ("input_key", "data.prompt_key"),
            ("label_key", "data.answer_key"),
            ("seed", "run.seed"),
            ("prompt_max_len", "run.max_prompt_tokens"),
            ("generate_max_len", "run.max_response_tokens"),
            ("max_new_tokens", "run.max_response_tokens"),
            ("temperature", "generator.temperature"),
            ("top_p", "generator.top_p"),
            ("top_k", "generator.top_k"),
            ("eval_temperature", "generator.eval_temperature"),
            ("vllm_num_engines", "generator.replicas"),
            ("vllm_tensor_parallel_size", "generator.tensor_parallel_size"),
            ("vllm_gpu_memory_utilization", "generator.gpu_memory_utilization"),
            ("actor_num_nodes", "learner.nnodes"),
            ("actor_num_gpus_per_node", "learner.nproc_per_node"),
            ("actor_learning_rate", "learner.lr"),
            ("l2", "learner.weight_decay"),
            ("lr_warmup_ratio", "learner.warmup_ratio"),
            ("max_norm", "learner.grad_clip"),
            ("micro_train_batch_size", "learner.micro_batch_size", None, "responses per GPU"),
            ("gradient_checkpointing", "learner.gradient_checkpointing", bool),
            (
                "adam_offload",
                "learner.cpu_offload",
                bool,
                "DeepSpeed offloads the Adam state and step; FSDP2 offloads the parameters and "
                "gradients with them (CPUOffloadPolicy)",
            ),
            ("ref_reward_offload", "learner.reference_cpu_offload", bool),
            ("entropy_loss_coef", "learner.entropy_coef"),
            ("dual_clip", "learner.dual_clip"),
        ]
    )
    if m.given("vllm_tensor_parallel_size"):
        m.put(
            "generator.gpus_per_replica",
            m.get("vllm_tensor_parallel_size"),
            "vllm_tensor_parallel_size",
        )


def _openrlhf_lr_schedule(m: Mapper) -> None:
    if m.given("actor_learning_rate"):
        sched = m.get("lr_scheduler", "cosine_with_min_lr")
        try:
            m.put(
                "learner.lr_schedule",
                to_lr_schedule(sched),
                "lr_scheduler",
                m.default_note("lr_scheduler", "cosine_with_min_lr"),
            )
            if sched == "cosine_with_min_lr":
                m.put(
                    "learner.min_lr_ratio",
                    0.1,
                    "lr_scheduler",
                    "OpenRLHF decays to 0.1 × the learning rate",
                )
        except Skip as why:
            m.drop("lr_scheduler", str(why))


def _openrlhf_policy_loss(m: Mapper) -> None:
    """Clip ranges, KL (as a loss or in the reward) and the advantage estimator."""
    pair = m.get("eps_clip_low_high")
    if isinstance(pair, list) and len(pair) == 2:
        m.put("learner.clip_low", coerce(pair[0]), "eps_clip_low_high")
        m.put("learner.clip_high", coerce(pair[1]), "eps_clip_low_high")
        m.drop("eps_clip", "overridden by --eps_clip_low_high")
    elif m.given("eps_clip"):
        m.put("learner.clip_low", m.get("eps_clip"), "eps_clip")
        m.put("learner.clip_high", m.get("eps_clip"), "eps_clip")
    if m.given("init_kl_coef") or m.given("use_kl_loss") or m.given("kl_estimator"):
        loss = bool(m.get("use_kl_loss", False))
        m.put_kl(
            coef="init_kl_coef",
            kind="kl_estimator",
            in_reward=not loss,
            coef_default=0.01,
            kind_default="k1",
            keys=("use_kl_loss",),
        )
    table = {
        "reinforce": "reinforce_pp",
        "rloo": "rloo",
        "reinforce_baseline": "reinforce_pp_baseline",
        "group_norm": "grpo",
        "dr_grpo": "drgrpo",
    }
    est = m.peer_estimator("advantage_estimator", table, "gae")
    if est:
        m.put("learner.advantage_estimator", est, "advantage_estimator")
    if est == "grpo":
        m.put(
            "learner.std_estimator",
            "unbiased",
            "advantage_estimator",
            "OpenRLHF's group_norm divides by the unbiased (n − 1) std of each group",
        )


def _openrlhf_micro_batches(m: Mapper) -> None:
    """Token-budget micro-batches and sequence packing."""
    if m.get("use_dynamic_batch", False) and m.given("train_max_tokens_per_gpu"):
        m.put(
            "learner.max_tokens_per_micro_batch",
            m.get("train_max_tokens_per_gpu"),
            ("use_dynamic_batch", "train_max_tokens_per_gpu"),
        )
    if m.given("packing_samples"):
        m.put(
            "learner.pack_sequences",
            bool(m.get("packing_samples")),
            "packing_samples",
            "samples packed end to end with position_ids restarting per sample (the same loss "
            "as padding); pair it with learner.max_tokens_per_micro_batch",
        )


def _openrlhf_schedule(m: Mapper, steps: int | None) -> None:
    """The run's length, and how often to checkpoint and evaluate."""
    m.drop(
        "num_episodes",
        "num_cycles = num_episodes × ⌊dataset prompts / --rollout_batch_size⌋ depends on "
        "the dataset size; set run.num_cycles",
    )
    m.put_per_cycle(
        "save_steps", "learner.checkpoint_every_steps", steps, "rollout batches (cycles)"
    )
    m.put_per_cycle("eval_steps", "learner.eval_every_steps", steps, "rollout batches (cycles)")


def map_openrlhf(m: Mapper) -> None:
    steps = _openrlhf_batches(m)
    _openrlhf_direct(m)
    _openrlhf_lr_schedule(m)
    _openrlhf_policy_loss(m)
    _openrlhf_micro_batches(m)
    _openrlhf_schedule(m, steps)
    map_openrlhf_lora(m)
