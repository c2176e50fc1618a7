"""Tool episodes through the chat templates model authors publish (``fixtures/templates``).

For every published template with tools (``fixtures.published_templates.TEMPLATES``): whole
episodes with one call, two calls in a turn, and a malformed call, on the built-in agent loop
(``EpisodeRunner`` with the real tool sandbox) and on the agent endpoint's turn handler
(``AgentTurns``, the code behind ``/v1/chat/completions``). Token identity is checked against
what the engine sampled: every turn's prompt is the ids recorded so far, every sampled id is in
the trajectory as sampled. Templates without tools take environment turns and are refused for
tools. Failures of one episode (a template rule broken) end that episode alone, counted.

``TemplateEngine`` is a fake of vLLM's engine, named as one: it answers each turn with the text
the test wrote, encoded with the template's tokenizer and closed by the family's end-of-turn id.

``README_TABLE`` is the README's per-family table ("Multi-turn episodes and tools"); the last
test pins the README to it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from common.chat.rehearsal import rehearse
from common.chat.tool_calls import FORMATS, tool_format
from common.chat.tool_prompt import SystemTools, for_tools
from common.chat.turns import TemplateDeltaError, TurnEncoder, render_ids
from common.engine import Sample, SamplingSettings
from common.tools.registry import resolve_tools
from common.tools.sandbox import SandboxLimits, ToolSandbox
from fixtures.published_templates import TEMPLATES, TOOL_TEMPLATES, end_ids, tokenizer
from services.generator.agent.episodes import EpisodeTable
from services.generator.agent.openai_api import ApiError, Sampling
from services.generator.agent.tool_loop import EpisodeMetrics, EpisodeRunner, EpisodeSettings
from services.generator.agent.turns import AgentMetrics, AgentTurns, TurnLimits
from tests.fake_engine import FakeEngine

WITHOUT_TOOLS = tuple(n for n in TEMPLATES if n not in TOOL_TEMPLATES)
SPECS = resolve_tools(["calculator"])
TOOLS = [s.schema() for s in SPECS]
QUESTION = [{"role": "user", "content": "What is 12*34 and 5+6? Use the calculator."}]
ANSWER = "The answers are 408 and 11."


def _json(expr: str, key: str = "arguments") -> str:
    return f'{{"name": "calculator", "{key}": {{"expression": "{expr}"}}}}'


def _xml(expr: str) -> str:
    return (f"<tool_call>\n<function=calculator>\n<parameter=expression>\n{expr}\n</parameter>\n"
            "</function>\n</tool_call>")  # fmt: skip


# (one call, two calls in one turn, a malformed call), as each format's model writes them
CALLS = {
    "hermes": (f"<tool_call>\n{_json('12*34')}\n</tool_call>",
               f"<tool_call>\n{_json('12*34')}\n</tool_call>\n<tool_call>\n{_json('5+6')}\n"
               "</tool_call>",
               '<tool_call>\n{"name": "calculator", "arguments": {"expression": </tool_call>'),
    "llama3_json": (_json("12*34", "parameters"),
                    f"{_json('12*34', 'parameters')}; {_json('5+6', 'parameters')}",
                    '{"name": "calculator", "parameters": {"expression": '),
    "mistral": (f"[TOOL_CALLS][{_json('12*34')[:-1]}, \"id\": \"abcdefgh1\"}}]",
                f"[TOOL_CALLS][{_json('12*34')[:-1]}, \"id\": \"abcdefgh1\"}}, "
                f"{_json('5+6')[:-1]}, \"id\": \"abcdefgh2\"}}]",
                '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": '),
    "qwen3_xml": (_xml("12*34"), f"{_xml('12*34')}\n{_xml('5+6')}",
                  "<tool_call>\n<function=calculator>\n12*34\n</function>\n</tool_call>"),
    "phi4_mini": (f"<|tool_call|>{_json('12*34')}<|/tool_call|>",
                  f"<|tool_call|>{_json('12*34')}<|/tool_call|><|tool_call|>{_json('5+6')}"
                  "<|/tool_call|>",
                  '<|tool_call|>{"name": "calculator", "arguments": {<|/tool_call|>'),
}  # fmt: skip
KINDS = ("one", "two", "malformed")

# The README's table ("Multi-turn episodes and tools"), pinned by test_the_readme_table.
README_TABLE = {
    "Qwen2.5": ("hermes", "any number", "none"),
    "Qwen3 (hybrid thinking)": ("hermes", "any number",
                                "`<think>` kept after the last user turn, dropped before it"),
    "Qwen3-Coder": ("qwen3_xml", "any number", "none"),
    "Llama 3.1": ("llama3_json", "one", "none"),
    "Llama 3.2": ("llama3_json", "one", "none"),
    "Llama 3.3": ("llama3_json", "one", "none"),
    "Mistral Nemo": ("mistral", "any number", "none"),
    "Phi-4-mini": ("phi4_mini", "any number", "none"),
    "Gemma 2": ("no tools", "—", "none"),
    "Phi-3.5-mini": ("no tools", "—", "none"),
    "SmolLM2": ("no tools", "—", "none"),
}  # fmt: skip


class TemplateEngine(FakeEngine):
    """Request ``<episode>/...`` (built-in loop or endpoint) answers its episode's next scripted
    text, closed by the family's end-of-turn id ``end``; prompts and sampled ids kept."""

    def __init__(self, tok, script: dict[str, list[str]], end: int) -> None:
        super().__init__(tok, logprob=-0.5, version="4", eos=end)
        self.script = script
        self.prompts: dict[str, list[list[int]]] = {}
        self.sampled: dict[str, list[list[int]]] = {}

    def answer(self, ids: list[int], request_id: str) -> str:
        turns = self.prompts.setdefault(request_id.split("/")[0], [])
        turns.append(ids)
        return self.script[request_id.split("/")[0]][len(turns) - 1]

    async def generate_group(self, ids, params, request_id) -> list[Sample]:
        samples = await super().generate_group(ids, params, request_id)
        self.sampled.setdefault(request_id.split("/")[0], []).append(samples[0].token_ids)
        return samples


