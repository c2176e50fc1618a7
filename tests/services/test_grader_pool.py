"""GraderPool: real math-verify in real worker processes, real SIGKILLs."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from services.scorer.grader_pool import GraderPool
from tests.waiting import wait_until

# A real pathological input: sympy tries to evaluate a power tower and never returns.
HANGING_ANSWER = "9^{9^{9^{9}}}"


def _metric(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def registry():
    return CollectorRegistry()


# The answer-checking tests grade with a timeout no loaded machine reaches (sympy simplifying
# x^2+1 against (x+1)^2 took over 2 s at load 30 and read as "timeout"); only the cut-off test
# uses a short one, on its own pool.
@pytest.fixture(scope="module")
def pool(registry):
    with GraderPool(2, 60.0, registry=registry) as pool:
        pool.wait_ready(60)
        yield pool


CUT_OFF_S = 2.0


@pytest.fixture(scope="module")
def cutting_registry():
    return CollectorRegistry()


@pytest.fixture(scope="module")
def cutting_pool(cutting_registry):
    with GraderPool(2, CUT_OFF_S, registry=cutting_registry) as pool:
        pool.wait_ready(60)
        yield pool


EQUIVALENT = [
    ("0.5", "1/2"),
    ("1/2", "0.5"),
    (r"\frac{1}{2}", "0.5"),
    (r"\dfrac{1}{2}", r"\frac12"),
    ("0.25", r"\frac{1}{4}"),
    ("3.50", "3.5"),
    ("-3", "-3"),
    (r"-\frac{3}{4}", "-0.75"),
    ("1,000,000", "1000000"),
    ("1000000", "1,000,000"),
    ("12,345,678,901", "12345678901"),
    ("[1, 2)", "[1,2)"),
    (r"(-\infty, 3]", r"(-\infty,3]"),
    (r"\{3, 1, 2\}", r"\{1,2,3\}"),
    (r"50\%", "50"),
    (r"50\%", "0.5"),
    (r"5\text{ cm}", "5"),
    (r"5 \mathrm{cm}", "5"),
    (r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}"),
    ("x^2+2x+1", "(x+1)^2"),
    (r"\pi", "3.14159265"),
]

WRONG = [
    ("0.51", "1/2"),
    ("3", "-3"),
    (r"\frac{1}{3}", "0.5"),
    ("(1, 2]", "[1,2)"),
    (r"\{1, 2\}", r"\{1,2,3\}"),
    ("1000001", "1,000,000"),
    ("x^2+1", "(x+1)^2"),
]


def test_equivalent_answers_are_correct(pool):
    results = pool.grade_many(EQUIVALENT)
    failed = [
        (pair, r.reason) for pair, r in zip(EQUIVALENT, results, strict=True) if not r.correct
    ]
    assert failed == []
    assert all(r.reason == "correct" and r.seconds >= 0 for r in results)


def test_wrong_answers_are_wrong(pool):
    results = pool.grade_many(WRONG)
    assert [(pair, r.correct, r.reason) for pair, r in zip(WRONG, results, strict=True)] == [
        (pair, False, "wrong") for pair in WRONG
    ]


def test_missing_answers_and_bad_ground_truth(pool, registry):
    before = _metric(registry, "tether_scorer_grade_errors_total", reason="bad_ground_truth")
    items = [("1", None), ("1", ""), ("1", "   "), ("1", r"\frac{"), ("1", "???")]
    items += [(None, "1"), ("", "1"), ("}{", "1")]
    reasons = [r.reason for r in pool.grade_many(items)]
    assert reasons == ["bad_ground_truth"] * 5 + ["no_answer", "no_answer", "unparseable_answer"]
    after = _metric(registry, "tether_scorer_grade_errors_total", reason="bad_ground_truth")
    assert after - before == 5


def test_hanging_input_is_cut_off_and_other_items_keep_flowing(cutting_pool, cutting_registry):
    pool, registry = cutting_pool, cutting_registry
    pids_before = set(pool.worker_pids())
    timeouts_before = _metric(registry, "tether_scorer_grade_timeouts_total")
    normal = [(rf"\frac{{{i}}}{{4}}", str(i / 4)) for i in range(40)]
    start = time.monotonic()
    results = pool.grade_many([(HANGING_ANSWER, "7")] + normal)
    elapsed = time.monotonic() - start
    assert results[0].reason == "timeout" and not results[0].correct
    # Cut off at the timeout (the margin is for a loaded machine's scheduling, not the grading).
    assert CUT_OFF_S <= results[0].seconds < CUT_OFF_S + 5.0
    assert [r.reason for r in results[1:]] == ["correct"] * len(normal)
    # The other worker kept grading while one was stuck: the batch took about one timeout, not
    # one per item (41 x 2 s).
    assert elapsed < CUT_OFF_S + 10.0
    assert _metric(registry, "tether_scorer_grade_timeouts_total") - timeouts_before == 1
    pids_after = set(pool.worker_pids())
    assert len(pids_after) == 2 and len(pids_before & pids_after) == 1  # one worker replaced
    assert [r.reason for r in pool.grade_many([("2", "2"), ("3", "2")])] == ["correct", "wrong"]


def _dead(pid: int) -> bool:
    """``pid`` has exited: a zombie its parent has not reaped yet, or gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between the
        return True  # open and the read (ESRCH: a fresh-clone run met it once)


