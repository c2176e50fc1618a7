"""Token-in, token-out episodes against each model family's own tokenizer and chat template.

Environment turns are appended as the ids of a template difference; the conversation built that
way equals the template's full rendering when the model wrote canonical text and ids, and the
re-render check finds the first id where it does not: ids that are not the canonical BPE
encoding of their text, and a Qwen3-style template that drops earlier reasoning. Families
without a tool format (Gemma 2, Phi-3) still take environment turns (user messages); their
templates ignore ``tools`` and are refused for tool episodes.
"""

from __future__ import annotations

import json

import pytest

from common.chat.tool_calls import tool_format
from common.chat.turns import (
    TemplateDeltaError,
    TurnEncoder,
    end_of_turn_ids,
    render_ids,
    rerender_mismatch,
)
from common.tools.registry import resolve_tools
from fixtures.model_families import build_family

TOOL_FAMILIES = ("llama3", "qwen2.5", "qwen3", "qwen3-moe")
ALL_FAMILIES = (*TOOL_FAMILIES, "gemma2", "phi3")
TOOLS = [s.schema() for s in resolve_tools(["calculator"])]
QUESTION = [{"role": "user", "content": "What is 12*34? Use the calculator."}]
CALL = {"hermes": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}'
                  "\n</tool_call>",
        "llama3_json": '{"name": "calculator", "parameters": {"expression": "12*34"}}'}  # fmt: skip


def _load(name: str):
    from transformers import AutoTokenizer

    path = build_family(name)
    tok = AutoTokenizer.from_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    return name, tok, end_of_turn_ids(tok, str(path)), config["model_type"]


@pytest.fixture(scope="module", params=ALL_FAMILIES)
def family(request):
    return _load(request.param)


@pytest.fixture(scope="module", params=TOOL_FAMILIES)
def tool_family(request):
    return _load(request.param)


def _ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False).input_ids)


def _tool_episode(tok, end, model_type, *, first_turn_text: str | None = None):
    """Ids of [question] → a tool call → its result → a final answer, built token-in/token-out,
    and the conversation's messages as an OpenAI client would hold them."""
    fmt = tool_format("auto", model_type=model_type, vocab=tok.get_vocab())
    enc = TurnEncoder(tok, end_ids=end, tools=TOOLS)
    prompt = render_ids(tok, QUESTION, tools=TOOLS, add_generation_prompt=True)
    text = first_turn_text or CALL[fmt.name]
    turn1 = [*_ids(tok, text), enc.end_token]
    parsed = fmt.parse(text)
    assert [c.name for c in parsed.calls] == ["calculator"] and not parsed.calls[0].error
    result = [{"role": "tool", "content": "408"}]
    delta = enc.env_turn(result)
    turn2 = [*_ids(tok, "\\boxed{408}"), enc.end_token]
    messages = [*QUESTION, parsed.message(), *result]
    return enc, prompt, turn1, delta, turn2, messages


def test_tool_turns_by_difference_equal_the_full_render(tool_family):
    name, tok, end, model_type = tool_family
    enc, prompt, turn1, delta, turn2, messages = _tool_episode(tok, end, model_type)
    ids = [*prompt, *turn1, *delta]
    full = render_ids(tok, messages, tools=TOOLS, add_generation_prompt=True)
    assert ids == full  # the canonical episode is what the template renders
    assert rerender_mismatch(enc, messages, ids) == -1
    assert "408" in tok.decode(delta) and tok.decode(delta).count("408") == 1
    # the final turn follows on the same ids; nothing before it is re-encoded
    episode = [*ids, *turn2]
    assert episode[: len(prompt) + len(turn1)] == [*prompt, *turn1]


def test_ids_that_are_not_the_canonical_encoding_are_found(tool_family):
    name, tok, end, model_type = tool_family
    enc, prompt, turn1, delta, _, messages = _tool_episode(tok, end, model_type)
    # the model sampled "calculator" one character at a time: same text, other ids
    word = _ids(tok, "calculator")
    spelled = [i for ch in "calculator" for i in _ids(tok, ch)]
    assert spelled != word and tok.decode(spelled) == tok.decode(word)
    at = next(k for k in range(len(turn1)) if turn1[k : k + len(word)] == word)
    sampled = [*turn1[:at], *spelled, *turn1[at + len(word) :]]
    ids = [*prompt, *sampled, *delta]
    assert tok.decode(ids) == tok.decode([*prompt, *turn1, *delta])
    first_other = next(k for k, (a, b) in enumerate(zip(sampled, turn1, strict=False)) if a != b)
    assert first_other >= at
    assert rerender_mismatch(enc, messages, ids) == len(prompt) + first_other


@pytest.mark.parametrize("name", ["qwen3", "qwen3-moe"])
def test_a_template_that_drops_past_reasoning_is_a_mismatch(name):
    from transformers import AutoTokenizer

    path = build_family(name)
    tok = AutoTokenizer.from_pretrained(path)
    text = "<think>\n12*34 is hard; use the tool.\n</think>\n\n" + CALL["hermes"]
    enc, prompt, turn1, delta, _, messages = _tool_episode(
        tok, end_of_turn_ids(tok, str(path)), "qwen3", first_turn_text=text
    )
    ids = [*prompt, *turn1, *delta]
    # what was sampled stays: the reasoning is in the ids Tether trains on
    assert "12*34 is hard" in tok.decode(ids)
    # a full re-render drops it, from the first id of the turn's content on
    assert rerender_mismatch(enc, messages, ids) == len(prompt)
    full = render_ids(tok, messages, tools=TOOLS, add_generation_prompt=True)
    assert "12*34 is hard" not in tok.decode(full)


def test_environment_turns_for_every_family(family):
    name, tok, end, _ = family
    enc = TurnEncoder(tok, end_ids=end)
    prompt = render_ids(tok, QUESTION, tools=None, add_generation_prompt=True)
    answer = {"role": "assistant", "content": "I think it is 400."}
    # what a model sampling the canonical ids in this context would have written
    rendered = render_ids(tok, [*QUESTION, answer], tools=None, add_generation_prompt=False)
    assert rendered[: len(prompt)] == prompt
    end_at = next(i for i in range(len(prompt), len(rendered)) if rendered[i] in end)
    turn1 = rendered[len(prompt) : end_at + 1]
    reply = [{"role": "user", "content": "Not quite. Try again."}]
    delta = enc.env_turn(reply)
    ids = [*prompt, *turn1, *delta]
    messages = [*QUESTION, answer, *reply]
    assert ids == render_ids(tok, messages, tools=None, add_generation_prompt=True)
    assert rerender_mismatch(enc, messages, ids) == -1
    # a turn that stopped without its end-of-turn id gets it first, as an environment id
    assert enc.env_turn(reply, turn_closed=False) == [enc.end_token, *delta]


@pytest.mark.parametrize("name", ["gemma2", "phi3"])
def test_templates_without_tools_are_refused(name):
    from transformers import AutoTokenizer

    path = build_family(name)
    tok = AutoTokenizer.from_pretrained(path)
    with pytest.raises(TemplateDeltaError, match="ignores `tools`"):
        TurnEncoder(tok, end_ids=end_of_turn_ids(tok, str(path)), tools=TOOLS)