@pytest.fixture(scope="module", params=TOOL_TEMPLATES)
def family(request):
    name = request.param
    tok = tokenizer(name)
    return name, tok, end_ids(name, tok)


def _value(counter) -> float:
    return float(counter._value.get())


def _check_identity(rec, engine: TemplateEngine, episode: str) -> None:
    """Each turn's prompt is the ids so far; each sampled turn is in the ids as sampled."""
    starts = [s for role, s, _ in rec.turns if role == "assistant"]
    assert len(starts) == len(engine.prompts[episode])
    for k, start in enumerate(starts):
        assert engine.prompts[episode][k] == rec.prompt_ids + rec.ids[:start]
        sampled = engine.sampled[episode][k]
        assert rec.ids[start : start + len(sampled)] == sampled
        assert rec.mask[start : start + len(sampled)] == [1] * len(sampled)
    assert sum(rec.mask) == sum(len(s) for s in engine.sampled[episode])


def _run_loop(name, tok, end, scripts: dict[str, list[str]], check="strict", tool_format=None):
    fmt = FORMATS[tool_format or TEMPLATES[name].tool_format]

    async def go():
        async with ToolSandbox(SPECS, workers=2, limits=SandboxLimits()) as sandbox:
            enc = TurnEncoder(tok, end_ids=end, tools=TOOLS)
            engine = TemplateEngine(tok, scripts, enc.end_token)
            metrics = EpisodeMetrics()
            runner = EpisodeRunner(
                engine=engine, tokenizer=tok, encoder=enc, tool_format=fmt, sandbox=sandbox,
                metrics=metrics,
                settings=EpisodeSettings(max_turns=3, max_tokens=2000, tool_output_max_chars=200,
                                         template_check=check),
            )  # fmt: skip
            prompt = render_ids(tok, QUESTION, tools=TOOLS, add_generation_prompt=True)
            recs = await asyncio.gather(*(
                runner.run(prompt_ids=prompt, prompt_messages=QUESTION, request_id=e,
                           sampling=SamplingSettings(temperature=1.0, seed=1), version=4)
                for e in scripts
            ))  # fmt: skip
            return engine, dict(zip(scripts, recs, strict=True)), metrics

    return asyncio.run(go())


