"""slime: ``--flag value`` arguments of ``train.py``, old names (seed 000) included."""

from __future__ import annotations

from common.config.rules import default_max_staleness
from tether.config_import.mapping import R2_NOTE, Mapper, to_lr_schedule, to_one_path

_SLIME_NEW = {
    "prompts_per_cycle": "rollout_batch_size",
    "responses_per_prompt": "n_samples_per_prompt",
    "train_batch_size": "global_batch_size",
    "train_steps_per_cycle": "num_steps_per_rollout",
    "num_cycles": "num_rollout",
}


def _slime_batches(m: Mapper) -> int | None:
    """The cycle vocabulary and the staleness bound; returns train_steps_per_cycle if known
    (None also when slime itself would refuse the run, which is reported as a problem)."""
    for new, old in _SLIME_NEW.items():  # slime's proposed names, should a script already use them
        if new in m.src.flat and old not in m.src.flat:
            m.src.flat[old] = m.src.flat.pop(new)
    pk, nk, gk, sk = (
        "rollout_batch_size",
        "n_samples_per_prompt",
        "global_batch_size",
        "num_steps_per_rollout",
    )
    prompts, n = m.batch_knob(pk, None), m.batch_knob(nk, 1)
    if prompts is not None:
        m.put("run.prompts_per_cycle", prompts, pk)
    if n is not None:
        m.put("run.responses_per_prompt", n, nk, m.default_note(nk, 1))
    m.put("run.passes_per_cycle", 1, (), "slime passes over a cycle's data once")
    step, steps = None, None
    if prompts is not None and n is not None and m.given(sk):
        step = prompts * n // m.get(sk)
        if m.given(gk) and m.get(gk) != step:
            m.problem(
                f"slime refuses this run: --global-batch-size {m.get(gk)} is not "
                f"--rollout-batch-size {prompts} × --n-samples-per-prompt {n} // "
                f"--num-steps-per-rollout {m.get(sk)} = {step}; drop one of the two."
            )
            return None
    elif m.given(gk):
        step = m.get(gk)
    if step:
        m.put(
            "run.train_batch_size",
            step,
            gk if m.given(gk) else (pk, nk, sk),
            "responses per optimizer step",
        )
    if step and prompts is not None and n is not None:
        rem, q = prompts * n % step, prompts * n // step
        behaviour = (
            f"What slime does: it runs ⌊{prompts * n}/{step}⌋ = {q} optimizer step(s) of {step} "
            f"responses and drops the {rem} trailing responses of every cycle: they are generated "
            "and scored but never trained on."
        )
        steps = m.check_division(
            prompts=prompts,
            n=n,
            step=step,
            passes=1,
            cycle_text=f"--rollout-batch-size {prompts} × --n-samples-per-prompt {n}",
            step_text="--global-batch-size",
            behaviour=behaviour,
            knob=lambda d: f"slime: --global-batch-size {d}",
        )
    if steps:
        m.put("run.train_steps_per_cycle", steps, sk if m.given(sk) else (pk, nk, gk))
        if "async" in m.src.entry:
            m.res.unmapped.append(
                (
                    m.src.entry,
                    "(entry point)",
                    "generates the next cycle while training "
                    f"on this one; set run.max_staleness ≥ {default_max_staleness(steps)} to match",
                )
            )
        else:
            m.put_staleness(steps, (pk, gk), "slime's train.py is synchronous")
    return steps


def _slime_direct(m: Mapper) -> None:
    """The flags that map one to one, and the few computed from two (placement, min LR, eval
    data)."""
    m.simple(
        [
            ("hf_checkpoint", "run.model", str),
            ("prompt_data", "data.train_path", to_one_path),
            ("input_key", "data.prompt_key"),
            ("label_key", "data.answer_key"),
            ("seed", "run.seed"),
            ("num_rollout", "run.num_cycles", None, "slime's rollouts are cycles"),
            ("rollout_max_prompt_len", "run.max_prompt_tokens"),
            ("rollout_max_response_len", "run.max_response_tokens"),
            ("rollout_temperature", "generator.temperature"),
            ("rollout_top_p", "generator.top_p"),
            ("rollout_top_k", "generator.top_k"),
            ("eval_temperature", "generator.eval_temperature"),
            ("rollout_num_gpus_per_engine", "generator.tensor_parallel_size"),
            (
                "sglang_mem_fraction_static",
                "generator.gpu_memory_utilization",
                None,
                "SGLang's static memory fraction",
            ),
            ("actor_num_nodes", "learner.nnodes"),
            ("actor_num_gpus_per_node", "learner.nproc_per_node"),
            ("lr", "learner.lr"),
            ("weight_decay", "learner.weight_decay"),
            (
                "lr_warmup_iters",
                "learner.warmup_steps",
                None,
                "Megatron iterations are optimizer steps",
            ),
            ("lr_warmup_fraction", "learner.warmup_ratio"),
            ("lr_decay_style", "learner.lr_schedule", to_lr_schedule),
            ("clip_grad", "learner.grad_clip"),
            ("micro_batch_size", "learner.micro_batch_size"),
            ("entropy_coef", "learner.entropy_coef"),
            ("eps_clip_c", "learner.dual_clip"),
        ]
    )
    gpe = m.get("rollout_num_gpus_per_engine", 1)
    if m.given("rollout_num_gpus_per_engine") or m.given("rollout_num_gpus"):
        m.put(
            "generator.gpus_per_replica",
            gpe,
            "rollout_num_gpus_per_engine",
            m.default_note("rollout_num_gpus_per_engine", 1),
        )
    if m.given("rollout_num_gpus"):
        m.put(
            "generator.replicas",
            m.get("rollout_num_gpus") // gpe,
            ("rollout_num_gpus", "rollout_num_gpus_per_engine"),
        )
    if m.given("min_lr") and m.given("lr") and m.get("lr"):
        m.put(
            "learner.min_lr_ratio",
            m.get("min_lr") / m.get("lr"),
            ("min_lr", "lr"),
            "--min-lr / --lr",
        )
    eval_data = m.get("eval_prompt_data")
    if isinstance(eval_data, list) and len(eval_data) == 2:
        m.put(
            "data.eval_path",
            str(eval_data[1]),
            "eval_prompt_data",
            f"the {eval_data[0]!r} eval set",
        )


