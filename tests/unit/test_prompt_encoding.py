"""One prompt encoding: the ids the loader counts at load time (and the learner trains on, as the
generator reports them) are the ids the generator sends to vLLM, for string and chat-list
prompts, with and without the chat template, for a tokenizer without BOS (Qwen-like) and one
that adds BOS (Llama-like). And BOS follows the tokenizer: once for raw text, never doubled."""

from __future__ import annotations

import json

import pytest

from common.config.load import load_config
from common.data.datasets import DatasetError, load_prompts
from common.data.prompts import encode_prompt
from common.protocol import wire
from services.learner.dispatch import Dispatcher
from services.scorer.solver import Solver, SolverSettings
from tests.engine_support import generator_without_engine
from tests.learner_support import learner_settings_without_model
from tether.demo.tiny_model import BOS_TOKEN, build_tokenizer


@pytest.fixture(scope="module", params=["no_bos", "bos"])
def tokenizer(request, tmp_path_factory):
    from transformers import AutoTokenizer  # loaded as every service loads it

    out = tmp_path_factory.mktemp(request.param)
    build_tokenizer(out, bos=request.param == "bos")
    return AutoTokenizer.from_pretrained(str(out))


STRINGS = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(5)]
CHATS = [
    {
        "prompt": [
            {"role": "system", "content": "Reason step by step."},
            {"role": "user", "content": f"What is {i}*3?"},
        ],
        "answer": str(3 * i),
    }
    for i in range(5)
]


def generator_ids(tokenizer, apply_chat_template: bool, records) -> list:
    """What the generator sends to vLLM for each record: the learner's dispatcher builds the
    PromptMsg, it crosses the wire, the generator service encodes it (or refuses: None)."""
    cfg = load_config(overrides=[f"data.apply_chat_template={str(apply_chat_template).lower()}"],
                      env={}).config  # fmt: skip
    svc = generator_without_engine(cfg, "gen-test")  # no I/O
    svc.tokenizer = tokenizer  # what _start_engine loads from the model directory
    dispatcher = Dispatcher(
        learner_settings_without_model(cfg), bus=None, train=records, eval_set=None
    )  # type: ignore[arg-type]
    out = []
    for i, rec in enumerate(records):
        msg = dispatcher._prompt(rec, prompt_id=f"p{i}", cycle=0, index=i, split="train",
                                 min_version=0)  # fmt: skip
        received = wire.decode(wire.encode(msg))
        try:
            out.append(svc._prompt_ids(received))
        except ValueError:
            out.append(None)
    return out


@pytest.mark.parametrize("rows", [STRINGS, CHATS], ids=["string", "chat"])
@pytest.mark.parametrize("template", [True, False], ids=["template", "raw"])
def test_loader_and_generator_encode_every_prompt_alike(tmp_path, tokenizer, rows, template):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = load_prompts(path)  # what the dispatcher sends does not depend on the tokenizer
    sent = generator_ids(tokenizer, template, plain)
    if rows is CHATS and not template:
        with pytest.raises(DatasetError, match="apply_chat_template is false"):
            load_prompts(path, tokenizer=tokenizer, apply_chat_template=False)
        assert sent == [None] * len(rows)  # refused alike (the generator dead-letters it)
        return
    loaded = load_prompts(path, tokenizer=tokenizer, apply_chat_template=template)
    assert [r.prompt_token_ids for r in loaded] == sent
    assert all(ids for ids in sent)


def test_raw_text_gets_the_tokenizers_bos_once(tokenizer):
    ids = encode_prompt(tokenizer, "What is 2+2?", apply_chat_template=False)
    bare = tokenizer("What is 2+2?", add_special_tokens=False).input_ids
    if tokenizer.bos_token is None:
        assert ids == bare  # nothing to add: Qwen-like tokenizers keep the text as it is
    else:
        assert tokenizer.bos_token == BOS_TOKEN
        assert ids == [tokenizer.bos_token_id, *bare]


def test_chat_template_bos_is_not_doubled(tokenizer):
    ids = encode_prompt(tokenizer, [{"role": "user", "content": "hi"}], apply_chat_template=True)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(ids) == text  # exactly the template's text, no token added
    if tokenizer.bos_token is not None:
        assert text.startswith(BOS_TOKEN)  # the template writes BOS itself
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
        # encoding the template's text with special tokens, as raw text is, would double it
        assert tokenizer(text).input_ids[:2] == [tokenizer.bos_token_id] * 2


@pytest.mark.parametrize("template", [True, False], ids=["template", "raw"])
def test_solver_prompt_uses_the_same_encoding(tokenizer, template):
    settings = SolverSettings(model="unused", template="Q: {question}\nG: {response}",
                              apply_chat_template=template)  # fmt: skip
    solver = Solver(settings, pool=None)
    solver.tokenizer = tokenizer  # what Solver.start loads from the solver's directory
    ids = solver.prompt_ids("Count the cats.", "so 7")
    assert ids == encode_prompt(
        tokenizer, "Q: Count the cats.\nG: so 7", apply_chat_template=template
    )
    if tokenizer.bos_token is not None:  # BOS once, raw or templated
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