def test_tool_episodes_on_the_built_in_loop(family):
    name, tok, end = family
    fmt = TEMPLATES[name].tool_format
    one, two, bad = CALLS[fmt]
    scripts = {"one": [one, ANSWER], "two": [two, ANSWER], "malformed": [bad, ANSWER]}
    if name == "qwen3":  # reasoning first: kept in the ids, not searched for calls
        scripts["think"] = ["<think>\nUse the tool: <tool_call>{}</tool_call>\n</think>\n\n" + one,
                            ANSWER]  # fmt: skip
    extra = _value(EpisodeMetrics().tool_errors.labels("extra_call"))
    engine, recs, metrics = _run_loop(name, tok, end, scripts)
    for episode, rec in recs.items():
        _check_identity(rec, engine, episode)
        # strict keeps every one of these: no call here is shown to the model otherwise
        assert rec.finish_reason == "stop", (episode, rec.finish_reason, rec.error)
        assert rec.final_text == ANSWER
    ok = lambda e: [(c.name, c.ok, c.error) for c in recs[e].tool_calls]  # noqa: E731
    assert ok("one") == [("calculator", True, "")]
    assert "408" in tok.decode(recs["one"].ids)
    if TEMPLATES[name].one_call:  # the second call is answered with an error, not run
        assert ok("two") == [("calculator", True, ""), ("calculator", False, "extra_call")]
        assert _value(metrics.tool_errors.labels("extra_call")) == extra + 1
    else:
        assert ok("two") == [("calculator", True, ""), ("calculator", True, "")]
        assert "11" in tok.decode(recs["two"].ids)
    assert [c[1:] for c in ok("malformed")] == [(False, "malformed_call")]
    if "think" in recs:
        assert ok("think") == [("calculator", True, "")]
        assert recs["think"].messages[0]["reasoning_content"].startswith("Use the tool")


def test_a_broken_template_rule_ends_that_episode_alone():
    """Mistral's template wants 9-character call ids: a model that writes another id breaks the
    rule on the tool turn; that episode ends (episode_error, counted), the other one finishes."""
    tok = tokenizer("mistral-nemo")
    end = end_ids("mistral-nemo", tok)
    bad = CALLS["mistral"][0].replace("abcdefgh1", "abc")
    m = EpisodeMetrics()
    before = _value(m.errors.labels("template")), _value(m.episodes.labels("episode_error"))
    engine, recs, metrics = _run_loop("mistral-nemo", tok, end, {
        "bad": [bad, ANSWER], "good": [CALLS["mistral"][0], ANSWER]})  # fmt: skip
    assert recs["bad"].finish_reason == "episode_error"
    assert "length 9" in recs["bad"].error
    after = _value(m.errors.labels("template")), _value(m.episodes.labels("episode_error"))
    assert after == (before[0] + 1, before[1] + 1)
    assert recs["good"].finish_reason == "stop"
    t = recs["bad"].to_trajectory(sample_id="p/0", sample_index=0, timings={})
    assert t.failed and t.error  # recorded, never trained


def test_strict_refuses_a_rerender_that_drops_what_the_model_wrote():
    """Mistral's template drops the content written beside a call: a re-render would not show
    the model its own 'Sure.'; strict refuses that episode, warn keeps and counts it."""
    tok = tokenizer("mistral-nemo")
    end = end_ids("mistral-nemo", tok)
    chatty = "Sure." + CALLS["mistral"][0]
    for check, want in (("strict", "template_mismatch"), ("warn", "stop")):
        before = _value(EpisodeMetrics().mismatches.labels("content"))
        engine, recs, metrics = _run_loop("mistral-nemo", tok, end, {"e": [chatty, ANSWER]}, check)
        assert recs["e"].finish_reason == want and recs["e"].template_mismatch >= 0
        assert _value(metrics.mismatches.labels("content")) == before + 1
        _check_identity(recs["e"], engine, "e")


@pytest.mark.parametrize("name", WITHOUT_TOOLS)
def test_tool_episodes_through_the_system_message(name):
    """A template with no tool support (generator.tool_prompt = "system", auto's choice here):
    the tool list and the call syntax in the system message, calls written into the turns' text,
    results as user turns; whole episodes on the built-in loop, token-identical, under strict."""
    tok = for_tools(tokenizer(name), mode="auto", fmt=FORMATS["hermes"])
    assert isinstance(tok, SystemTools)
    end = end_ids(name, tok)
    one, two, bad = CALLS["hermes"]
    scripts = {"one": [one, ANSWER], "two": [two, ANSWER], "malformed": [bad, ANSWER]}
    engine, recs, _ = _run_loop(name, tok, end, scripts, tool_format="hermes")
    for episode, rec in recs.items():
        _check_identity(rec, engine, episode)
        assert rec.finish_reason == "stop", (episode, rec.finish_reason, rec.error)
        assert rec.final_text == ANSWER
    shown = tok.decode(engine.prompts["one"][0])
    assert '"name": "calculator"' in shown and "<tool_call>" in shown
    assert [(c.name, c.ok) for c in recs["two"].tool_calls] == [("calculator", True)] * 2
    text = tok.decode(recs["two"].ids)
    assert "<tool_response>\n408\n</tool_response>\n<tool_response>\n11\n</tool_response>" in text
    assert [c.error for c in recs["malformed"].tool_calls] == ["malformed_call"]
    # and through the endpoint: an OpenAI client's tool_calls come back as the model wrote them
    engine, ep, replies = _endpoint_episode(name, tok, end, "one", tool_format="hermes")
    (seg,) = ep.segments
    _check_identity(seg.rec, engine, "p")
    assert replies[-1]["choices"][0]["message"]["content"] == ANSWER


