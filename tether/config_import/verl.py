"""verl: Hydra overrides in a launch script (``key=value``) or its composed YAML tree."""

from __future__ import annotations

from tether.config_import.lora import map_verl_lora
from tether.config_import.mapping import (
    Mapper,
    to_loss_agg,
    to_lr_schedule,
    to_one_path,
    to_router_replay,
)
from tether.config_import.verl_multi_turn import map_multi_turn

_A, _R, _O = (
    "actor_rollout_ref.actor.",
    "actor_rollout_ref.rollout.",
    "actor_rollout_ref.actor.optim.",
)


def _verl_world(m: Mapper) -> int | None:
    if not m.given("trainer.n_gpus_per_node"):
        return None
    return m.get("trainer.n_gpus_per_node") * m.get("trainer.nnodes", 1)


def _verl_remainder(cycle: int, step: int, world: int | None) -> str:
    rem = cycle % step
    if world and cycle % world == 0 and step % world == 0:
        share, mini = cycle // world, step // world
        parts = [str(mini)] * (share // mini) + [str(share % mini)]
        split = (
            f"each of its {world} data-parallel ranks gets {share} responses and cuts them "
            f"(DataProto.split) into mini-batches of ppo_mini_batch_size × n / {world} = {mini}: "
            + " + ".join(parts)
        )
    else:
        split = (
            f"it cuts the {cycle} responses (DataProto.split) into mini-batches of {step}: "
            + " + ".join([str(step)] * (cycle // step) + [str(rem)])
        )
    return (
        f"What verl does (it raises no error): {split}; so each epoch runs {cycle // step + 1} optimizer "
        f"steps of unequal size, {step} responses then the {rem} left over, and the short step's loss "
        f"is still normalised by the full mini-batch size, so it weighs only {rem}/{step} of a full step."
    )


def _verl_batch(m: Mapper) -> int | None:
    pk, nk, mk, ek = (
        "data.train_batch_size",
        _R + "n",
        _A + "ppo_mini_batch_size",
        _A + "ppo_epochs",
    )
    prompts, n, mini, passes = (
        m.batch_knob(pk, 1024),
        m.batch_knob(nk, 1),
        m.batch_knob(mk, 256),
        m.batch_knob(ek, 1),
    )
    if prompts is not None:
        m.put(
            "run.prompts_per_cycle",
            prompts,
            pk,
            m.default_note(
                pk, 1024, "verl's data.train_batch_size counts prompts per training step"
            ),
        )
    if n is not None:
        m.put("run.responses_per_prompt", n, nk, m.default_note(nk, 1))
    if passes is not None:
        m.put(
            "run.passes_per_cycle",
            passes,
            ek,
            m.default_note(ek, 1, "ppo_epochs over each cycle's data"),
        )
    if None in (prompts, n, mini, passes):
        return None
    m.put(
        "run.train_batch_size",
        mini * n,
        (mk, nk),
        f"ppo_mini_batch_size counts prompts: {mini} × {n} responses",
    )
    if prompts < mini:
        m.problem(
            f"verl refuses this run: data.train_batch_size={prompts} is smaller than "
            f"ppo_mini_batch_size={mini}; lower ppo_mini_batch_size to at most {prompts}."
        )
        return None
    steps = m.check_division(
        prompts=prompts,
        n=n,
        step=mini * n,
        passes=passes,
        cycle_text=f"data.train_batch_size={prompts} prompts × rollout.n={n}",
        step_text=f"ppo_mini_batch_size={mini} prompts × {n}",
        behaviour=_verl_remainder(prompts * n, mini * n, _verl_world(m)),
        knob=lambda d: f"verl: ppo_mini_batch_size={d // n}",
    )
    if steps:
        m.put(
            "run.train_steps_per_cycle",
            steps,
            (pk, mk, ek),
            f"({prompts} / {mini}) mini-batches × {passes} epochs",
        )
        m.put_staleness(steps, (pk, mk, ek), "verl is synchronous")
    return steps


def _verl_micro(m: Mapper) -> None:
    dyn, tok, micro, old = (
        _A + "use_dynamic_bsz",
        _A + "ppo_max_token_len_per_gpu",
        _A + "ppo_micro_batch_size_per_gpu",
        _A + "ppo_micro_batch_size",
    )
    if m.get(dyn, False):
        m.put(
            "learner.max_tokens_per_micro_batch",
            m.get(tok, 16384),
            (dyn, tok),
            m.default_note(
                tok, 16384, "dynamic batch size: micro-batches cut by a token budget per GPU"
            ),
        )
        for key in (micro, old):
            m.drop(key, "verl ignores it when use_dynamic_bsz=True")
        return
    m.drop(tok, "only used when use_dynamic_bsz=True")
    world = _verl_world(m)
    if m.given(micro):
        m.put(
            "learner.micro_batch_size",
            m.get(micro),
            micro,
            "responses per GPU per forward/backward",
        )
    elif m.given(old) and world:
        m.put(
            "learner.micro_batch_size",
            m.get(old) // world,
            old,
            f"deprecated global size ÷ {world} GPUs",
        )


_VERL_KL_REWARD_NOTE = (
    "both subtract kl_coef × KL(sampling policy ‖ reference) from each token's reward before the "
    "estimator; reinforce_plus_plus matches, but for grpo, rloo and reinforce_plus_plus_baseline "
    "verl sums a response's penalised rewards into one score for the group rule, while Tether "
    "applies the group rule to the outcome reward and charges each token its KL-to-go "
    "(per-token advantages), so those numbers differ"
)


def _verl_algorithm(m: Mapper) -> None:
    table = {
        "grpo": "grpo",
        "rloo": "rloo",
        "reinforce_plus_plus": "reinforce_pp",
        "reinforce_plus_plus_baseline": "reinforce_pp_baseline",
    }
    ek, nk = "algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo"
    est = m.peer_estimator(ek, table, "gae")
    norm = m.get(nk, True)
    if est == "grpo" and norm is False:
        m.put(
            "learner.advantage_estimator",
            "drgrpo",
            (ek, nk),
            "GRPO without std normalisation is Dr.GRPO",
        )
    elif est:
        m.put("learner.advantage_estimator", est, ek)
    if m.given(nk) and est == "grpo":
        m.put("learner.norm_adv_by_std", norm, nk)
    elif est:
        m.drop(nk, "verl only applies it to grpo")
    if (est == "grpo" and norm is not False) or est in ("reinforce_pp", "reinforce_pp_baseline"):
        why = "verl divides by the unbiased (n − 1) std: torch.std of each group in GRPO"
        if est != "grpo":
            why = (
                "verl divides by the unbiased (n − 1) std: masked_whiten over tokens in REINFORCE++ "
                "(Tether whitens over sequences unless KL is in the reward, then over tokens)"
            )
        m.put("learner.std_estimator", "unbiased", ek, why)
    low, high, base = _A + "clip_ratio_low", _A + "clip_ratio_high", _A + "clip_ratio"
    cispo = m.get(_A + "policy_loss.loss_mode", "vanilla") == "cispo"
    for key, tkey in ((low, "learner.clip_low"), (high, "learner.clip_high")):
        src = key if m.given(key) else base
        if not m.given(src):
            continue
        value, note = m.get(src), ""
        if tkey == "learner.clip_low" and cispo and value >= 1.0:
            # verl clamps CISPO's weight at 1 − clip_ratio_low ≤ 0: no lower bound at all (its
            # own CISPO example sets 10). Tether writes "no lower bound" as clip_low = 1.
            value, note = 1.0, f"verl's {value:g} puts the lower bound at {1 - value:g} ≤ 0: none"
        m.put(tkey, value, src, note)
    m.simple(
        [
            (
                _A + "clip_ratio_c",
                "learner.dual_clip",
                None,
                "verl always applies dual clip (default 3.0)",
            ),
            (_A + "entropy_coeff", "learner.entropy_coef"),
            (_A + "loss_agg_mode", "learner.loss_agg", to_loss_agg),
        ]
    )
    loss, reward = m.get(_A + "use_kl_loss", False), m.get("algorithm.use_kl_in_reward", False)
    reward_keys = (
        "algorithm.use_kl_in_reward",
        "algorithm.kl_ctrl.kl_coef",
        "algorithm.kl_penalty",
        "algorithm.kl_ctrl.type",
    )
    if loss:
        m.put_kl(
            coef=_A + "kl_loss_coef",
            kind=_A + "kl_loss_type",
            in_reward=False,
            coef_default=0.001,
            kind_default="low_var_kl",
            keys=(_A + "use_kl_loss",),
            k3_clamp=10.0,
        )
        for key in reward_keys:
            m.drop(
                key,
                "verl also subtracts a KL penalty from the reward; Tether applies KL one way "
                "only, so the KL loss was kept and this reward penalty dropped",
            )
    elif reward:
        m.put_kl(
            coef="algorithm.kl_ctrl.kl_coef",
            kind="algorithm.kl_penalty",
            in_reward=True,
            coef_default=0.001,
            kind_default="kl",
            keys=("algorithm.use_kl_in_reward",),
            k3_clamp=10.0,
            reward_note=_VERL_KL_REWARD_NOTE,
        )
        m.drop(
            "algorithm.kl_ctrl.type", "Tether's KL coefficient is fixed (no adaptive controller)"
        )
    elif m.given(_A + "use_kl_loss") or m.given("algorithm.use_kl_in_reward"):
        m.put(
            "learner.kl_coef",
            0.0,
            (_A + "use_kl_loss", "algorithm.use_kl_in_reward"),
            "no KL term in verl",
        )


def _verl_data(m: Mapper) -> None:
    m.simple(
        [
            ("data.train_files", "data.train_path", to_one_path),
            ("data.val_files", "data.eval_path", to_one_path),
            ("data.prompt_key", "data.prompt_key"),
            ("data.max_prompt_length", "run.max_prompt_tokens"),
            ("data.max_response_length", "run.max_response_tokens"),
            ("data.seed", "run.seed"),
            ("trainer.experiment_name", "run.name", str),
            ("actor_rollout_ref.model.path", "run.model", str),
        ]
    )
    fk, tk = "data.filter_overlong_prompts", "data.truncation"
    if m.get(fk, False):
        m.put(
            "data.overlong_prompt_policy",
            "drop",
            (fk, tk),
            "over-long prompts are filtered out when the data is loaded, so truncation never fires",
        )
    elif m.get(tk, "error") == "error" and (m.given(fk) or m.given(tk)):
        m.put("data.overlong_prompt_policy", "error", (fk, tk))
    else:
        for key in (fk, tk):
            m.drop(
                key, "verl truncates over-long prompts; Tether never does: choose 'drop' or 'error'"
            )


_FSDP2_OFFLOAD_NOTE = (
    "FSDP2 offloads parameters, gradients and optimizer state together (CPUOffloadPolicy, the "
    "step on the CPU); verl's optimizer_offload alone moves only the optimizer state off the GPU "
    "between steps: Tether offloads the parameters too"
)


def _verl_offload(m: Mapper) -> None:
    """The actor's param/optimizer offload -> learner.cpu_offload; the reference's ->
    learner.reference_cpu_offload."""
    keys = (_A + "fsdp_config.param_offload", _A + "fsdp_config.optimizer_offload")
    given = [k for k in keys if m.given(k)]
    if given:
        params, optim = (bool(m.get(k, False)) for k in keys)
        note = _FSDP2_OFFLOAD_NOTE if optim and not params else ""
        m.put("learner.cpu_offload", params or optim, tuple(given), note)
    ref = "actor_rollout_ref.ref.fsdp_config.param_offload"
    if m.given(ref):
        m.put("learner.reference_cpu_offload", bool(m.get(ref)), ref)


def _verl_optimizer_and_sampling(m: Mapper, steps: int | None) -> None:
    """The keys that map one to one: optimizer, rollout sampling, the learner's nodes."""
    m.simple(
        [
            (_O + "lr", "learner.lr"),
            (_O + "weight_decay", "learner.weight_decay"),
            (_O + "lr_warmup_steps_ratio", "learner.warmup_ratio"),
            (_O + "min_lr_ratio", "learner.min_lr_ratio"),
            (_O + "warmup_style", "learner.lr_schedule", to_lr_schedule),
            (_O + "lr_scheduler_type", "learner.lr_schedule", to_lr_schedule),
            (_A + "grad_clip", "learner.grad_clip"),
            (
                "actor_rollout_ref.model.enable_gradient_checkpointing",
                "learner.gradient_checkpointing",
                bool,
            ),
            (
                _A + "router_replay.mode",
                "learner.router_replay",
                to_router_replay,
                "verl's rollout routing replay (R3)",
            ),
            (
                _A + "megatron.router_replay.mode",
                "learner.router_replay",
                to_router_replay,
                "verl's rollout routing replay (R3)",
            ),
            (
                "actor_rollout_ref.model.use_remove_padding",
                "learner.pack_sequences",
                bool,
                "verl's remove-padding (varlen) forward is Tether's sequence packing: the same "
                "loss, fewer tokens through the model",
            ),
            (_R + "temperature", "generator.temperature"),
            (_R + "top_p", "generator.top_p"),
            (_R + "top_k", "generator.top_k", None, "-1 disables top-k"),
            (_R + "gpu_memory_utilization", "generator.gpu_memory_utilization"),
            ("trainer.nnodes", "learner.nnodes"),
            (
                "trainer.n_gpus_per_node",
                "learner.nproc_per_node",
                None,
                "verl's hybrid engine also runs rollout here",
            ),
        ]
    )
    m.put_per_cycle(
        _O + "lr_warmup_steps",
        "learner.warmup_steps",
        steps,
        "LR-scheduler steps, one per cycle",
    )


def _verl_placement(m: Mapper) -> None:
    """Rollout tensor parallelism, and as many generators as verl had rollout GPUs."""
    tp, world = _R + "tensor_model_parallel_size", _verl_world(m)
    if m.given(tp):
        m.put("generator.tensor_parallel_size", m.get(tp), tp)
        m.put("generator.gpus_per_replica", m.get(tp), tp)
        if world:
            m.put(
                "generator.replicas",
                world // m.get(tp),
                (tp, "trainer.n_gpus_per_node", "trainer.nnodes"),
                "verl time-shares the training GPUs with rollout; Tether generators need GPUs of their own",
            )


def _verl_schedule(m: Mapper, steps: int | None) -> None:
    """Validation sampling, the run's length, and how often to evaluate and checkpoint."""
    dk, vk = _R + "val_kwargs.do_sample", _R + "val_kwargs.temperature"
    if m.given(dk) or m.given(vk):
        greedy = not m.get(dk, False)
        m.put(
            "generator.eval_temperature",
            0.0 if greedy else m.get(vk, 0),
            (dk, vk),
            "val_kwargs.do_sample is False (verl's default): validation is greedy"
            if greedy
            else "",
        )
    total, epochs = "trainer.total_training_steps", "trainer.total_epochs"
    if m.given(total):
        m.put("run.num_cycles", m.get(total), total, "verl's training steps are cycles")
        m.drop(
            epochs,
            "verl stops at total_training_steps or after total_epochs passes over the data, "
            "whichever comes first; the step count was kept",
        )
    m.drop(
        epochs,
        "num_cycles = total_epochs × ⌊dataset prompts / data.train_batch_size⌋ depends on the "
        "dataset size; set run.num_cycles",
    )
    m.put_per_cycle(
        "trainer.test_freq", "learner.eval_every_steps", steps, "training steps (cycles)"
    )
    m.put_per_cycle(
        "trainer.save_freq", "learner.checkpoint_every_steps", steps, "training steps (cycles)"
    )


def _verl_solver(m: Mapper) -> None:
    """The seed 001 script's solver model, given as a shell variable rather than a verl key."""
    for name, value in m.src.env.items():
        if name.endswith("SOLVER_MODEL") and value:
            m.src.flat["$" + name] = ("$" + name, value)
            m.put(
                "scorer.mode",
                "solver",
                "$" + name,
                "the script's solver-reward variable (not a verl key)",
            )
            m.put("scorer.solver_model", value, "$" + name)


def map_verl(m: Mapper) -> None:
    steps = _verl_batch(m)
    _verl_micro(m)
    _verl_algorithm(m)
    _verl_data(m)
    _verl_optimizer_and_sampling(m, steps)
    _verl_offload(m)
    _verl_placement(m)
    _verl_schedule(m, steps)
    _verl_solver(m)
    map_multi_turn(m)
    map_verl_lora(m)
