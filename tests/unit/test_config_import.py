"""`tether config import`: peer launch scripts and YAML configs mapped onto Tether's keys."""

import tomllib

import pytest

from common.config.load import load_config
from tests.paths import FIXTURES as TEST_FIXTURES
from tether.config_import.render import render_mapping_table, render_toml
from tether.config_import.translate import import_peer_config

FIXTURES = TEST_FIXTURES / "import"
ALL = [
    ("verl", "verl_seed001_solver_grpo.sh"),
    ("verl", "verl_gsm8k_variables.sh"),
    ("verl", "verl_ppo_trainer.yaml"),
    ("openrlhf", "openrlhf_rloo_ray_job.sh"),
    ("openrlhf", "openrlhf_gae_uneven.sh"),
    ("slime", "slime_glm_old_names.sh"),
    ("roll", "roll_rlvr_megatron.yaml"),
    ("roll", "roll_fsdp2_uneven.yaml"),
]


def load(peer, name, **variables):
    return import_peer_config(peer, FIXTURES / name, variables=variables)


def unmapped_keys(result):
    return {key for key, _, _ in result.unmapped}


def assert_invariant(t):
    run = t["run"]
    generated = run["prompts_per_cycle"] * run["responses_per_prompt"] * run["passes_per_cycle"]
    assert generated == run["train_batch_size"] * run["train_steps_per_cycle"]


# --------------------------------------------------------------------------- verl


def test_verl_seed001_uneven_minibatch_is_a_problem_with_two_fixes():
    r = load("verl", "verl_seed001_solver_grpo.sh")
    assert len(r.problems) == 1
    msg = r.problems[0].message
    assert "120" in msg and "96" in msg
    # what verl does with the remainder: 3 ranks x 40 responses, cut 32 + 8, two unequal steps
    assert "32 + 8" in msg and "24 left over" in msg
    assert "train_batch_size = 120 with train_steps_per_cycle = 1" in msg
    assert "train_batch_size = 60 with train_steps_per_cycle = 2" in msg
    assert "prompts_per_cycle = 24 (1 step) or 48 (2 steps)" in msg
    run = r.tether["run"]
    assert (run["prompts_per_cycle"], run["responses_per_prompt"], run["train_batch_size"]) == (
        30,
        4,
        96,
    )
    assert "train_steps_per_cycle" not in run  # no valid step count exists
    assert run["num_cycles"] == 300 and run["max_prompt_tokens"] == 3072


def test_verl_seed001_common_keys():
    r = load("verl", "verl_seed001_solver_grpo.sh")
    t = r.tether
    assert t["run"]["model"] == "Qwen/Qwen2.5-3B-Instruct"
    assert t["data"]["train_path"] == "data/numinamath30k/train.parquet"  # ${DATA_DIR:-...} default
    assert t["data"]["overlong_prompt_policy"] == "drop"
    assert t["learner"]["micro_batch_size"] == 8
    assert t["learner"]["lr"] == 1e-6
    assert (t["learner"]["kl_coef"], t["learner"]["kl_type"]) == (0.001, "k3")
    assert t["learner"]["kl_in_reward"] is False
    assert t["learner"]["advantage_estimator"] == "grpo"
    assert t["generator"] == {
        "tensor_parallel_size": 1,
        "gpus_per_replica": 1,
        "replicas": 3,
        "gpu_memory_utilization": 0.4,
    }
    assert t["scorer"] == {"mode": "solver", "solver_model": "Qwen/Qwen2.5-3B-Instruct"}
    # both KL forms were on in verl; Tether keeps one and says which was dropped
    assert "algorithm.use_kl_in_reward" in unmapped_keys(r)
    assert r.unknown_variables == []  # "$@" and the tee log name are not part of the mapping


def test_verl_script_unknown_variables_are_reported_not_guessed():
    r = load("verl", "verl_gsm8k_variables.sh")
    assert r.unknown_variables == ["HOME", "N_GPUS", "NNODES"]
    assert {"trainer.n_gpus_per_node", "trainer.nnodes", "data.train_files"} <= unmapped_keys(r)
    assert "nproc_per_node" not in r.tether["learner"]
    assert "replicas" not in r.tether["generator"]
    assert r.problems == []


def test_verl_script_with_variables_given():
    r = load("verl", "verl_gsm8k_variables.sh", N_GPUS="8", NNODES="2", HOME="/data")
    assert r.unknown_variables == []
    t = r.tether
    assert (t["learner"]["nproc_per_node"], t["learner"]["nnodes"]) == (8, 2)
    assert t["generator"]["replicas"] == 8  # 16 GPUs / rollout TP 2 (the ${ROLLOUT_TP:-2} default)
    assert t["data"]["train_path"] == "/data/data/gsm8k/train.parquet"
    # 512 prompts x 8 = 4096 responses; mini-batch 128 prompts = 1024 responses; 2 epochs
    assert (t["run"]["train_batch_size"], t["run"]["train_steps_per_cycle"]) == (1024, 8)
    assert t["run"]["passes_per_cycle"] == 2 and t["run"]["max_staleness"] == 7
    assert_invariant(t)
    # dynamic batch size wins over the micro-batch count, as in verl
    assert t["learner"]["max_tokens_per_micro_batch"] == 24000
    assert "micro_batch_size" not in t["learner"]
    # grpo without std normalisation is Dr.GRPO; verl's warm-up counts cycles (x 8 steps)
    assert t["learner"]["advantage_estimator"] == "drgrpo"
    assert t["learner"]["norm_adv_by_std"] is False
    assert t["learner"]["warmup_steps"] == 80
    assert t["learner"]["eval_every_steps"] == 40
    assert (t["learner"]["clip_low"], t["learner"]["clip_high"]) == (0.2, 0.28)
    assert t["generator"]["eval_temperature"] == 0.6
    assert "actor_rollout_ref.actor.loss_agg_mode" in unmapped_keys(r)  # seq-mean-token-sum-norm