# ----------------------------------------------------------------------------- the endpoint


def _turns(tok, end, fmt, script):
    engine = TemplateEngine(tok, {"p": script}, tok.eos_token_id)  # end: set by the caller
    lim = TurnLimits(max_requests=8, max_tokens_per_request=400, max_response_tokens=2000,
                     max_model_len=4000, max_messages=16)  # fmt: skip
    return engine, AgentTurns(engine=engine, tokenizer=tok, tool_format=FORMATS[fmt],
                              end_ids=end, limits=lim, version=lambda: 4, metrics=AgentMetrics())  # fmt: skip


def _endpoint_episode(name, tok, end, kind, *, tool_format=None, **extra):
    fmt = tool_format or TEMPLATES[name].tool_format
    enc = TurnEncoder(tok, end_ids=end, tools=TOOLS)
    script = [CALLS[fmt][KINDS.index(kind)], ANSWER]
    engine, turns = _turns(tok, end, fmt, script)
    engine.eos = enc.end_token
    prompt = render_ids(tok, QUESTION, tools=TOOLS, add_generation_prompt=True)
    ep = EpisodeTable().start(sampling=Sampling(temperature=1.0, top_p=1.0, top_k=0),
                              prompt_ids=prompt, prompt_messages=QUESTION, request_prefix="p/s0",
                              version_at_start=4)  # fmt: skip

    async def agent():
        body = {"messages": QUESTION, "tools": TOOLS, **extra}
        r = await turns.chat(ep, body)
        msg = r["choices"][0]["message"]
        calls = msg.get("tool_calls") or []
        if not calls:
            return [r]
        results = [{"role": "tool", "tool_call_id": c["id"], "content": "408"} for c in calls]
        r2 = await turns.chat(ep, {**body, "messages": [*QUESTION, msg, *results]})
        return [r, r2]

    replies = asyncio.run(agent())
    return engine, ep, replies


@pytest.mark.parametrize("kind", KINDS)
def test_tool_episodes_on_the_endpoint(family, kind):
    name, tok, end = family
    engine, ep, replies = _endpoint_episode(name, tok, end, kind)
    (seg,) = ep.segments  # every request extended the recorded ids: one segment
    _check_identity(seg.rec, engine, "p")
    calls = replies[0]["choices"][0]["message"].get("tool_calls") or []
    if kind == "malformed":  # shown as the model wrote it, no call: the agent answers
        assert calls == [] and len(replies) == 1
    else:
        want = 1 if kind == "one" or TEMPLATES[name].one_call else 2
        assert [c["function"]["name"] for c in calls] == ["calculator"] * want
        assert replies[-1]["choices"][0]["message"]["content"] == ANSWER


def test_the_endpoint_honours_parallel_tool_calls(family):
    name, tok, end = family
    if TEMPLATES[name].one_call:
        with pytest.raises(ApiError, match="allows one tool call per turn") as err:
            _endpoint_episode(name, tok, end, "two", parallel_tool_calls=True)
        assert err.value.status == 400
    _, _, replies = _endpoint_episode(name, tok, end, "two", parallel_tool_calls=False)
    assert len(replies[0]["choices"][0]["message"]["tool_calls"]) == 1


def test_the_endpoint_returns_reasoning_apart():
    tok = tokenizer("qwen3")
    end = end_ids("qwen3", tok)
    engine, turns = _turns(tok, end, "hermes", ["<think>\nadd them\n</think>\n\n42"])
    ep = EpisodeTable().start(sampling=Sampling(temperature=1.0, top_p=1.0, top_k=0),
                              prompt_ids=[], prompt_messages=QUESTION, request_prefix="p/s0",
                              version_at_start=4)  # fmt: skip
    r = asyncio.run(turns.chat(ep, {"messages": QUESTION, "tools": TOOLS}))
    msg = r["choices"][0]["message"]
    assert (msg["content"], msg["reasoning_content"]) == ("42", "add them")


