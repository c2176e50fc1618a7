"""Reward composition on top of a real GraderPool (real math-verify workers)."""

import pytest
from prometheus_client import CollectorRegistry

from services.scorer.grader_pool import GraderPool
from services.scorer.rewards import (
    Correctness,
    RewardScorer,
    RewardSpec,
    ScoreItem,
    load_custom_reward,
    overlong_penalty,
)


@pytest.fixture(scope="module")
def pool():
    with GraderPool(1, 5.0, registry=CollectorRegistry()) as pool:
        yield pool


def _item(response, ground_truth="1/2", tokens=None, **metadata):
    return ScoreItem(
        prompt="What is half?",
        response=response,
        ground_truth=ground_truth,
        response_tokens=tokens,
        metadata=metadata,
    )


def test_rule_rewards_and_reasons(pool):
    scorer = RewardScorer(RewardSpec(), pool=pool)
    items = [
        _item(r"It is \boxed{0.5}"),
        _item("The answer is 1/3."),
        _item(""),
        _item("I do not know."),
        _item(r"\boxed{0.5}", ground_truth=None),
        _item(b"\xff\xfe garbled \xc3( so the answer is \\frac{1}{2}"),
    ]
    scored = scorer.score_items(items)
    assert [(s.reward, s.reason) for s in scored] == [
        (1.0, "correct"),
        (0.0, "wrong"),
        (0.0, "empty"),
        (0.0, "no_answer"),
        (0.0, "bad_ground_truth"),
        (1.0, "correct"),
    ]
    assert scored[0].components == {"correct": 1.0} and scored[0].answer == "0.5"


def test_format_reward_and_weights(pool):
    spec = RewardSpec(correct_weight=2.0, format_weight=0.1)
    scored = RewardScorer(spec, pool=pool).score_group(
        prompt="q",
        responses=[r"\boxed{1/2}", "the answer is 0.5", r"\boxed{7}"],
        ground_truth=r"\frac{1}{2}",
    )
    assert [s.components for s in scored] == [
        {"correct": 2.0, "format": 0.1},
        {"correct": 2.0, "format": 0.0},
        {"correct": 0.0, "format": 0.1},
    ]
    assert [s.reward for s in scored] == pytest.approx([2.1, 2.0, 0.1])


def test_answer_form_number_scores_a_boxed_expression_zero_without_grading_it(pool):
    """math-verify evaluates the product the policy boxed and calls it equal to the gold: the
    reward hack of the SmolLM2 tools demo's first run; ``answer_form = "number"`` closes it."""
    responses = [r"\boxed{983*4099}", r"983*4099 = \boxed{4029317}", r"\boxed{4029318}", "no"]
    hacked = RewardScorer(RewardSpec(), pool=pool).score_group(
        prompt="What is 983*4099?", responses=responses, ground_truth="4029317"
    )
    assert [(s.reward, s.reason) for s in hacked][0] == (1.0, "correct")
    strict = RewardScorer(RewardSpec(answer_form="number"), pool=pool).score_group(
        prompt="What is 983*4099?", responses=responses, ground_truth="4029317"
    )
    assert [(s.reward, s.reason) for s in strict] == [
        (0.0, "not_a_number"),
        (1.0, "correct"),
        (0.0, "wrong"),
        (0.0, "no_answer"),
    ]
    assert strict[0].answer == "983*4099"  # kept for the logs
    # a gold that is not a plain number is left to math-verify
    (root,) = RewardScorer(RewardSpec(answer_form="number"), pool=pool).score_items(
        [_item(r"\boxed{2\sqrt{2}}", ground_truth=r"\sqrt{8}")]
    )
    assert (root.reward, root.reason) == (1.0, "correct")
    with pytest.raises(ValueError, match="answer_form 'numbers' unknown"):
        RewardSpec(answer_form="numbers")


def test_overlong_penalty_shape():
    kw = {"max_response_tokens": 100, "buffer_tokens": 20, "penalty": 1.0}
    assert overlong_penalty(0, **kw) == 0.0
    assert overlong_penalty(80, **kw) == 0.0
    assert overlong_penalty(90, **kw) == pytest.approx(-0.5)
    assert overlong_penalty(100, **kw) == pytest.approx(-1.0)
    assert overlong_penalty(5000, **kw) == -1.0


def test_overlong_penalty_in_scores(pool):
    spec = RewardSpec(overlong_penalty=0.5, overlong_buffer_tokens=10, max_response_tokens=50)
    scored = RewardScorer(spec, pool=pool).score_group(
        prompt="q", responses=[r"\boxed{0.5}"] * 3, ground_truth="1/2", response_tokens=[10, 45, 60]
    )
    assert [s.components["length_penalty"] for s in scored] == pytest.approx([0.0, -0.25, -0.5])
    assert [s.reward for s in scored] == pytest.approx([1.0, 0.75, 0.5])
    with pytest.raises(ValueError, match="response_tokens"):
        RewardScorer(spec, pool=pool).score_items([_item(r"\boxed{0.5}")])


