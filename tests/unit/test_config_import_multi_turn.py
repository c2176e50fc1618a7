"""`tether config import --from verl` for multi-turn, tool-using rollouts: the multi_turn keys
and verl's tool config file, what maps and what is said not to."""

from __future__ import annotations

from common.config.load import load_config
from tether.config_import.render import render_toml
from tether.config_import.translate import import_peer_config

TOOLS_YAML = """\
tools:
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config:
      sandbox_fusion_url: "https://sandbox.example/run_code"
      default_timeout: 30
      memory_limit_mb: 1024
      type: native
    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters: {type: object, properties: {code: {type: string}}, required: [code]}
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config: {type: native}
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters: {type: object, properties: {answer: {type: string}}, required: [answer]}
"""


def _script(tmp_path, *extra: str):
    tools = tmp_path / "tool_config.yaml"
    tools.write_text(TOOLS_YAML)
    script = tmp_path / "run_multiturn.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo data.train_batch_size=8 actor_rollout_ref.rollout.n=4 \\\n"
        "  actor_rollout_ref.actor.ppo_mini_batch_size=8 data.max_response_length=1024 \\\n"
        "  algorithm.adv_estimator=grpo \\\n"
        "  actor_rollout_ref.rollout.multi_turn.enable=True \\\n"
        f"  actor_rollout_ref.rollout.multi_turn.tool_config_path={tools} " + " ".join(extra) + "\n"
    )
    return import_peer_config("verl", script)


def _notes(result) -> dict[str, str]:
    return {row.tether_key: row.note for row in result.mapping}


def _unmapped(result) -> dict[str, str]:
    return {key.rsplit(".", 1)[-1]: why for key, _, why in result.unmapped}


def test_verl_multi_turn_maps_to_episodes_with_the_python_tool(tmp_path):
    r = _script(
        tmp_path,
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=256",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=ignore_strippable",
        "actor_rollout_ref.rollout.multi_turn.max_user_turns=2",
        "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=True",
    )
    g = r.tether["generator"]
    assert g["max_turns"] == 4 and g["tools"] == ["python"] and g["tool_format"] == "hermes"
    assert (g["tool_timeout_s"], g["tool_memory_mb"]) == (30.0, 1024)
    assert (g["tool_output_max_chars"], g["template_check"]) == (256, "warn")
    assert "remote sandbox service" in _notes(r)["generator.tools"]
    assert "whitespace" in _notes(r)["generator.template_check"]
    unmapped = _unmapped(r)
    assert "assistant and tool turns" in unmapped["max_user_turns"]
    assert "ids as generated" in unmapped["use_inference_chat_template"]
    # the GSM8K reward tool has no equivalent: said so, with what to do
    (problem,) = [p.message for p in r.problems]
    assert "calc_gsm8k_reward (verl.tools.gsm8k_tool.Gsm8kTool)" in problem
    assert "typed Python function" in problem and "generator.tools" in problem
    toml = tmp_path / "imported.toml"
    toml.write_text(render_toml(r))
    cfg = load_config(config_file=toml, env={}).config
    assert (cfg.generator.max_turns, cfg.generator.tools) == (4, ["python"])


def test_verl_multi_turn_without_a_turn_limit_gets_one(tmp_path):
    r = _script(tmp_path)
    assert r.tether["generator"]["max_turns"] == 5
    assert "no limit" in _notes(r)["generator.max_turns"]


def test_verl_multi_turn_off_maps_nothing_and_says_so(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo data.train_batch_size=8 actor_rollout_ref.rollout.n=4 "
        "actor_rollout_ref.actor.ppo_mini_batch_size=8 "
        "actor_rollout_ref.rollout.multi_turn.enable=False "
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3\n"
    )
    r = import_peer_config("verl", script)
    assert "max_turns" not in r.tether.get("generator", {})
    assert "single-turn" in _unmapped(r)["max_assistant_turns"]


def test_a_missing_tool_file_is_named(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo data.train_batch_size=8 actor_rollout_ref.rollout.n=4 "
        "actor_rollout_ref.actor.ppo_mini_batch_size=8 "
        "actor_rollout_ref.rollout.multi_turn.enable=True "
        "actor_rollout_ref.rollout.multi_turn.tool_config_path=/nowhere/tools.yaml\n"
    )
    r = import_peer_config("verl", script)
    assert "/nowhere/tools.yaml is not here" in _unmapped(r)["tool_config_path"]
