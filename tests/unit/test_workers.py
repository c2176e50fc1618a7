"""How `make test` splits the suite between its two workers (``tests.workers.test_scope``)."""

import os
import resource
import subprocess
import sys

from tests.paths import REPO
from tests.workers import (
    E2E_APART,
    USES_SHORT_RUN,
    WAITING,
    cpu_seconds,
    mostly_waiting,
    pick_scope,
    test_scope,
    waiting_lane,
)


def test_e2e_runs_share_one_scope_and_the_long_partitions_module_has_its_own():
    demo = test_scope("tests/e2e/test_demo.py::test_reduced_demo_prints_accuracy_before_and_after")
    kill = test_scope("tests/e2e/test_e2e_episodes.py::test_a_generator_killed_mid_episode")
    assert demo == kill == "tests/e2e"
    assert test_scope(f"{USES_SHORT_RUN[0]}::test_x") == "tests/e2e"  # the e2e run it reads
    waiting = test_scope("tests/e2e/test_e2e_partitions.py::test_partitions_during_a_run[x]")
    assert waiting == "tests/e2e/test_e2e_partitions.py" == E2E_APART[0]
    assert waiting != demo


def test_every_other_module_is_a_scope_of_its_own():
    a = test_scope("tests/services/test_model_families.py::test_vllm_runs[qwen3]")
    b = test_scope("tests/services/test_model_families.py::test_parity[llama3]")
    assert a == b == "tests/services/test_model_families.py"
    assert test_scope("tests/unit/test_extract.py::test_box") == "tests/unit/test_extract.py"


def test_the_named_modules_exist():
    assert all((REPO / path).is_file() for path in (*E2E_APART, *USES_SHORT_RUN))


def test_cpu_seconds_count_an_ended_subprocess():
    before = cpu_seconds()
    subprocess.run([sys.executable, "-c", "sum(range(3 * 10**7))"], check=True)
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert cpu_seconds() - before >= 0.2
    assert child.ru_utime > 0


def test_the_waiting_lane_takes_only_waiting_modules_and_the_others_take_them_last():
    compute, wait = "tests/services/test_engine.py", WAITING[0]
    assert pick_scope([compute, wait], waiting_lane=True) == wait
    assert pick_scope([compute], waiting_lane=True) is None  # its worker then ends
    assert pick_scope([wait, compute], waiting_lane=False) == compute
    assert pick_scope([wait], waiting_lane=False) == wait  # nothing else left
    assert pick_scope([], waiting_lane=False) is None
    assert all((REPO / path).is_file() for path in WAITING)


def test_the_waiting_lane_is_the_last_worker_of_at_least_three():
    assert waiting_lane(["gw10", "gw2", "gw1", "gw0"]) == "gw10"  # by number, not by name
    assert waiting_lane(["gw0", "gw1", "main"]) is None  # two workers: both compute
    assert waiting_lane([]) is None


def test_the_summary_names_the_scopes_that_mostly_wait_on_a_computing_worker():
    scopes = {
        ("gw0", "tests/services/test_idle.py"): [40.0, 4.0],
        ("gw0", "tests/services/test_busy.py"): [40.0, 38.0],
        ("gw1", "tests/services/test_half.py"): [30.0, 10.0],
        ("gw1", "tests/services/test_short.py"): [5.0, 0.0],  # too short to matter
        ("gw2", "tests/services/test_lane.py"): [90.0, 1.0],  # already on the waiting lane
        ("gw0", WAITING[0]): [90.0, 1.0],  # waiting module a computing worker took last
    }
    got = mostly_waiting(scopes, waiting_lane="gw2")
    assert got == [("tests/services/test_idle.py", 40.0, 4.0),
                   ("tests/services/test_half.py", 30.0, 10.0)]  # fmt: skip
    with_two_workers = [scope for scope, _, _ in mostly_waiting(scopes, waiting_lane=None)]
    assert with_two_workers[0] == "tests/services/test_lane.py"


def test_a_test_worker_computes_on_one_thread_unless_told_otherwise():
    """tests/conftest.py: under pytest-xdist each worker's processes take one OpenMP thread
    (or OMP_NUM_THREADS as given), and torch, imported after it, follows."""
    import torch  # noqa: PLC0415 - heavy: imported by the one test that needs it

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process runs the suite: its threads are left as they are
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])


def test_the_suite_runs_without_pytest_xdist():
    """``-p no:xdist`` (one process, e.g. under a debugger): the scheduler's hook is xdist's own,
    so conftest registers it only while xdist is active; pytest refused the suite before."""
    cmd = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q",
           "tests/unit/test_workers.py", "-k", "share_one_scope"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout, proc.stdout[-2000:]
