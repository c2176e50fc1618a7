"""`tether config import` for slime and ROLL, and the reading of launch scripts (the shell
lexer: arrays, quoting, variables, line continuations) with its errors. verl, OpenRLHF and the
rendering of every fixture: test_config_import.py."""

import shlex

import pytest

from tests.unit.test_config_import import assert_invariant, load, unmapped_keys
from tether.config_import.shell import _Shell
from tether.config_import.translate import import_peer_config

# --------------------------------------------------------------------------- slime


def test_slime_old_names_in_bash_arrays():
    r = load("slime", "slime_glm_old_names.sh")
    assert r.problems == [] and r.unknown_variables == []
    t = r.tether
    assert t["run"]["prompts_per_cycle"] == 32 and t["run"]["responses_per_prompt"] == 8
    assert (t["run"]["train_batch_size"], t["run"]["train_steps_per_cycle"]) == (256, 1)
    assert t["run"]["num_cycles"] == 3000 and t["run"]["max_response_tokens"] == 8192
    assert t["run"]["model"] == "/root/Qwen3-4B"
    assert t["data"]["eval_path"] == "/root/aime-2024/aime-2024.jsonl"
    assert t["learner"]["nproc_per_node"] == 8  # ${NUM_GPUS} from the script
    assert (t["learner"]["clip_low"], t["learner"]["clip_high"]) == (0.2, 0.28)
    assert (t["learner"]["kl_type"], t["learner"]["kl_in_reward"]) == ("k3", False)
    assert t["learner"]["max_tokens_per_micro_batch"] == 9216
    assert t["generator"]["temperature"] == 0.8 and t["generator"]["gpus_per_replica"] == 2
    assert "--tensor-model-parallel-size" in unmapped_keys(r)


def test_slime_remainder_is_dropped_and_inconsistent_knobs_refused(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 train.py --rollout-batch-size 30 --n-samples-per-prompt 4 "
        "--global-batch-size 96 --num-rollout 10\n"
    )
    r = import_peer_config("slime", script)
    assert len(r.problems) == 1
    assert "drops the 24 trailing responses" in r.problems[0].message
    script.write_text(
        "python3 train.py --rollout-batch-size 30 --n-samples-per-prompt 4 "
        "--global-batch-size 60 --num-steps-per-rollout 3\n"
    )
    r = import_peer_config("slime", script)
    assert len(r.problems) == 1 and "refuses" in r.problems[0].message
    script.write_text(
        "python3 train.py --prompts-per-cycle 30 --responses-per-prompt 4 "
        "--num-steps-per-rollout 2\n"
    )
    r = import_peer_config("slime", script)
    assert r.problems == []
    assert (r.tether["run"]["train_batch_size"], r.tether["run"]["train_steps_per_cycle"]) == (
        60,
        2,
    )


# --------------------------------------------------------------------------- ROLL


def test_roll_megatron_global_batch_formula():
    r = load("roll", "roll_rlvr_megatron.yaml")
    assert r.problems == []
    t = r.tether
    # 1 per device x 64 accumulation x 16 GPUs / tp 2 = 512 = 64 prompts x 8
    assert (t["run"]["train_batch_size"], t["run"]["train_steps_per_cycle"]) == (512, 1)
    assert_invariant(t)
    assert (t["learner"]["nnodes"], t["learner"]["nproc_per_node"]) == (2, 8)
    assert t["generator"]["replicas"] == 16
    assert t["run"]["max_response_tokens"] == 4096 and t["learner"]["kl_type"] == "k3"
    assert t["learner"]["warmup_steps"] == 20 and t["learner"]["gradient_checkpointing"] is True


def test_roll_fsdp2_ulysses_async_and_uneven():
    r = load("roll", "roll_fsdp2_uneven.yaml")
    assert r.problems == [] and r.unknown_variables == ["MODEL_PATH"]
    t = r.tether
    assert (t["run"]["train_batch_size"], t["run"]["train_steps_per_cycle"]) == (32, 3)  # 2*4*8/2
    assert "max_staleness" not in t["run"]
    assert "max_staleness" in dict((k, w) for k, _, w in r.unmapped)["async_generation_ratio"]
    assert "pretrain" in unmapped_keys(r)
    r = load("roll", "roll_fsdp2_uneven.yaml", ROLL_GA="5", MODEL_PATH="/m")
    assert len(r.problems) == 1
    msg = r.problems[0].message
    assert "96" in msg and "40" in msg and "AssertionError" in msg
    assert r.tether["run"]["model"] == "/m"


