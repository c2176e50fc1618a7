"""The config schema, its sources and precedence, and every cross-field rule."""

from __future__ import annotations

import pytest

from common.config.errors import ConfigError
from common.config.load import load_config
from common.config.reference import BEGIN, END, reference_markdown
from common.config.schema import TetherConfig
from common.service.settings import policy_engine_settings, solver_engine_settings
from tests.paths import REPO


def cfg_of(**flags):
    return load_config(flags={f"run.{k}": v for k, v in flags.items()}, env={}).config


def test_defaults_are_valid_and_balanced():
    c = TetherConfig()
    r = c.run
    assert (
        r.prompts_per_cycle * r.responses_per_prompt * r.passes_per_cycle
        == r.train_batch_size * r.train_steps_per_cycle
    )


def test_train_batch_size_is_derived_from_steps():
    c = cfg_of(prompts_per_cycle=30, responses_per_prompt=4, train_steps_per_cycle=2)
    assert c.run.train_batch_size == 60
    assert "run.train_batch_size" in c.derived


def test_steps_are_derived_from_batch_size():
    c = cfg_of(prompts_per_cycle=30, responses_per_prompt=4, train_batch_size=40)
    assert c.run.train_steps_per_cycle == 3
    assert "run.train_steps_per_cycle" in c.derived


def test_passes_multiply_consumed_responses():
    c = cfg_of(prompts_per_cycle=8, responses_per_prompt=4, passes_per_cycle=2, train_batch_size=16)
    assert c.run.train_steps_per_cycle == 4


def test_invariant_violation_shows_equation_and_two_fixes():
    with pytest.raises(ConfigError) as e:
        cfg_of(
            prompts_per_cycle=30,
            responses_per_prompt=4,
            train_batch_size=96,
            train_steps_per_cycle=1,
        )
    msg = str(e.value)
    assert "30 × 4 × 1 = 120" in msg and "96 × 1 = 96" in msg
    assert "set train_batch_size = 120" in msg
    assert "set prompts_per_cycle = 24" in msg


def test_underivable_steps_refused():
    with pytest.raises(ConfigError, match="not a whole number of optimizer steps"):
        cfg_of(prompts_per_cycle=30, responses_per_prompt=4, train_batch_size=96)


def test_underivable_batch_refused():
    with pytest.raises(ConfigError, match="do not split into train_steps_per_cycle = 7"):
        cfg_of(prompts_per_cycle=30, responses_per_prompt=4, train_steps_per_cycle=7)


def test_passes_need_whole_steps_per_pass():
    with pytest.raises(ConfigError, match="passes_per_cycle = 2"):
        cfg_of(prompts_per_cycle=3, responses_per_prompt=4, passes_per_cycle=2, train_batch_size=8)


def test_micro_batch_must_divide_per_rank_share():
    with pytest.raises(ConfigError, match="does not divide the per-rank share") as e:
        load_config(
            flags={"run.prompts_per_cycle": 8, "run.responses_per_prompt": 4},
            overrides=["learner.nproc_per_node=2", "learner.micro_batch_size=5"],
            env={},
        )
    assert "32 / 2 ranks = 16" in str(e.value)


def test_batch_must_split_over_ranks():
    with pytest.raises(ConfigError, match="cannot be shared evenly by 3 learner ranks"):
        load_config(
            flags={"run.prompts_per_cycle": 8, "run.responses_per_prompt": 4},
            overrides=["learner.nproc_per_node=3"],
            env={},
        )


def test_grad_accumulation_is_derived():
    c = load_config(
        flags={"run.prompts_per_cycle": 8, "run.responses_per_prompt": 4},
        overrides=["learner.nproc_per_node=2", "learner.micro_batch_size=4"],
        env={},
    ).config
    assert c.grad_accumulation_steps == 4  # 32 / 2 ranks / 4


def test_count_and_token_budget_are_exclusive():
    with pytest.raises(ConfigError, match="both set"):
        load_config(
            overrides=["learner.micro_batch_size=4", "learner.max_tokens_per_micro_batch=4096"],
            env={},
        )


def test_token_budget_must_fit_longest_sequence():
    with pytest.raises(ConfigError, match="at least 384"):
        load_config(overrides=["learner.max_tokens_per_micro_batch=100"], env={})


def test_staleness_below_steps_minus_one_is_explained():
    with pytest.raises(ConfigError) as e:
        cfg_of(
            prompts_per_cycle=8, responses_per_prompt=4, train_steps_per_cycle=4, max_staleness=2
        )
    assert "max_staleness ≥ 3" in str(e.value)


