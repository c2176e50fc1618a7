"""LoRA settings: ``learner.lora_*``, the derived ``generator.max_lora_rank``, and the verl and
OpenRLHF LoRA keys in `tether config import`."""

from __future__ import annotations

import pytest

from common.config.errors import ConfigError
from common.config.load import load_config
from tether.config_import.render import render_toml
from tether.config_import.translate import import_peer_config


def cfg(*overrides: str):
    return load_config(overrides=list(overrides), env={}).config


def test_lora_is_off_by_default_and_the_engine_serves_no_adapter():
    c = cfg()
    assert c.learner.lora_rank == 0 and c.generator.max_lora_rank == 0
    assert "generator.max_lora_rank" in c.derived
    assert c.learner.lora_target_modules == ["all-linear"] and c.learner.lora_alpha == 16


@pytest.mark.parametrize(
    ("rank", "served"), [(1, 1), (2, 8), (8, 8), (9, 16), (33, 64), (512, 512)]
)
def test_the_engine_rank_is_the_smallest_vllm_allows(rank: int, served: int):
    c = cfg(f"learner.lora_rank={rank}")
    assert c.generator.max_lora_rank == served and "generator.max_lora_rank" in c.derived


def test_a_given_engine_rank_is_kept_when_vllm_allows_it():
    c = cfg("learner.lora_rank=8", "generator.max_lora_rank=32")
    assert c.generator.max_lora_rank == 32 and "generator.max_lora_rank" not in c.derived


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (("learner.lora_rank=16", "generator.max_lora_rank=8"), "set it to 16"),
        (("learner.lora_rank=4", "generator.max_lora_rank=4"), "vLLM allows only 1, 8, 16"),
        (("generator.max_lora_rank=16",), "without learner.lora_rank"),
        (("learner.lora_rank=8", "learner.lora_target_modules=[]"), "names no module"),
        (
            ("learner.lora_rank=8", 'learner.lora_target_modules=["all-linear", "q_proj"]'),
            "already means every linear layer",
        ),
        (("learner.lora_rank=513",), "learner.lora_rank"),
        (("learner.lora_dropout=1.0",), "learner.lora_dropout"),
    ],
)
def test_bad_lora_settings_are_refused_with_the_fix(overrides, words: str):
    with pytest.raises(ConfigError, match=words):
        cfg(*overrides)


def _script(tmp_path, text: str):
    path = tmp_path / "run.sh"
    path.write_text(text)
    return path


def test_verl_lora_keys_map_to_the_same_numbers(tmp_path):
    r = import_peer_config("verl", _script(tmp_path, (
        "python3 -m verl.trainer.main_ppo data.train_batch_size=8 actor_rollout_ref.rollout.n=2 \\\n"
        "  actor_rollout_ref.actor.ppo_mini_batch_size=4 algorithm.adv_estimator=grpo \\\n"
        "  actor_rollout_ref.model.lora_rank=32 actor_rollout_ref.model.lora_alpha=64 \\\n"
        "  actor_rollout_ref.model.target_modules=all-linear \\\n"
        "  actor_rollout_ref.rollout.load_format=safetensors actor_rollout_ref.model.use_shm=True\n"
    )))  # fmt: skip
    ln = r.tether["learner"]
    assert (ln["lora_rank"], ln["lora_alpha"], ln["lora_target_modules"]) == (
        32, 64.0, ["all-linear"]
    )  # fmt: skip
    note = next(row.note for row in r.mapping if row.tether_key == "learner.lora_rank")
    assert "only the adapter" in note and "10×" in note
    unmapped = {key for key, _, _ in r.unmapped}
    assert {"actor_rollout_ref.rollout.load_format", "actor_rollout_ref.model.use_shm"} <= unmapped
    toml = tmp_path / "imported.toml"
    toml.write_text(render_toml(r))
    c = load_config(config_file=toml, env={}).config
    assert (c.learner.lora_rank, c.generator.max_lora_rank) == (32, 32)


def test_verl_lora_rank_zero_is_full_fine_tuning(tmp_path):
    r = import_peer_config("verl", _script(tmp_path, (
        "python3 -m verl.trainer.main_ppo data.train_batch_size=8 actor_rollout_ref.rollout.n=2 \\\n"
        "  actor_rollout_ref.actor.ppo_mini_batch_size=4 algorithm.adv_estimator=grpo \\\n"
        "  actor_rollout_ref.model.lora_rank=0 actor_rollout_ref.model.lora_alpha=64\n"
    )))  # fmt: skip
    assert r.tether["learner"]["lora_rank"] == 0 and "lora_alpha" not in r.tether["learner"]
    assert "actor_rollout_ref.model.lora_alpha" in {key for key, _, _ in r.unmapped}


def test_openrlhf_lora_flags_map_with_a_module_list(tmp_path):
    r = import_peer_config("openrlhf", _script(tmp_path, (
        "python3 -m openrlhf.cli.train_ppo_ray --rollout_batch_size 8 --n_samples_per_prompt 4 "
        "--train_batch_size 32 --advantage_estimator group_norm --lora_rank 16 --lora_alpha 32 "
        "--target_modules q_proj v_proj --lora_dropout 0.05\n"
    )))  # fmt: skip
    ln = r.tether["learner"]
    assert (ln["lora_rank"], ln["lora_alpha"], ln["lora_dropout"]) == (16, 32.0, 0.05)
    assert ln["lora_target_modules"] == ["q_proj", "v_proj"]
    note = next(row.note for row in r.mapping if row.tether_key == "learner.lora_rank")
    assert "#1081" in note
    toml = tmp_path / "imported.toml"
    toml.write_text(render_toml(r))
    assert load_config(config_file=toml, env={}).config.generator.max_lora_rank == 16


def test_openrlhf_lora_defaults_are_openrlhfs(tmp_path):
    r = import_peer_config("openrlhf", _script(tmp_path, (
        "python3 -m openrlhf.cli.train_ppo_ray --rollout_batch_size 8 --n_samples_per_prompt 4 "
        "--train_batch_size 32 --advantage_estimator group_norm --lora_rank 8\n"
    )))  # fmt: skip
    ln = r.tether["learner"]
    assert (ln["lora_alpha"], ln["lora_target_modules"]) == (16.0, ["all-linear"])
    notes = {row.tether_key: row.note for row in r.mapping}
    assert "default" in notes["learner.lora_alpha"]