def test_roll_needs_yaml(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("python examples/start_rlvr_pipeline.py --config_name rlvr_config\n")
    r = import_peer_config("roll", script)
    assert len(r.problems) == 1 and "YAML" in r.problems[0].message


# --------------------------------------------------------------------------- shell reading


def test_shell_lexing_rules(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "#!/bin/bash\n"
        "export N=4   # trailing comment\n"
        "TWICE=$((N * 2))\n"
        "HOST=$(hostname)\n"
        "LR='1e-6'\n"
        "python3 -m openrlhf.cli.train_ppo_ray \\\n"
        "    --rollout_batch_size ${PROMPTS:-16} \\\n"
        "    # --n_samples_per_prompt 99 \\\n"
        "    --n_samples_per_prompt $N \\\n"
        "    --train_batch_size=$TWICE \\\n"
        '    --actor_learning_rate "$LR" \\\n'
        "    --pretrain '$NOT_EXPANDED' \\\n"
        "    --save_path /ckpt/$HOST --advantage_estimator group_norm 2>&1 | tee log.txt\n"
    )
    r = import_peer_config("openrlhf", script)
    run = r.tether["run"]
    assert (run["prompts_per_cycle"], run["responses_per_prompt"], run["train_batch_size"]) == (
        16,
        4,
        8,
    )
    assert run["train_steps_per_cycle"] == 8 and run["model"] == "$NOT_EXPANDED"
    assert r.tether["learner"]["lr"] == 1e-6
    assert r.unknown_variables == ["$(hostname)"]
    assert "--save_path" in unmapped_keys(r) and "tee" not in str(r.unmapped)
    r = import_peer_config("openrlhf", script, variables={"PROMPTS": "32"})
    assert r.tether["run"]["prompts_per_cycle"] == 32


def test_quotes_inside_words_and_quoted_substitutions():
    """What shlex cannot do in either mode (the lexer's docstring): a quote that opens inside a
    word, a quoted command substitution with quotes inside, and the three ways to write $X."""
    text = 'X="a b"\npython3 t.py --q="$X" --r=$X --s=\'$X\' --t="$(date "+%s")" ${X}c\n'
    shell = _Shell(text, {})
    assert shell.commands() == [
        ["python3", "t.py", "--q=a b", "--r=a", "b", "--s=$X", '--t=$(date "+%s")', "a", "bc"]
    ]
    assert shell.unresolved == {'$(date "+%s")'}
    kept = shlex.shlex('--q="a b"', posix=False, punctuation_chars=True)
    assert list(kept) == ['--q="a', 'b"']  # why not shlex: the quote opened inside the word
    with pytest.raises(ValueError, match="No closing quotation"):
        list(shlex.shlex('--t="$(date "+%s")"', posix=False, punctuation_chars=True))


def test_missing_command_and_bad_inputs(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("echo python3 -m verl.trainer.main_ppo data.train_batch_size=1\n")
    r = import_peer_config("verl", script)
    assert len(r.problems) == 1 and "main_ppo" in r.problems[0].message
    with pytest.raises(ValueError, match="unknown peer"):
        import_peer_config("trl", script)
    with pytest.raises(ValueError, match="cannot read"):
        import_peer_config("verl", tmp_path / "absent.sh")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        import_peer_config("verl", bad)


def test_rollout_routing_replay_from_slime_and_verl(tmp_path):
    """slime's --use-rollout-routing-replay and verl's router_replay.mode=R3 are
    learner.router_replay = "r3"; R2 (the learner's own old routing) is listed as not mapped."""
    script = tmp_path / "run.sh"
    base = "python3 train.py --rollout-batch-size 8 --n-samples-per-prompt 4 --global-batch-size 32"
    script.write_text(f"{base} --use-rollout-routing-replay\n")
    assert import_peer_config("slime", script).tether["learner"]["router_replay"] == "r3"
    script.write_text(f"{base} --use-routing-replay\n")
    r = import_peer_config("slime", script)
    assert "router_replay" not in r.tether.get("learner", {})
    assert any("R2" in why for key, _, why in r.unmapped if "routing" in key)
    verl = ("python3 -m verl.trainer.main_ppo data.train_batch_size=8 actor_rollout_ref.rollout.n=4 "
            "actor_rollout_ref.actor.ppo_mini_batch_size=8 ")  # fmt: skip
    for key in ("router_replay.mode", "megatron.router_replay.mode"):
        script.write_text(f"{verl}actor_rollout_ref.actor.{key}=R3\n")
        assert import_peer_config("verl", script).tether["learner"]["router_replay"] == "r3"
    script.write_text(f"{verl}actor_rollout_ref.actor.router_replay.mode=R2\n")
    r = import_peer_config("verl", script)
    assert "router_replay" not in r.tether.get("learner", {})
    assert any("R2" in why for _, _, why in r.unmapped)