def test_verl_yaml_tree():
    r = load("verl", "verl_ppo_trainer.yaml")
    assert r.problems == []
    t = r.tether
    assert (t["run"]["prompts_per_cycle"], t["run"]["responses_per_prompt"]) == (256, 8)
    assert (t["run"]["train_batch_size"], t["run"]["train_steps_per_cycle"]) == (512, 4)
    assert_invariant(t)
    assert t["run"]["name"] == "math-rloo"  # ${oc.env:RUN_NAME,math-rloo} default
    assert t["learner"]["advantage_estimator"] == "rloo"
    assert (t["learner"]["kl_type"], t["learner"]["kl_in_reward"]) == ("k2", False)  # mse loss
    assert t["learner"]["lr"] == 1e-6  # YAML's "1e-6" is a string to PyYAML
    assert t["learner"]["dual_clip"] == 3.0
    assert t["generator"]["eval_temperature"] == 0.0  # do_sample false: greedy validation
    assert t["generator"]["replicas"] == 8  # 2 nodes x 8 GPUs / TP 2
    assert t["learner"]["checkpoint_every_steps"] == 80 and t["learner"]["eval_every_steps"] == 40
    assert t["data"]["overlong_prompt_policy"] == "error"
    assert t["learner"]["pack_sequences"] is True  # use_remove_padding: true
    assert load("verl", "verl_ppo_trainer.yaml", RUN_NAME="r7").tether["run"]["name"] == "r7"


def test_verl_default_estimator_gae_needs_a_critic(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo data.train_batch_size=8 \\\n"
        "  actor_rollout_ref.rollout.n=2 actor_rollout_ref.actor.ppo_mini_batch_size=4\n"
    )
    r = import_peer_config("verl", script)
    assert (
        len(r.problems) == 1
        and "gae" in r.problems[0].message
        and "critic" in r.problems[0].message
    )
    assert (r.tether["run"]["train_batch_size"], r.tether["run"]["train_steps_per_cycle"]) == (8, 2)


def test_verl_std_and_k3_clamp_are_mapped_where_verl_uses_them():
    t = load("verl", "verl_seed001_solver_grpo.sh").tether["learner"]
    # grpo divides by torch.std (n - 1); the low_var_kl loss is clamped to [-10, 10]
    assert (t["std_estimator"], t["kl_type"], t["kl_clamp"]) == ("unbiased", "k3", 10.0)
    t = load("verl", "verl_ppo_trainer.yaml").tether["learner"]
    assert "std_estimator" not in t and "kl_clamp" not in t  # rloo has no std; mse no clamp
    t = load("verl", "verl_gsm8k_variables.sh").tether["learner"]
    assert t["advantage_estimator"] == "drgrpo" and "std_estimator" not in t


def _verl_kl_in_reward(tmp_path, *extra):
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo data.train_batch_size=8 actor_rollout_ref.rollout.n=2 \\\n"
        "  actor_rollout_ref.actor.ppo_mini_batch_size=4 algorithm.use_kl_in_reward=True \\\n"
        "  algorithm.kl_ctrl.kl_coef=0.002 " + " ".join(extra) + "\n"
    )
    return import_peer_config("verl", script)


def test_verl_kl_in_reward_maps_to_a_config_tether_accepts(tmp_path):
    r = _verl_kl_in_reward(tmp_path, "algorithm.adv_estimator=grpo")
    t = r.tether["learner"]
    # verl's reward penalty defaults to kl_penalty=kl (k1), which verl does not clamp
    assert (t["kl_coef"], t["kl_in_reward"], t["kl_type"]) == (0.002, True, "k1")
    assert "kl_clamp" not in t and t["std_estimator"] == "unbiased"
    note = next(row.note for row in r.mapping if row.tether_key == "learner.kl_in_reward")
    assert "per-token advantages" in note and "differ" in note
    r = _verl_kl_in_reward(
        tmp_path, "algorithm.adv_estimator=reinforce_plus_plus", "algorithm.kl_penalty=low_var_kl"
    )
    t = r.tether["learner"]
    assert (t["kl_type"], t["kl_clamp"], t["std_estimator"]) == ("k3", 10.0, "unbiased")
    assert r.problems == []
    toml = tmp_path / "imported.toml"
    toml.write_text(render_toml(r))
    ln = load_config(config_file=toml, env={}).config.learner
    assert (ln.kl_in_reward, ln.kl_type, ln.kl_clamp, ln.std_estimator) == (
        True,
        "k3",
        10.0,
        "unbiased",
    )


