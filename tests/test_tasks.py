"""The demo's synthetic arithmetic task: determinism, disjoint splits, correct answers."""

import json

import pytest

from common.tasks import (
    ArithmeticTask,
    extract_boxed,
    is_correct,
    make_problems,
    read_jsonl,
    write_task,
)


def test_same_seed_same_problems_other_seed_differs():
    task = ArithmeticTask(digits=2, operators="+-*", num_train=300, num_eval=50, seed=3)
    assert make_problems(task) == make_problems(task)
    other = make_problems(ArithmeticTask(digits=2, operators="+-*", num_train=300, num_eval=50))
    assert other != make_problems(task)


def test_splits_are_disjoint_and_sized():
    task = ArithmeticTask(digits=2, operators="+-", num_train=2000, num_eval=200, seed=1)
    train, held_out = make_problems(task)
    assert len(train) == 2000 and len(held_out) == 200
    assert len(set(train)) == 2000 and len(set(held_out)) == 200
    assert not set(train) & set(held_out)


def test_answers_and_solutions_are_correct(tmp_path):
    task = ArithmeticTask(digits=3, operators="+-*", num_train=500, num_eval=100, seed=7)
    paths = write_task(tmp_path, task)
    rows = read_jsonl(paths["train"]) + read_jsonl(paths["eval"])
    assert {r["split"] for r in rows} == {"train", "eval"}
    ops = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}
    for r in rows:
        m = r["metadata"]
        expected = ops[m["op"]](m["a"], m["b"])
        assert r["answer"] == str(expected)
        assert expected >= 0
        assert f"{m['a']}{m['op']}{m['b']}" in r["prompt"] and "\\boxed{}" in r["prompt"]
        assert r["solution"] == f"\\boxed{{{expected}}}"
        assert is_correct(r["solution"], r["answer"])
    assert {r["metadata"]["op"] for r in rows} == {"+", "-", "*"}


def test_files_are_reused_and_rewritten_when_params_change(tmp_path):
    task = ArithmeticTask(num_train=50, num_eval=10)
    paths = write_task(tmp_path, task)
    before = paths["train"].stat().st_mtime_ns
    assert write_task(tmp_path, task)["train"].stat().st_mtime_ns == before
    write_task(tmp_path, ArithmeticTask(num_train=60, num_eval=10))
    assert len(read_jsonl(paths["train"])) == 60
    assert json.loads((tmp_path / "task.json").read_text())["num_train"] == 60


def test_checker():
    assert extract_boxed("so \\boxed{12} then \\boxed{ 34 }") == "34"
    assert extract_boxed("no box") is None
    assert is_correct("\\boxed{0042}", "42")
    assert not is_correct("\\boxed{4 2}", "42")
    assert not is_correct("42", "42")


@pytest.mark.parametrize(
    "kwargs",
    [{"digits": 0}, {"operators": "/"}, {"operators": ""}, {"digits": 1, "num_train": 100}],
)
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        ArithmeticTask(**kwargs)


def test_warmup_sft_lowers_loss_saves_and_reuses(tmp_path):
    """The demo's supervised warm-up on this task (few steps: the full one takes minutes)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.tiny_model import build_tiny_model
    from common.warmup import warmup_sft

    base = build_tiny_model(tmp_path / "base", hidden_size=64, num_layers=1)
    paths = write_task(tmp_path / "data", ArithmeticTask(num_train=200, num_eval=20))
    kwargs = {"steps": 40, "lr": 3e-3, "batch_size": 8, "seed": 0, "out_dir": tmp_path / "warm"}
    report = warmup_sft(base, paths["train"], **kwargs)
    assert report["loss_last"] < 0.5 * report["loss_first"]
    assert not report["reused"]
    assert (tmp_path / "warm" / "model.safetensors").exists()
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "warm"))
    assert len(AutoTokenizer.from_pretrained(str(tmp_path / "warm"))) == 259
    assert warmup_sft(base, paths["train"], **kwargs)["reused"]