def test_worker_sigkilled_from_outside_gives_error_and_pool_recovers():
    registry = CollectorRegistry()
    with GraderPool(1, 20.0, registry=registry, test_only_sleep_hook=True) as pool:
        pool.wait_ready(60)
        (victim,) = pool.worker_pids()
        killer = threading.Timer(0.5, os.kill, args=(victim, signal.SIGKILL))
        killer.start()
        results = pool.grade_many([("__tether_test_only_sleep__:30", "1"), ("1/2", "0.5")])
        killer.join()
        assert [r.reason for r in results] == ["error", "correct"]
        assert results[0].seconds < 5.0  # noticed at once, not at the 20 s timeout
        assert pool.worker_pids() != [victim]
        assert _metric(registry, "tether_scorer_grade_errors_total", reason="worker_crash") == 1
        assert _metric(registry, "tether_scorer_grade_worker_restarts_total", cause="crash") == 1
        # A worker that dies while idle is replaced before it is given an item: nothing is lost.
        (idle,) = pool.worker_pids()
        os.kill(idle, signal.SIGKILL)
        wait_until(lambda: _dead(idle), timeout_s=10, what=f"worker {idle} to die")
        assert [r.reason for r in pool.grade_many([("2", "2")])] == ["correct"]
        assert pool.worker_pids() != [idle]


def test_test_only_sleep_hook_is_off_by_default(pool):
    (result,) = pool.grade_many([("__tether_test_only_sleep__:30", "1")])
    assert result.reason == "unparseable_answer" and result.seconds < 2.0


def test_close_stops_workers_and_rejects_new_work():
    pool = GraderPool(1, 5.0, registry=CollectorRegistry())
    pids = pool.worker_pids()
    pool.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="after close"):
        pool.grade_many([("1", "1")])


def test_workers_that_cannot_grade_fail_loudly_instead_of_crash_looping():
    # 8 MiB of address space is far too little for sympy: the warm-up check fails every time.
    pool = GraderPool(1, 5.0, registry=CollectorRegistry(), memory_limit_bytes=8 * 2**20)
    try:
        with pytest.raises(RuntimeError, match="died before becoming ready"):
            pool.grade_many([("1", "1")])
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"workers": 0, "timeout_s": 1.0}, "workers must be >= 1"),
        ({"workers": 1, "timeout_s": 0.0}, "timeout_s must be > 0"),
        ({"workers": 1, "timeout_s": 1.0, "start_method": "fork"}, "start_method"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GraderPool(**kwargs)