# --------------------------------------------------------------------------- OpenRLHF


def test_openrlhf_ray_job_submit():
    r = load("openrlhf", "openrlhf_rloo_ray_job.sh")
    assert r.problems == []
    t = r.tether
    # 32 prompts x 4 = 128 responses; --train_batch_size counts responses: 32 -> 4 steps
    assert (t["run"]["prompts_per_cycle"], t["run"]["responses_per_prompt"]) == (32, 4)
    assert (t["run"]["train_batch_size"], t["run"]["train_steps_per_cycle"]) == (32, 4)
    assert_invariant(t)
    assert t["learner"]["micro_batch_size"] == 1
    assert (t["learner"]["clip_low"], t["learner"]["clip_high"]) == (0.2, 0.28)
    assert (t["learner"]["kl_type"], t["learner"]["kl_in_reward"]) == ("k3", False)
    assert t["learner"]["advantage_estimator"] == "rloo"
    assert t["learner"]["lr"] == 5e-7  # given as --actor_learning_rate=5e-7
    assert t["learner"]["checkpoint_every_steps"] == 40  # --save_steps counts cycles
    assert t["generator"] == {
        "replicas": 2,
        "tensor_parallel_size": 4,
        "gpus_per_replica": 4,
        "gpu_memory_utilization": 0.5,
        "temperature": 1.0,
    }
    assert (t["data"]["prompt_key"], t["data"]["answer_key"]) == ("context_messages", "answer")
    assert {"--colocate_all_models", "--num_episodes"} <= unmapped_keys(r)
    assert t["learner"]["pack_sequences"] is True  # --packing_samples
    assert "--runtime-env-json" not in str(r.unmapped)  # ray's own flags are not OpenRLHF's
    assert r.unknown_variables == ["WANDB_API_KEY"]


def test_openrlhf_group_norm_uses_the_unbiased_std(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 -m openrlhf.cli.train_ppo_ray --rollout_batch_size 8 --n_samples_per_prompt 4 "
        "--train_batch_size 32 --advantage_estimator group_norm\n"
    )
    t = import_peer_config("openrlhf", script).tether["learner"]
    assert (t["advantage_estimator"], t["std_estimator"]) == ("grpo", "unbiased")
    assert "std_estimator" not in load("openrlhf", "openrlhf_rloo_ray_job.sh").tether["learner"]


def test_openrlhf_uneven_and_gae_problems():
    r = load("openrlhf", "openrlhf_gae_uneven.sh")
    messages = [p.message for p in r.problems]
    assert len(messages) == 2
    assert "96" in messages[0] and "64" in messages[0] and "DeepSpeed" in messages[0]
    assert "train_batch_size = 96 with train_steps_per_cycle = 1" in messages[0]
    assert "gae" in messages[1]
    why = dict((k, w) for k, _, w in r.unmapped)["--async_train"]
    assert "max_staleness" in why


# --------------------------------------------------------------------------- rendering


@pytest.mark.parametrize(("peer", "name"), ALL)
def test_render_toml_round_trips(peer, name):
    r = load(peer, name)
    text = render_toml(r)
    assert text.startswith(f"# Tether config imported from {peer}: ")
    assert tomllib.loads(text) == r.tether


@pytest.mark.parametrize(("peer", "name"), ALL)
def test_mapping_table_lists_every_peer_key(peer, name):
    r = load(peer, name)
    table = render_mapping_table(r)
    for row in r.mapping:
        assert f"→ {row.tether_key} = " in table
    for key, _, why in r.unmapped:
        assert f"  {key} = " in table and why in table
    assert all(p.message in table for p in r.problems)


def test_offload_settings_from_verl_and_openrlhf(tmp_path):
    """verl's param/optimizer offload and OpenRLHF's --adam_offload: learner.cpu_offload (FSDP2
    offloads the three together, and the note says so when the peer moved only the optimizer);
    the reference's offload: learner.reference_cpu_offload."""
    seed = load("verl", "verl_seed001_solver_grpo.sh").tether["learner"]
    assert (seed["cpu_offload"], seed["reference_cpu_offload"]) == (False, True)
    assert load("verl", "verl_ppo_trainer.yaml").tether["learner"]["cpu_offload"] is False
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo data.train_batch_size=8 "
        "actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=8 "
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True\n"
    )
    r = import_peer_config("verl", script)
    assert r.tether["learner"]["cpu_offload"] is True
    (row,) = [m for m in r.mapping if m.tether_key == "learner.cpu_offload"]
    assert "moves only the optimizer state" in row.note
    script.write_text(
        "python3 -m openrlhf.cli.train_ppo_ray --rollout_batch_size 8 --n_samples_per_prompt 4 "
        "--train_batch_size 32 --advantage_estimator rloo --adam_offload --ref_reward_offload\n"
    )
    t = import_peer_config("openrlhf", script).tether["learner"]
    assert (t["cpu_offload"], t["reference_cpu_offload"]) == (True, True)