def _slime_policy_loss(m: Mapper) -> None:
    """Clip ranges, KL (as a loss or in the reward) and the advantage estimator."""
    if m.given("eps_clip") or m.given("eps_clip_high"):
        low = m.get("eps_clip", 0.2)
        m.put("learner.clip_low", low, "eps_clip", m.default_note("eps_clip", 0.2))
        m.put(
            "learner.clip_high",
            m.get("eps_clip_high", low),
            "eps_clip_high" if m.given("eps_clip_high") else "eps_clip",
        )
    if m.get("use_kl_loss", False):
        m.put_kl_loss(kind="kl_loss_type", kind_default="k1")
        if m.get("kl_coef", 0.0):
            m.drop(
                "kl_coef",
                "slime also puts a KL penalty in the reward; Tether applies KL one way only, "
                "so the KL loss was kept",
            )
    elif m.get("kl_coef", 0.0):
        m.put_kl(
            coef="kl_coef",
            kind=None,
            in_reward=True,
            coef_default=0.0,
            kind_default="k1",
            keys=(),
        )
    table = {
        "grpo": "grpo",
        "reinforce_plus_plus": "reinforce_pp",
        "reinforce_plus_plus_baseline": "reinforce_pp_baseline",
        "gspo": "grpo",  # GRPO advantages with the GSPO / CISPO loss (learner.policy_loss)
        "cispo": "grpo",
    }
    est = m.peer_estimator("advantage_estimator", table, "grpo")
    no_std = m.get("disable_grpo_std_normalization", False)
    if est == "grpo" and no_std:
        m.put(
            "learner.advantage_estimator",
            "drgrpo",
            ("advantage_estimator", "disable_grpo_std_normalization"),
        )
        m.put("learner.norm_adv_by_std", False, "disable_grpo_std_normalization")
    elif est:
        m.put(
            "learner.advantage_estimator",
            est,
            "advantage_estimator",
            m.default_note("advantage_estimator", "grpo"),
        )


def _slime_memory(m: Mapper) -> None:
    """Token-budget micro-batches and activation recompute."""
    if m.get("use_dynamic_batch_size", False) and m.given("max_tokens_per_gpu"):
        m.put(
            "learner.max_tokens_per_micro_batch",
            m.get("max_tokens_per_gpu"),
            ("use_dynamic_batch_size", "max_tokens_per_gpu"),
        )
    if m.given("recompute_granularity"):
        m.put(
            "learner.gradient_checkpointing",
            True,
            "recompute_granularity",
            "Megatron activation recompute",
        )


def _slime_schedule(m: Mapper, steps: int | None) -> None:
    """The run's length, and how often to checkpoint and evaluate."""
    m.drop(
        "num_epoch",
        "num_cycles from dataset epochs depends on the dataset size; set run.num_cycles",
    )
    m.put_per_cycle("save_interval", "learner.checkpoint_every_steps", steps, "rollouts (cycles)")
    m.put_per_cycle("eval_interval", "learner.eval_every_steps", steps, "rollouts (cycles)")


def _slime_routing(m: Mapper) -> None:
    """slime's --use-rollout-routing-replay is R3; --use-routing-replay (R2) has no Tether
    counterpart."""
    if m.given("use_rollout_routing_replay"):
        on = bool(m.get("use_rollout_routing_replay"))
        m.put("learner.router_replay", "r3" if on else "off", "use_rollout_routing_replay",
              "slime's rollout routing replay (R3)")  # fmt: skip
    if m.given("use_routing_replay") and m.get("use_routing_replay"):
        m.drop("use_routing_replay", R2_NOTE)


def map_slime(m: Mapper) -> None:
    steps = _slime_batches(m)
    _slime_direct(m)
    _slime_routing(m)
    _slime_policy_loss(m)
    _slime_memory(m)
    _slime_schedule(m, steps)