def test_tool_error_penalty_is_a_named_term_per_episode(pool):
    spec = RewardSpec(tool_error_penalty=0.1)
    items = [
        ScoreItem(prompt="q", response=r"\boxed{0.5}", ground_truth="1/2", tool_errors=n)
        for n in (0, 1, 3)
    ]
    scored = RewardScorer(spec, pool=pool).score_items(items)
    assert [s.components for s in scored] == [
        {"correct": 1.0, "tool_errors": 0.0},
        {"correct": 1.0, "tool_errors": -0.1},
        {"correct": 1.0, "tool_errors": pytest.approx(-0.3)},
    ]
    assert [s.reward for s in scored] == pytest.approx([1.0, 0.9, 0.7])
    plain = RewardScorer(RewardSpec(), pool=pool).score_items(items)
    assert all(s.components == {"correct": 1.0} for s in plain)  # off by default


def test_custom_reward_loaded_by_dotted_path(pool):
    spec = RewardSpec(custom="tests.custom_reward_example:brevity_bonus", custom_weight=2.0)
    scored = RewardScorer(spec, pool=pool).score_items(
        [_item(r"\boxed{1/2}"), _item("x" * 100 + r" \boxed{1/2}"), _item("no", short_chars=1)]
    )
    assert [s.components for s in scored] == [
        {"correct": 1.0, "custom": 1.0},
        {"correct": 1.0, "custom": 0.0},
        {"correct": 0.0, "custom": 0.0},
    ]
    assert [s.reward for s in scored] == [2.0, 1.0, 0.0]


def test_custom_reward_returning_components(pool):
    spec = RewardSpec(custom="tests.custom_reward_example:two_parts")
    (scored,) = RewardScorer(spec, pool=pool).score_items([_item(r"What is half? \boxed{1/2}")])
    assert scored.components == {
        "correct": 1.0,
        "custom/has_prompt_echo": 1.0,
        "custom/constant": 0.25,
    }
    assert scored.reward == pytest.approx(2.25)


def test_custom_reward_failure_is_per_item(pool):
    scorer = RewardScorer(
        RewardSpec(custom="tests.custom_reward_example:fails_on_marker"), pool=pool
    )
    scored = scorer.score_items([_item(r"FAIL \boxed{1/2}"), _item(r"\boxed{1/2}")])
    assert [(s.reward, s.reason) for s in scored] == [
        (1.0, "correct;custom_error"),
        (2.0, "correct"),
    ]
    bad_type = RewardScorer(
        RewardSpec(custom="tests.custom_reward_example:returns_text"), pool=pool
    )
    with pytest.raises(ValueError, match="must return a float"):
        bad_type.score_items([_item(r"\boxed{1/2}")])


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("tests.custom_reward_example.brevity_bonus", "not a 'package.module:function' path"),
        ("tests.no_such_module:fn", "cannot import module"),
        ("tests.custom_reward_example:missing", "has no function"),
        ("tests.custom_reward_example:NOT_CALLABLE", "has no function"),
        ("tests.custom_reward_example:wrong_signature", "must accept keyword arguments"),
    ],
)
def test_custom_reward_path_errors(path, message):
    with pytest.raises(ValueError, match=message):
        load_custom_reward(path)


def test_compose_takes_correctness_from_another_mode(pool):
    """The solver mode supplies its own correctness (e.g. a mean over solver samples)."""
    scorer = RewardScorer(RewardSpec(format_weight=0.5), pool=pool)
    scored = scorer.compose(
        [_item(r"guideline \boxed{x}"), _item("guideline")],
        [Correctness(0.75, "correct"), Correctness(0.0, "timeout")],
    )
    assert [s.components for s in scored] == [
        {"correct": 0.75, "format": 0.5},
        {"correct": 0.0, "format": 0.0},
    ]
    assert [s.reason for s in scored] == ["correct", "timeout"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"overlong_penalty": 1.0}, "needs max_response_tokens"),
        ({"overlong_penalty": 1.0, "max_response_tokens": 10}, "overlong_buffer_tokens"),
        ({"overlong_penalty": -1.0}, "magnitude"),
        ({"correct_weight": float("nan")}, "finite"),
        ({"fallbacks": ("boxed", "regex")}, "unknown"),
    ],
)
def test_bad_reward_spec_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RewardSpec(**kwargs)