def test_staleness_boundary_is_accepted_and_default_overlaps_one_cycle():
    assert (
        cfg_of(
            prompts_per_cycle=8, responses_per_prompt=4, train_steps_per_cycle=4, max_staleness=3
        ).run.max_staleness
        == 3
    )
    assert (
        cfg_of(
            prompts_per_cycle=8, responses_per_prompt=4, train_steps_per_cycle=4
        ).run.max_staleness
        == 7
    )


def test_publish_every_must_divide_steps():
    with pytest.raises(ConfigError, match="publish_every_steps = 3"):
        load_config(
            flags={"run.train_steps_per_cycle": 4},
            overrides=["learner.publish_every_steps=3"],
            env={},
        )


def test_socket_timeout_must_exceed_block():
    with pytest.raises(ConfigError, match="socket_timeout_s"):
        load_config(overrides=["bus.block_ms=10000", "bus.socket_timeout_s=5"], env={})


def test_unknown_key_suggests(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[learner]\nlearning_rate = 1e-6\n")
    with pytest.raises(ConfigError, match="unknown setting 'learner.learning_rate'"):
        load_config(config_file=f, env={})
    with pytest.raises(ConfigError, match="Did you mean 'prompts_per_cycle'"):
        load_config(overrides=["run.prompt_per_cycle=3"], env={})
    with pytest.raises(ConfigError, match="Did you mean 'learner'"):
        load_config(overrides=["lerner.lr=3"], env={})


def test_bad_type_names_setting_and_source():
    with pytest.raises(ConfigError) as e:
        load_config(env={"TETHER_LEARNER__LR": "fast"})
    assert "learner.lr = 'fast' (environment TETHER_LEARNER__LR)" in str(e.value)


def test_precedence_defaults_file_env_flags_set(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[learner]\nlr = 1e-5\nweight_decay = 0.1\ngrad_clip = 0.5\n[run]\nseed = 7\n")
    env = {"TETHER_LEARNER__WEIGHT_DECAY": "0.2", "TETHER_LEARNER__GRAD_CLIP": "0.3"}
    lo = load_config(
        config_file=f, env=env, flags={"run.seed": 9}, overrides=["learner.grad_clip=0.4"]
    )
    c = lo.config
    assert c.learner.lr == 1e-5  # file over default
    assert c.learner.weight_decay == 0.2  # env over file
    assert c.run.seed == 9  # flag over file
    assert c.learner.grad_clip == 0.4  # --set over env
    assert lo.sources["learner.weight_decay"] == "environment TETHER_LEARNER__WEIGHT_DECAY"


def test_cycle_knobs_in_any_table_and_top_level(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text(
        "prompts_per_cycle = 6\n[learner]\ntrain_batch_size = 12\nlr = 1e-6\n[generator]\nresponses_per_prompt = 4\n"
    )
    c = load_config(config_file=f, env={}).config
    assert (
        c.run.prompts_per_cycle,
        c.run.responses_per_prompt,
        c.run.train_batch_size,
        c.run.train_steps_per_cycle,
    ) == (6, 4, 12, 2)


def test_conflicting_copies_of_a_knob_refused(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("prompts_per_cycle = 6\n[run]\nprompts_per_cycle = 8\n")
    with pytest.raises(ConfigError, match="given twice with different values"):
        load_config(config_file=f, env={})


def test_non_cycle_top_level_key_refused(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("lr = 1e-6\n")
    with pytest.raises(ConfigError, match="must sit in a section"):
        load_config(config_file=f, env={})


def test_slime_aliases_warn_once_and_map(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text(
        "[run]\nrollout_batch_size = 8\nn_samples_per_prompt = 4\nglobal_batch_size = 16\n"
    )
    lo = load_config(config_file=f, env={}, flags={"run.num_rollout": 3})
    assert lo.config.run.prompts_per_cycle == 8 and lo.config.run.train_steps_per_cycle == 2
    assert lo.config.run.num_cycles == 3
    assert len(lo.warnings) == 4
    assert any("'rollout_batch_size'" in w and "prompts_per_cycle" in w for w in lo.warnings)


def test_renamed_agent_max_turns_is_refused_naming_agent_max_requests(tmp_path):
    """`[agent] max_turns` was renamed `max_requests` (generator.max_turns kept its name and its
    meaning): a file, a --set or an environment variable that still says it is refused with one
    paragraph naming the new key and the value to write there, never read as the new key."""
    f = tmp_path / "c.toml"
    f.write_text("[agent]\nmax_turns = 8\n")
    with pytest.raises(ConfigError) as e:
        load_config(config_file=f, env={})
    msg = str(e.value)
    assert f"'agent.max_turns' ({f} [agent]) was renamed to 'agent.max_requests'" in msg
    assert "write max_requests = 8 under [agent]" in msg and "\n" not in msg
    for source in ({"overrides": ["agent.max_turns=4"]}, {"env": {"TETHER_AGENT__MAX_TURNS": "4"}}):
        with pytest.raises(ConfigError, match="renamed to 'agent.max_requests'"):
            load_config(**{"env": {}, **source})
    assert load_config(overrides=["agent.max_requests=4"], env={}).config.agent.max_requests == 4
    assert load_config(overrides=["generator.max_turns=1"], env={}).config.generator.max_turns == 1


def test_invalid_toml_names_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[run\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(config_file=f, env={})


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(config_file="/nonexistent/tether.toml", env={})


def test_readme_config_reference_matches_the_schema():
    readme = (REPO / "README.md").read_text()
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    assert readme[start:end] == reference_markdown(), (
        "regenerate with: python -m common.config.reference"
    )


def test_greedy_with_several_samples_is_refused():
    with pytest.raises(ConfigError, match="solver_temperature > 0"):
        load_config(overrides=['scorer.mode="solver"', "scorer.solver_samples=3"], env={})
    with pytest.raises(ConfigError, match="generator.temperature > 0"):
        load_config(overrides=["generator.temperature=0"], env={})


def test_std_estimator_and_kl_clamp_defaults_and_rules():
    ln = TetherConfig().learner
    assert (ln.std_estimator, ln.kl_clamp) == ("population", None)

    def learner(*sets):
        return load_config(overrides=list(sets), env={}).config.learner

    assert learner('learner.std_estimator="unbiased"').std_estimator == "unbiased"
    for est in ("reinforce_pp", "reinforce_pp_baseline"):
        learner('learner.std_estimator="unbiased"', f'learner.advantage_estimator="{est}"')
    assert learner("learner.kl_coef=0.001", "learner.kl_clamp=10").kl_clamp == 10.0
    # settings that would do nothing are refused, naming the setting and the fix
    for est in ("rloo", "drgrpo"):
        with pytest.raises(ConfigError, match=f'std_estimator = "unbiased" has no effect.*"{est}"'):
            learner('learner.std_estimator="unbiased"', f'learner.advantage_estimator="{est}"')
    with pytest.raises(ConfigError, match="norm_adv_by_std = false"):
        learner('learner.std_estimator="unbiased"', "learner.norm_adv_by_std=false")
    with pytest.raises(ConfigError, match="kl_clamp = 10.0 has no effect.*set kl_coef > 0"):
        learner("learner.kl_clamp=10")
    with pytest.raises(ConfigError, match="std_estimator"):
        learner('learner.std_estimator="bessel"')
    with pytest.raises(ConfigError, match="kl_clamp"):
        learner("learner.kl_coef=0.001", "learner.kl_clamp=0")


def test_health_limits_that_would_kill_healthy_services_are_refused():
    def load(*sets: str):
        return load_config(flags={}, overrides=list(sets), env={}).config

    with pytest.raises(ConfigError, match="keepalive_s"):
        load("learner.keepalive_s=600", "learner.collective_timeout_s=1000")
    with pytest.raises(ConfigError, match="scorer.liveness_s"):
        load("scorer.liveness_s=3", "bus.block_ms=2000")
    cfg = load("learner.keepalive_s=5", "learner.collective_timeout_s=60")
    assert cfg.learner.keepalive_s == 5 and cfg.generator.liveness_s == 60.0


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        (["learner.clip_low=1.0"], 'only policy_loss = "cispo" accepts'),
        (['learner.policy_loss="gspo"', "learner.dual_clip=3.0"], "dual_clip applies to"),
        (["learner.mismatch_mask_token=[2.0, 0.5]"], "mismatch_mask_token"),
        (["learner.mismatch_mask_geometric=[0.9]"], "mismatch_mask_geometric"),
        (["learner.dynamic_sampling=true"], "filter_equal_reward_groups = true"),
        (["learner.max_extra_prompts_per_cycle=4"], "has no effect"),
        (
            [
                "learner.dynamic_sampling=true",
                "learner.filter_equal_reward_groups=true",
                "run.responses_per_prompt=1",
            ],
            "responses_per_prompt ≥ 2",
        ),
    ],
)
def test_learner_algorithm_settings_that_cannot_work_are_refused(sets, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=sets, env={})


def test_dynamic_sampling_cap_is_derived_and_cispo_may_drop_its_lower_clip():
    res = load_config(
        overrides=[
            "learner.dynamic_sampling=true",
            "learner.filter_equal_reward_groups=true",
            'learner.policy_loss="cispo"',
            "learner.clip_low=1.0",
        ],
        env={},
    )
    assert res.config.learner.max_extra_prompts_per_cycle == 2 * res.config.run.prompts_per_cycle
    assert "learner.max_extra_prompts_per_cycle" in res.config._derived


def test_each_correction_gets_its_sources_cap_and_over_cap_rule():
    """decoupled: AReaL's behav_imp_weight_cap = 5, tokens above it dropped; tis: the TIS
    write-up's C = 2, truncated; either rule with either name through learner.is_over_cap."""
    ln = load_config(env={}).config.learner
    assert (ln.off_policy, ln.is_cap, ln.is_over_cap) == ("decoupled", 5.0, "mask")
    ln = load_config(overrides=['learner.off_policy="tis"'], env={}).config.learner
    assert (ln.is_cap, ln.is_over_cap) == (2.0, "truncate")
    ln = load_config(
        overrides=['learner.off_policy="tis"', 'learner.is_over_cap="mask"'], env={}
    ).config.learner
    assert (ln.is_cap, ln.is_over_cap) == (2.0, "mask")
    ln = load_config(overrides=['learner.is_over_cap="truncate"'], env={}).config.learner
    assert (ln.is_cap, ln.is_over_cap) == (5.0, "truncate")
    with pytest.raises(ConfigError, match="no effect while learner.off_policy"):
        load_config(overrides=['learner.off_policy="none"', "learner.is_cap=2.0"], env={})
    with pytest.raises(ConfigError, match="behav_imp_weight_cap > 1"):
        load_config(overrides=["learner.is_cap=1.0"], env={})


def test_auto_settings_and_derived_values_are_settled_at_load():
    """ "auto" that the config alone decides, and every derived value, hold their final value in
    a loaded config: no service decides them again."""
    cpu = load_config(env={}).config
    assert (cpu.generator.dtype, cpu.weights.backend) == ("float32", "gloo")
    assert {"generator.dtype", "weights.backend", "learner.publish_every_steps"} <= cpu.derived
    assert cpu.learner.publish_every_steps == cpu.run.train_steps_per_cycle
    gpu = load_config(overrides=["generator.gpus_per_replica=1"], env={}).config
    assert gpu.generator.dtype == "bfloat16"
    given = load_config(
        overrides=["generator.dtype=float16", "weights.backend=nccl"], env={}
    ).config
    assert (given.generator.dtype, given.weights.backend) == ("float16", "nccl")
    assert not {"generator.dtype", "weights.backend"} & given.derived
    for c in (cpu, gpu, given, TetherConfig()):
        run = c.run
        assert None not in (
            run.train_batch_size,
            run.train_steps_per_cycle,
            run.max_staleness,
            c.scorer.solver_max_model_len,
            c.learner.publish_every_steps,
        )


def test_engine_settings_are_built_from_the_config_in_one_place(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    cfg = load_config(
        overrides=[
            f"run.model={model}",
            "run.seed=7",
            "generator.gpus_per_replica=1",
            "generator.kv_cache_gib=3",
            "scorer.solver_kv_cache_gib=2",
            "scorer.solver_dtype=float32",
        ],
        env={},
    ).config
    policy = policy_engine_settings(cfg, worker_extension_cls="pkg.Ext")
    assert (policy.model, policy.tokenizer, policy.dtype) == (str(model), str(model), "bfloat16")
    assert policy.max_model_len == cfg.run.max_prompt_tokens + cfg.run.max_response_tokens
    assert (policy.kv_cache_gib, policy.seed, policy.worker_extension_cls) == (3, 7, "pkg.Ext")
    solver = solver_engine_settings(cfg)  # scorer.solver_model empty: the policy's weights
    assert (solver.model, solver.dtype, solver.kv_cache_gib, solver.seed) == (
        str(model),
        "float32",
        2,
        7,
    )
    assert solver.max_model_len == cfg.scorer.solver_max_model_len
    assert solver.worker_extension_cls is None  # the solver's weights never change


def test_episode_settings_that_cannot_work_are_refused_at_load():

    def load(*sets: str):
        return load_config(flags={}, overrides=list(sets), env={}).config

    for sets, words in [
        (['generator.tools=["calculator"]'], "could call a tool but never read its answer"),
        (["generator.max_turns=3"], "nothing answers the model between its turns"),
        (["generator.max_turns=3", 'generator.tools=["calculator"]',
          "data.apply_chat_template=false"], "needs the chat template"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            load(*sets)
    cfg = load("generator.max_turns=3", 'generator.tools=["calculator", "python"]')
    assert (cfg.generator.max_turns, cfg.generator.template_check) == (3, "warn")
