"""Prompt loading: JSONL, Parquet, verl-style Parquet, directories, bad rows, overlong prompts."""

import json
import logging

import pyarrow as pa  # noqa: TID253 - writes the Parquet files it reads back
import pyarrow.parquet as pq  # noqa: TID253 - writes the Parquet files it reads back
import pytest

from common.data.datasets import DatasetError, load_prompts
from common.data.prompts import encode_prompt
from tether.demo.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def verl_table(n, start=0):
    """Rows shaped like verl's preprocessed GSM8K/MATH Parquet files."""
    return pa.Table.from_pylist(
        [
            {
                "data_source": "openai/gsm8k",
                "prompt": [
                    {"role": "system", "content": "Reason step by step."},
                    {"role": "user", "content": f"What is {i}+1?"},
                ],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
                "extra_info": {"split": "train", "index": i},
            }
            for i in range(start, start + n)
        ]
    )


def test_jsonl_with_tokens_and_metadata(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "a.jsonl",
        [{"prompt": f"q{i}", "answer": i, "level": i % 2} for i in range(5)],
    )
    ps = load_prompts(path, tokenizer=tokenizer, metadata_keys=["level"])
    assert len(ps) == 5 and ps.dropped == {}
    rec = ps[3]
    assert (rec.text, rec.ground_truth, rec.metadata, rec.row) == ("q3", "3", {"level": 1}, 3)
    assert rec.prompt_token_ids == encode_prompt(tokenizer, "q3")
    text = tokenizer.decode(rec.prompt_token_ids)
    assert text == "<|im_start|>user\nq3<|im_end|>\n<|im_start|>assistant\n"
    raw = load_prompts(path, tokenizer=tokenizer, apply_chat_template=False)
    assert tokenizer.decode(raw[3].prompt_token_ids) == "q3"


def test_plain_parquet_with_custom_columns(tmp_path):
    table = pa.table({"question": ["a?", "b?"], "solution": ["1", "2"], "src": ["x", "y"]})
    pq.write_table(table, tmp_path / "p.parquet")
    ps = load_prompts(
        tmp_path / "p.parquet", prompt_key="question", answer_key="solution", metadata_keys=["src"]
    )
    assert [(r.text, r.ground_truth, r.metadata["src"]) for r in ps] == [
        ("a?", "1", "x"),
        ("b?", "2", "y"),
    ]


@pytest.mark.parametrize("fmt", ["verl", "auto"])
def test_verl_parquet(tmp_path, tokenizer, fmt):
    pq.write_table(verl_table(4), tmp_path / "train.parquet")
    ps = load_prompts(
        tmp_path / "train.parquet",
        format=fmt,
        tokenizer=tokenizer,
        metadata_keys=["data_source", "extra_info.index"],
    )
    rec = ps[2]
    assert rec.messages[1] == {"role": "user", "content": "What is 2+1?"}
    assert rec.text is None and rec.ground_truth == "3"
    assert rec.metadata == {"data_source": "openai/gsm8k", "extra_info.index": 2}
    assert tokenizer.decode(rec.prompt_token_ids).startswith("<|im_start|>system\nReason")


def test_directory_split_selection_and_stable_ids(tmp_path):
    (tmp_path / "train").mkdir()
    pq.write_table(verl_table(3), tmp_path / "train" / "part-0.parquet")
    pq.write_table(verl_table(2, start=3), tmp_path / "train" / "part-1.parquet")
    pq.write_table(verl_table(2, start=100), tmp_path / "test.parquet")
    train = load_prompts(tmp_path, split="train")
    test = load_prompts(tmp_path, split="test")
    assert [r.ground_truth for r in train] == ["1", "2", "3", "4", "5"]
    assert [r.ground_truth for r in test] == ["101", "102"]
    ids = [r.prompt_id for r in train]
    assert len(set(ids)) == 5
    assert ids == [r.prompt_id for r in load_prompts(tmp_path, split="train")]
    with pytest.raises(DatasetError, match="no file for split 'validation'"):
        load_prompts(tmp_path, split="validation")


BAD_ROWS = [
    ({"answer": "1"}, "missing prompt column 'prompt'"),
    ({"prompt": "", "answer": "1"}, "empty prompt"),
    ({"prompt": 5, "answer": "1"}, "is a int"),
    ({"prompt": "ok"}, "missing answer column 'answer'"),
    ({"prompt": "ok", "answer": " "}, "empty answer in column 'answer'"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, "chat prompt must be"),
]


@pytest.mark.parametrize(("row", "why"), BAD_ROWS)
def test_bad_row_error_names_file_row_and_fix(tmp_path, row, why):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "fine", "answer": "0"}, row])
    with pytest.raises(DatasetError) as err:
        load_prompts(path)
    msg = str(err.value)
    assert str(path) in msg and "row 1" in msg and why in msg
    assert 'data.overlong_prompt_policy = "drop"' in msg


def test_bad_rows_dropped_counted_and_logged_once(tmp_path, caplog):
    rows = [{"prompt": "good", "answer": "0"}] + [r for r, _ in BAD_ROWS]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with path.open("a") as f:
        f.write("{not json\n")
    with caplog.at_level(logging.WARNING, logger="common.data.datasets"):
        ps = load_prompts(path, overlong_policy="drop")
    assert [r.text for r in ps] == ["good"]
    assert ps.dropped == {"bad_row": 7}
    warnings = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].getMessage().count(": row ") == 3  # up to 3 examples


def test_overlong_prompts_under_both_policies(tmp_path, tokenizer):
    rows = [{"prompt": "x" * n, "answer": "1"} for n in (5, 200, 10, 300)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    limit = len(encode_prompt(tokenizer, "x" * 50))
    with pytest.raises(DatasetError) as err:
        load_prompts(path, tokenizer=tokenizer, max_prompt_tokens=limit)
    msg = str(err.value)
    assert "row 1" in msg and "run.max_prompt_tokens" in msg
    assert 'data.overlong_prompt_policy = "drop"' in msg
    ps = load_prompts(path, tokenizer=tokenizer, max_prompt_tokens=limit, overlong_policy="drop")
    assert [len(r.text) for r in ps] == [5, 10]
    assert ps.dropped == {"overlong": 2}
    assert all(len(r.prompt_token_ids) <= limit for r in ps)


def test_order_is_a_deterministic_resumable_permutation(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": i} for i in range(50)])
    ps = load_prompts(path)
    a = ps.order(seed=1, epoch=0)
    assert sorted(a) == list(range(50))
    assert a == load_prompts(path).order(seed=1, epoch=0)
    assert a != ps.order(seed=1, epoch=1) and a != ps.order(seed=2, epoch=0)
    stream = ps.iter_from(seed=1)
    first = [next(stream) for _ in range(70)]  # crosses into epoch 1
    epoch, offset, _ = first[60]
    assert (epoch, offset) == (1, 10)
    resumed = ps.iter_from(seed=1, epoch=epoch, offset=offset)
    assert [next(resumed)[2].prompt_id for _ in range(10)] == [
        r.prompt_id for _, _, r in first[60:]
    ]


def test_config_mistakes_are_value_errors(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "answer": 1}])
    with pytest.raises(ValueError, match="needs a tokenizer"):
        load_prompts(path, max_prompt_tokens=10)
    with pytest.raises(ValueError, match="overlong_policy"):
        load_prompts(path, overlong_policy="skip")
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
