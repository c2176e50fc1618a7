"""Tool calls parsed in each family's own format; families without one refused by name."""

from __future__ import annotations

import re

import pytest

from common.chat.tool_calls import FORMATS, ToolFormatError, tool_format

HERMES = FORMATS["hermes"]
LLAMA = FORMATS["llama3_json"]


def test_hermes_calls_and_content():
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    )
    turn = HERMES.parse(text)
    assert turn.content == "Let me compute."
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [
        ("calculator", {"expression": "12*34"}, ""),
        ("python", {"code": "print(1)"}, ""),  # arguments given as a JSON string
    ]
    assert turn.message()["tool_calls"][0] == {
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": "12*34"}},
    }


def test_hermes_final_answer_has_no_calls():
    turn = HERMES.parse("The answer is \\boxed{408}.")
    assert turn.calls == [] and turn.content == "The answer is \\boxed{408}."
    assert "tool_calls" not in turn.message()


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('x <tool_call>{"name": "f", "arguments": {}}', "not closed"),
    ],
)
def test_hermes_malformed_calls_are_kept_with_an_error(text, words):
    turn = HERMES.parse(text)
    assert len(turn.calls) == 1 and words in turn.calls[0].error
    assert "tool_calls" not in turn.message()  # a broken call is answered, not replayed


def test_llama3_json_calls():
    turn = LLAMA.parse('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2;3"}}')
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": "2;3"})]
    two = LLAMA.parse('{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}')
    assert [(c.name, c.arguments) for c in two.calls] == [("a", {}), ("b", {"x": 1})]
    assert LLAMA.parse("It is 42.").calls == []
    assert "not valid JSON" in LLAMA.parse('{"name": "a", ').calls[0].error


@pytest.mark.parametrize(
    ("model_type", "vocab", "want"),
    [("qwen2", (), "hermes"), ("qwen3", (), "hermes"), ("qwen3_moe", (), "hermes"),
     ("llama", ("<|eot_id|>",), "llama3_json"), ("mistral", ("[TOOL_CALLS]",), "mistral"),
     ("phi3", ("<|tool_call|>",), "phi4_mini")],
)  # fmt: skip
def test_auto_picks_the_family_format(model_type, vocab, want):
    assert tool_format("auto", model_type=model_type, vocab=vocab).name == want


@pytest.mark.parametrize(
    ("model_type", "words"),
    [("gemma2", "Gemma 2 models (gemma2) have no tool-call format"),
     ("phi3", "Phi-3 and Phi-3.5 models (phi3) have no tool-call format"),
     ("llama", "Llama 2, SmolLM2 and other llama-type models (llama) have no tool-call"),
     ("mamba", "set generator.tool_format")],
)  # fmt: skip
def test_families_without_a_tool_format_are_refused(model_type, words):
    with pytest.raises(ToolFormatError, match=re.escape(words)):
        tool_format("auto", model_type=model_type)


def test_an_explicit_format_overrides_and_a_wrong_one_is_refused():
    assert tool_format("hermes", model_type="gemma2").name == "hermes"
    with pytest.raises(ToolFormatError, match="generator.tool_format = 'xml'"):
        tool_format("xml", model_type="qwen2")


def test_a_call_inside_think_is_reasoning_not_a_call():
    hermes = FORMATS["hermes"]
    text = ('<think>\nmaybe <tool_call>{"name": "python", "arguments": {}}</tool_call>\n</think>'
            '\n\nThe answer is 4.')  # fmt: skip
    turn = hermes.parse(text)
    assert turn.calls == [] and turn.content == "The answer is 4."
    assert "maybe" in turn.reasoning and turn.message()["reasoning_content"] == turn.reasoning
    # the template opened <think> in the prompt: everything before </think> is reasoning
    turn = hermes.parse('x <tool_call>{"name": "a", "arguments": {}}</tool_call></think>\n\nok')
    assert turn.calls == [] and turn.content == "ok"
    # opened and never closed: all of it is reasoning, nothing runs
    turn = hermes.parse('<think>\n<tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert turn.calls == [] and turn.content == ""


def test_mistral_calls_keep_their_ids():
    fmt = FORMATS["mistral"]
    turn = fmt.parse('Sure.[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "1+1"}'
                     ', "id": "abcdefghi"}, {"name": "python", "arguments": {"code": "1"}}]')  # fmt: skip
    assert turn.content == "Sure."
    assert [(c.name, c.id) for c in turn.calls] == [("calculator", "abcdefghi"), ("python", "")]
    assert turn.message()["tool_calls"][0]["id"] == "abcdefghi"
    assert "not valid JSON" in fmt.parse("[TOOL_CALLS][{").calls[0].error
    assert fmt.parse("It is 2.").calls == []


def test_qwen3_xml_calls():
    fmt = FORMATS["qwen3_xml"]
    text = (
        "Let me run it.\n<tool_call>\n<function=python>\n<parameter=code>\nprint(1)\n"
        "print(2)\n</parameter>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>"
    )
    turn = fmt.parse(text)
    assert turn.content == "Let me run it."
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("python", {"code": "print(1)\nprint(2)", "n": 5})
    ]
    assert "<function=NAME>" in fmt.parse("<tool_call>\n{}\n</tool_call>").calls[0].error


def test_phi4_mini_calls():
    fmt = FORMATS["phi4_mini"]
    turn = fmt.parse('<|tool_call|>{"name": "calculator", "arguments": {"expression": "2"}}'
                     "<|/tool_call|>")  # fmt: skip
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": "2"})]


def test_llama3_allows_one_call_per_turn():
    assert FORMATS["llama3_json"].max_calls == 1
    assert FORMATS["hermes"].max_calls is None
    two = FORMATS["llama3_json"].parse('{"name": "a", "parameters": {}}; {"name": "b", '
                                       '"parameters": {}}')  # fmt: skip
    assert [c["function"]["name"] for c in two.message(max_calls=1)["tool_calls"]] == ["a"]


def test_an_unknown_format_is_refused_with_the_list():
    with pytest.raises(ToolFormatError, match="hermes, llama3_json, mistral, qwen3_xml, phi4_mini"):
        tool_format("pythonic", model_type="gemma3_text")


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_reads_back_the_calls_it_writes(name):
    """``write`` is what ``parse`` reads: the system-message tool prompt's example call and the
    past calls it writes into a turn's text are in the format the parser takes."""
    fmt = FORMATS[name]
    calls = [{"name": "calculator", "arguments": {"expression": "12*34"}},
             {"name": "lookup", "arguments": {"key": "a b", "n": 3, "deep": {"x": [1, 2]}}}]  # fmt: skip
    parsed = fmt.parse(fmt.write(calls))
    assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [
        (c["name"], c["arguments"], "") for c in calls
    ]
    assert parsed.content == ""