def test_a_template_refusing_the_agents_messages_is_a_400():
    tok = tokenizer("mistral-nemo")
    end = end_ids("mistral-nemo", tok)
    engine, turns = _turns(tok, end, "mistral", [CALLS["mistral"][0], ANSWER])
    engine.eos = tok.eos_token_id
    prompt = render_ids(tok, QUESTION, tools=TOOLS, add_generation_prompt=True)
    ep = EpisodeTable().start(sampling=Sampling(temperature=1.0, top_p=1.0, top_k=0),
                              prompt_ids=prompt, prompt_messages=QUESTION, request_prefix="p/s0",
                              version_at_start=4)  # fmt: skip

    async def agent():
        r = await turns.chat(ep, {"messages": QUESTION, "tools": TOOLS})
        msg = r["choices"][0]["message"]
        bad = [{"role": "tool", "tool_call_id": "short", "content": "408"}]
        return await turns.chat(ep, {"messages": [*QUESTION, msg, *bad], "tools": TOOLS})

    with pytest.raises(ApiError, match="length 9") as err:
        asyncio.run(agent())
    assert (err.value.status, err.value.code) == (400, "template")


# ----------------------------------------------------------------------------- start-up


@pytest.mark.parametrize("name", TOOL_TEMPLATES)
def test_preflight_rehearses_one_and_two_calls(name):
    tok = tokenizer(name)
    p = TEMPLATES[name]
    fmt = tool_format("auto", model_type=p.model_type, vocab=tok.get_vocab())
    if name != "qwen3-coder":  # auto never picks qwen3_xml (its model_type is Qwen3-MoE's)
        assert fmt.name == p.tool_format
    enc = TurnEncoder(tok, end_ids=end_ids(name, tok), tools=TOOLS)
    rehearse(tok, enc, FORMATS[p.tool_format])
    wrong = "hermes" if p.tool_format != "hermes" else "llama3_json"
    with pytest.raises(TemplateDeltaError, match=f"generator.tool_format = '{wrong}' parses"):
        rehearse(tok, enc, FORMATS[wrong])


@pytest.mark.parametrize("name", WITHOUT_TOOLS)
def test_templates_without_tools_take_environment_turns_and_refuse_tools(name):
    tok = tokenizer(name)
    end = end_ids(name, tok)
    enc = TurnEncoder(tok, end_ids=end)
    answer = {"role": "assistant", "content": "It is 400."}
    reply = [{"role": "user", "content": "Not quite. Try again."}]
    prompt = render_ids(tok, QUESTION, tools=None, add_generation_prompt=True)
    full = render_ids(tok, [*QUESTION, answer], tools=None, add_generation_prompt=False)
    turn = full[len(prompt) : next(i for i in range(len(prompt), len(full)) if full[i] in end) + 1]
    ids = [*prompt, *turn, *enc.env_turn(reply)]
    assert ids == render_ids(tok, [*QUESTION, answer, *reply], tools=None,
                             add_generation_prompt=True)  # fmt: skip
    with pytest.raises(TemplateDeltaError, match="ignores `tools`"):
        TurnEncoder(tok, end_ids=end, tools=TOOLS)


def test_qwen3_templates_rewrite_of_the_past_gives_exact_ids():
    """Qwen3's template writes an empty <think> block into the last assistant turn only: the old
    prefix comparison refused every tool turn; counting end-of-turn ids gives the template's own
    ids for the new turn."""
    tok = tokenizer("qwen3")
    enc = TurnEncoder(tok, end_ids=end_ids("qwen3", tok), tools=TOOLS)
    turn = {"role": "assistant", "content": "<think>\nok\n</think>\n\nI will call it."}
    result = [{"role": "tool", "name": "calculator", "content": "408"}]
    before = render_ids(tok, [*QUESTION, turn], tools=TOOLS, add_generation_prompt=False)
    after = render_ids(tok, [*QUESTION, turn, *result], tools=TOOLS, add_generation_prompt=True)
    cut = max(i for i, t in enumerate(before) if t in enc.end_ids) + 1  # the turn's end id
    assert after[:cut] == before[:cut]  # here the turn is kept: it follows the last user turn
    assert after[cut:] == enc.env_turn(result)


def test_the_readme_table():
    """The README's table is this module's: formats, calls per turn and reasoning per family."""
    for p in TEMPLATES.values():
        fmt = p.tool_format or "no tools"
        calls = "—" if not p.tool_format else ("one" if p.one_call else "any number")
        assert README_TABLE[p.title][:2] == (fmt, calls), p.title
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for title, (fmt, calls, reasoning) in README_TABLE.items():
        assert f"| {title} | {fmt} | {calls} | {reasoning} |" in readme, title
