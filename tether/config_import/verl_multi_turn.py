"""verl's multi-turn, tool-using rollouts (``actor_rollout_ref.rollout.multi_turn.*`` and the
tool config file it names) in Tether's episode settings, and what does not map.

verl declares tools as classes in a YAML file (``tools: [{class_name, config, tool_schema}]``);
Tether's tools are typed Python functions named in ``generator.tools``. Only verl's code tool
(``SandboxFusionTool``: code run in a remote sandbox service) has a Tether equivalent, the
built-in ``python`` tool (code run in the local sandbox); the others (GSM8K's answer checker,
search, geometry, MCP) need your own function, which the import names in its notes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tether.config_import.mapping import Mapper

_MT = "actor_rollout_ref.rollout.multi_turn."
DEFAULT_MAX_TURNS = 5  # when verl leaves max_assistant_turns unset (no limit)
CODE_TOOLS = ("SandboxFusionTool",)
SANITY = {"strict": "strict", "ignore_strippable": "warn", "disable": "off"}


def _tool_file(m: Mapper, key: str) -> list[dict[str, Any]] | None:
    """The ``tools`` list of verl's tool config file, or None (with the reason recorded)."""
    path = Path(str(m.get(key)))
    if not path.is_file():
        m.drop(key, f"the tool config file {path} is not here; import again where it is, "
                    "or name your tools in generator.tools")  # fmt: skip
        return None
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        m.drop(key, f"{path} is not valid YAML ({exc})")
        return None
    tools = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(tools, list):
        m.drop(key, f"{path} has no `tools:` list")
        return None
    return [t for t in tools if isinstance(t, dict)]


def _map_tools(m: Mapper, key: str) -> None:
    tools = _tool_file(m, key)
    if tools is None:
        return
    mapped: list[str] = []
    unmapped: list[str] = []
    timeout = memory = None
    for tool in tools:
        cls = str(tool.get("class_name", "")).rsplit(".", 1)[-1]
        config = tool.get("config") or {}
        if cls in CODE_TOOLS:
            mapped.append("python")
            timeout = config.get("default_timeout", timeout)
            memory = config.get("memory_limit_mb", memory)
        else:
            name = (tool.get("tool_schema") or {}).get("function", {}).get("name", cls)
            unmapped.append(f"{name} ({tool.get('class_name')})")
    if mapped:
        m.put("generator.tools", sorted(set(mapped)), key,
              "verl's SandboxFusionTool runs code in a remote sandbox service; Tether's python "
              "tool runs it in the generator's local sandbox (no network, per-call limits)")  # fmt: skip
        if timeout is not None:
            m.put(
                "generator.tool_timeout_s", float(timeout), key, "SandboxFusionTool default_timeout"
            )
        if memory is not None:
            m.put("generator.tool_memory_mb", int(memory), key, "SandboxFusionTool memory_limit_mb")
    if unmapped:
        m.problem(
            f"verl tools without a Tether equivalent in {m.get(key)}: {', '.join(unmapped)}. "
            "Write each as a typed Python function with a docstring (its schema comes from "
            "them) and add `module:function` to generator.tools."
        )


def map_multi_turn(m: Mapper) -> None:
    """Maps verl's multi_turn block; nothing happens unless ``multi_turn.enable`` is true."""
    if not m.get(_MT + "enable", False):
        for key in [k for k in m.src.flat if k.startswith(_MT)]:
            m.drop(key, "multi_turn.enable is false: single-turn responses")
        return
    turns = _MT + "max_assistant_turns"
    if m.given(turns):
        m.put("generator.max_turns", m.get(turns), turns, "assistant turns per episode")
    else:
        m.put("generator.max_turns", DEFAULT_MAX_TURNS, _MT + "enable",
              f"verl sets no limit by default; Tether needs one ({DEFAULT_MAX_TURNS})")  # fmt: skip
    if m.given(_MT + "tool_config_path"):
        _map_tools(m, _MT + "tool_config_path")
    else:
        m.problem("multi_turn.enable is true but no tool_config_path: name your tools in "
                  "generator.tools (Tether's episodes need at least one).")  # fmt: skip
    m.simple([
        (_MT + "max_tool_response_length", "generator.tool_output_max_chars", int,
         "characters of a tool's answer shown to the model"),
        (_MT + "format", "generator.tool_format", str,
         "hermes: <tool_call> JSON blocks (verl's only format)"),
    ])  # fmt: skip
    side = _MT + "tool_response_truncate_side"
    if m.given(side) and m.get(side) != "right":
        m.drop(side, "Tether keeps the start of a long tool answer and cuts the end")
    mode, old = _MT + "tokenization_sanity_check_mode", _MT + "enable_tokenization_sanity_check"
    if m.given(mode):
        value = SANITY.get(str(m.get(mode)))
        note = ("verl ignores differences in whitespace only; Tether counts every difference"
                if m.get(mode) == "ignore_strippable" else "")  # fmt: skip
        if value:
            m.put("generator.template_check", value, mode, note)
    elif m.given(old):
        m.put("generator.template_check", "warn" if m.get(old) else "off", old)
    m.drop(_MT + "use_inference_chat_template",
           "Tether renders tool turns with the model's own chat template and trains on the ids "
           "as generated either way")  # fmt: skip
    m.drop(_MT + "max_user_turns", "Tether's episodes alternate assistant and tool turns")
    m.drop(_MT + "max_parallel_calls",
           "a turn's calls run at once, up to generator.tool_workers")  # fmt: skip
    m.drop(_MT + "interaction_config_path",
           "verl's interactions (an environment's user turns) have no Tether mapping yet")  # fmt: skip
