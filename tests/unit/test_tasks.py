"""The demo's synthetic arithmetic task: determinism, disjoint splits, correct answers."""

import json
import re

import pytest

from common.data import staging
from tether.demo.run import PRESETS, prepare_assets
from tether.demo.tasks import (
    ONE_SHOT,
    ArithmeticTask,
    Problem,
    extract_boxed,
    is_correct,
    make_problems,
    read_jsonl,
    write_task,
)
from tether.demo.tiny_model import build_tiny_model
from tether.demo.warmup import warmup_sft


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


def test_scratchpad_solutions_are_column_additions_and_correct(tmp_path):
    assert Problem(39, "+", 85).scratchpad() == "9+5=14, 3+8+1=12, \\boxed{124}"
    assert Problem(8, "+", 6).scratchpad() == "8+6=14, \\boxed{14}"
    assert Problem(4, "+", 46).scratchpad() == "4+6=10, 0+4+1=5, \\boxed{50}"
    task = ArithmeticTask(num_train=400, num_eval=100, mixed_lengths=True,
                          solution_style="scratchpad", prompt_style="short")  # fmt: skip
    rows = read_jsonl(write_task(tmp_path, task)["train"]) + read_jsonl(tmp_path / "eval.jsonl")
    assert all(is_correct(r["solution"], r["answer"]) for r in rows)


def test_sloppy_teacher_drops_carries_in_train_only_at_the_set_rate(tmp_path):
    task = ArithmeticTask(num_train=2000, num_eval=200, solution_style="scratchpad",
                          teacher_carry_error=0.7)  # fmt: skip
    paths = write_task(tmp_path, task)
    train, held_out = read_jsonl(paths["train"]), read_jsonl(paths["eval"])
    assert all(is_correct(r["solution"], r["answer"]) for r in held_out)
    carry_step = re.compile(r"\d\+\d\+1=")  # a column that adds a carry
    carried = [r for r in train if carry_step.search(Problem(**r["metadata"]).scratchpad())]
    dropped = [r for r in carried if not is_correct(r["solution"], r["answer"])]
    assert 0.6 < len(dropped) / len(carried) < 0.8
    for r in dropped:  # the mistake is the carry and nothing else
        m = r["metadata"]
        assert (
            re.search(r"\d\+\d\+0=", r["solution"])
            and int(extract_boxed(r["solution"])) < m["a"] + m["b"]
        )
    no_carry = [r for r in train if r not in carried]
    assert all(is_correct(r["solution"], r["answer"]) for r in no_carry)
    assert (
        write_task(tmp_path / "again", task) and read_jsonl(tmp_path / "again/train.jsonl") == train
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"solution_style": "scratchpad", "operators": "+-"},
        {"teacher_carry_error": 0.5},
        {"solution_style": "scratchpad", "teacher_carry_error": 1.5},
        {"solution_style": "latex"},
    ],
)
def test_bad_solution_settings_are_refused(bad):
    with pytest.raises(ValueError):
        ArithmeticTask(**bad)


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


def test_the_instruct_style_asks_as_a_person_would_after_one_worked_exchange(tmp_path):
    task = ArithmeticTask(num_train=20, num_eval=5, operators="+-*", mixed_lengths=True,
                          prompt_style="instruct", one_shot=True)  # fmt: skip
    rows = read_jsonl(write_task(tmp_path / "chat", task)["eval"])
    for row in rows:
        *shot, user = row["prompt"]
        assert shot == list(ONE_SHOT) and "\\boxed{5}" in shot[1]["content"]
        m = row["metadata"]
        assert user == {"role": "user", "content": f"What is {m['a']} {m['op']} {m['b']}?"}
    plain = ArithmeticTask(num_train=20, num_eval=5, prompt_style="instruct")
    assert isinstance(read_jsonl(write_task(tmp_path / "plain", plain)["eval"])[0]["prompt"], str)


def test_the_real_model_demo_stages_its_model_and_has_no_warm_up(tmp_path, monkeypatch):
    """The smollm2 preset stages the named model into the assets (the staging itself runs on the
    real wheel in tests/services/test_gguf_staging.py) and writes chat prompts; no warm-up."""
    staged = []
    monkeypatch.setattr(staging, "stage_model",
                        lambda name, dest, **kw: staged.append((name, dest)) or True)  # fmt: skip
    made = prepare_assets(tmp_path, preset="smollm2", seed=3)
    assert (
        staged
        == [("smollm2-135m-instruct", tmp_path / "model")]
        == [(PRESETS["smollm2"]["model"]["stage"], made.model_dir)]
    )
    assert made.warmup_report == {"steps": 0} and made.seconds["warmup"] == 0.0
    rows = read_jsonl(made.data_dir / "eval.jsonl")
    assert len(rows) == PRESETS["smollm2"]["task"]["num_eval"]
    assert [turn["role"] for turn in rows[0]["prompt"]] == ["user", "assistant", "user"]
    assert json.loads((made.data_dir / "task.json").read_text())["seed"] == 3


def test_the_real_model_tools_demo_stages_its_model_and_asks_for_a_boxed_product(
    tmp_path, monkeypatch
):
    """The smollm2-tools preset: the staged model, the tools task's products asked without
    naming the tool (the base tool-call rate is the model's own), no teacher, no warm-up."""
    staged = []
    monkeypatch.setattr(staging, "stage_model",
                        lambda name, dest, **kw: staged.append((name, dest)) or True)  # fmt: skip
    made = prepare_assets(tmp_path, preset="smollm2-tools", seed=2)
    assert staged == [("smollm2-135m-instruct", made.model_dir)]
    assert made.warmup_report == {"steps": 0}
    rows = read_jsonl(made.data_dir / "eval.jsonl")
    assert len(rows) == PRESETS["smollm2-tools"]["tool_task"]["num_eval"]
    m = rows[0]["metadata"]
    assert rows[0]["prompt"] == f"What is {m['a']}*{m['b']}? Put the final answer in \\boxed{{}}."
    assert rows[0]["answer"] == str(m["a"] * m["b"]) and "calculator" not in rows[0]["prompt"]
    train = read_jsonl(made.data_dir / "train.jsonl")
    assert all(len(r["turns"]) == 1 for r in train)  # no teacher episode uses the tool
