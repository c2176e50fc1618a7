"""``generator.tool_prompt``: where the tool list goes, on the chat templates model authors publish
(``fixtures.published_templates``). Whole tool episodes through the system message are in
``test_published_templates.py`` (``test_tool_episodes_through_the_system_message``); here: the
choice ``auto`` makes, where the text goes, calls sent by an OpenAI client, and the learner's
length check counting the same prompt the generator sends."""

from __future__ import annotations

import json

import pytest

from common.chat.tool_calls import FORMATS
from common.chat.tool_prompt import SystemTools, for_tools, renders_tools, resolve_mode
from common.chat.turns import TemplateDeltaError, TurnEncoder, render_ids
from common.config.load import load_config
from common.service.preflight import PreflightError, preflight
from common.service.settings import prompt_sets_for
from common.tools.registry import resolve_tools
from fixtures.published_templates import TEMPLATES, TOOL_TEMPLATES, end_ids, tokenizer

TOOLS = [s.schema() for s in resolve_tools(["calculator"])]
QUESTION = [{"role": "user", "content": "What is 123*4567? Use the calculator."}]
HERMES = FORMATS["hermes"]
WITHOUT_TOOLS = tuple(n for n in TEMPLATES if n not in TOOL_TEMPLATES)


@pytest.mark.parametrize("name", TEMPLATES)
def test_auto_keeps_every_tool_aware_template_and_writes_the_rest_into_the_system_message(name):
    tok = tokenizer(name)
    aware = name in TOOL_TEMPLATES
    assert renders_tools(tok) == aware
    assert resolve_mode("auto", tok) == ("template" if aware else "system")
    assert (for_tools(tok, mode="auto", fmt=HERMES) is tok) == aware
    assert resolve_mode("template", tok) == "template" and resolve_mode("system", tok) == "system"
    if not aware:  # the template's own path refuses tools by name, with the setting that fixes it
        with pytest.raises(TemplateDeltaError, match='tool_prompt = "system"'):
            TurnEncoder(tok, end_ids=end_ids(name, tok), tools=TOOLS)


def test_a_mode_that_is_not_one_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="generator.tool_prompt = 'prompt'; choose one of auto"):
        resolve_mode("prompt", tokenizer("smollm2"))


def test_the_conversations_own_system_message_keeps_its_text_first():
    tok = tokenizer("smollm2")
    sys_tok = for_tools(tok, mode="auto", fmt=HERMES)
    assert isinstance(sys_tok, SystemTools) and sys_tok.system_role
    own = [{"role": "system", "content": "You are terse."}, *QUESTION]
    text = sys_tok.apply_chat_template(own, tools=TOOLS, tokenize=False,
                                       add_generation_prompt=True)  # fmt: skip
    assert text.count("<|im_start|>system") == 1
    assert text.index("You are terse.") < text.index('"name": "calculator"') < text.index("123*")
    # SmolLM2's default system message gives way to the tools when the conversation has none
    text = sys_tok.apply_chat_template(QUESTION, tools=TOOLS, tokenize=False)
    assert text.count("<|im_start|>system") == 1 and "named SmolLM" not in text
    # no tools: the conversation as it is
    assert sys_tok.apply_chat_template(own, tokenize=False) == tok.apply_chat_template(
        own, tokenize=False
    )


def test_a_template_without_a_system_role_gets_the_tools_in_the_first_user_turn():
    tok = tokenizer("gemma2")  # Gemma 2's template raises on a system message
    sys_tok = for_tools(tok, mode="system", fmt=HERMES)
    assert not sys_tok.system_role
    text = sys_tok.apply_chat_template(QUESTION, tools=TOOLS, tokenize=False,
                                       add_generation_prompt=True)  # fmt: skip
    assert "<start_of_turn>user\nYou can call tools" in text
    assert text.index('"name": "calculator"') < text.index("123*4567")


@pytest.mark.parametrize("name", WITHOUT_TOOLS)
def test_openai_style_calls_are_written_as_the_model_writes_them(name):
    sys_tok = for_tools(tokenizer(name), mode="system", fmt=HERMES)
    turn = {"role": "assistant", "content": None, "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": "2+2"})}}]}  # fmt: skip
    text = sys_tok.apply_chat_template([*QUESTION, turn], tools=TOOLS, tokenize=False)
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n' in text


@pytest.fixture
def smollm2_run(tmp_path):
    """Settings of a tools run on a model directory with SmolLM2's published template (the
    weights file is empty: nothing here loads them)."""
    model = tmp_path / "model"
    tokenizer("smollm2").save_pretrained(model)
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "model.safetensors").write_bytes(b"")  # the path check looks for weights by name
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": QUESTION[0]["content"], "answer": "561741"}) + "\n")
    base = [f"run.model={json.dumps(str(model))}", f"data.train_path={json.dumps(str(train))}",
            'generator.tools=["calculator"]', "generator.max_turns=3",
            "run.max_prompt_tokens=4000"]  # fmt: skip
    return lambda *sets: load_config(overrides=[*base, *sets], env={}).config


def test_the_learner_counts_the_prompt_the_generator_sends(smollm2_run):
    """``prompt_sets_for`` (the learner's length check, and `tether train`'s) renders a tools run's
    prompts as the generator does: with the tool list in the system message."""
    cfg = smollm2_run('generator.tool_format="hermes"')
    tok = tokenizer("smollm2")
    (record,) = prompt_sets_for(cfg, tok)[0].records
    sent = render_ids(for_tools(tok, mode="auto", fmt=HERMES), QUESTION, tools=TOOLS,
                      add_generation_prompt=True)  # fmt: skip
    assert record.prompt_token_ids == sent
    assert len(sent) > len(render_ids(tok, QUESTION, tools=None, add_generation_prompt=True)) + 50


def test_preflight_rehearses_the_system_message_way_and_names_the_settings(smollm2_run):
    preflight(smollm2_run('generator.tool_format="hermes"'), "train")  # auto: system
    with pytest.raises(PreflightError, match='ignores `tools`.*tool_prompt = "system"'):
        preflight(smollm2_run('generator.tool_format="hermes"', 'generator.tool_prompt="template"'),
                  "train")  # fmt: skip
    with pytest.raises(PreflightError, match="no tool-call format.*hermes is the usual choice"):
        preflight(smollm2_run(), "train")  # tool_format auto: SmolLM2 has none
