"""Answer extraction edge cases (pure Python, no worker processes)."""

import time

import pytest

from services.scorer.extract import (
    Extraction,
    answer_form_ok,
    extract_answer,
    gate_answer_form,
    is_plain_number,
)

CASES = [
    (r"so the result is \boxed{\frac{1}{2}}.", r"\frac{1}{2}", "boxed"),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}", "boxed"),  # nested braces
    (r"first \boxed{1}, corrected: \boxed{2}", "2", "boxed"),  # the LAST box wins
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}", "boxed"),  # escaped braces do not close the box
    (r"\fbox{7}", "7", "boxed"),
    (r"$\boxed 5$", "5", "boxed"),
    (r"\boxed{3} and then a truncated \boxed{4", "3", "boxed"),  # unbalanced box skipped
    (r"\boxed{  } The answer is 8.", "8", "answer_is"),  # empty box is no answer
    ("The answer is 42.", "42", "answer_is"),
    ("Therefore, the final answer is: $\\frac{3}{4}$.", r"\frac{3}{4}", "answer_is"),
    ("**Answer:** 12", "12", "answer_is"),
    ("The answer is 3.5 meters\nbye", "3.5 meters", "answer_is"),
    ("I bought 3 apples and 4.5 pears", "4.5", "last_number"),
    ("in total 1,234,567 grains", "1,234,567", "last_number"),
    ("x = -3/4", "-3/4", "last_number"),
    ("nothing numeric here", None, "no_answer"),
    ("", None, "empty"),
    ("  \n\t ", None, "empty"),
    (None, None, "empty"),
    ("\x00\x01\x02", None, "empty"),  # control characters only
]


@pytest.mark.parametrize(("text", "answer", "method"), CASES)
def test_extract_answer(text, answer, method):
    assert extract_answer(text) == Extraction(answer, method)


def test_gsm8k_fallback_only_when_configured():
    text = "She has 5 + 7 = 12 left.\n#### 1,200"
    assert extract_answer(text, fallbacks=("gsm8k",)) == Extraction("1,200", "gsm8k")
    assert extract_answer(text, fallbacks=("boxed", "answer_is")) == Extraction(None, "no_answer")


def test_fallback_order_is_respected():
    text = r"The answer is 3. Later: \boxed{4}"
    assert extract_answer(text, fallbacks=("answer_is", "boxed")).answer.startswith("3")
    assert extract_answer(text).answer == "4"


def test_non_utf8_bytes_and_lone_surrogates_do_not_crash():
    assert extract_answer(b"\xff\xfe garbage \xc3( the answer is 5") == Extraction("5", "answer_is")
    result = extract_answer("\ud800\udfff \\boxed{9}")
    assert result == Extraction("9", "boxed")
    result.answer.encode("utf-8")  # must be encodable for the JSON pipe protocol


def test_unknown_fallback_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown answer-extraction fallback"):
        extract_answer("1", fallbacks=("boxed", "regex"))


def test_adversarial_text_stays_fast():
    start = time.perf_counter()
    assert extract_answer("\\boxed{" * 50_000).method == "no_answer"
    assert extract_answer("9" * 1_000_000 + " the answer is 7").answer == "7"
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize(
    "text",
    ["12", "-3", "+4", "1,234", "3.5", ".5", "7/8", "7 / 8", r"\frac{7}{8}", r"-\dfrac{1}{2}",
     "$12$", " 4029317 ", "12."],
)  # fmt: skip
def test_plain_numbers(text):
    assert is_plain_number(text)


@pytest.mark.parametrize(
    "text",
    ["3*4", r"983 \times 4099", "10-2", "2^3", "1+1", "(12)", "12 apples", "x", "", None,
     r"\frac{1+1}{2}", r"\sqrt{4}", "1,23"],
)  # fmt: skip
def test_expressions_and_words_are_not_plain_numbers(text):
    assert not is_plain_number(text)


def test_answer_form_number_rejects_an_expression_only_against_a_plain_number_gold():
    assert answer_form_ok("3*4", "12", "any")
    assert not answer_form_ok("3*4", "12", "number")
    assert answer_form_ok("12", "12", "number") and answer_form_ok(r"\frac{1}{2}", "0.5", "number")
    # a gold that is itself an expression leaves the judgement to math-verify
    assert answer_form_ok(r"2\sqrt{2}", r"\sqrt{8}", "number")
    # nothing extracted or no gold: the grader's own reasons (no_answer, bad_ground_truth)
    assert answer_form_ok(None, "12", "number") and answer_form_ok("3*4", None, "number")
    with pytest.raises(ValueError, match="scorer.answer_form 'numbers' unknown"):
        answer_form_ok("1", "1", "numbers")


def test_gate_answer_form_blanks_only_the_answers_of_the_wrong_form():
    pairs = [("3*4", "12"), ("12", "12"), (None, "12"), ("2+2", r"\sqrt{8}")]
    gated, kept = gate_answer_form(pairs, "number")
    assert kept == [False, True, True, True]
    assert gated == [(None, "12"), ("12", "12"), (None, "12"), ("2+2", r"\sqrt{8}")]
    assert gate_answer_form(pairs, "any") == (pairs, [True] * 4)
