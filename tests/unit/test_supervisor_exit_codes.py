"""How `tether train`'s supervisor reads the learner's exit code (``common.service.exit_codes``):
0 is a finished run; 75 (stopped before the run's end by someone else's SIGTERM) is restarted
and resumes; 2 stops the run with exit code 2. Real child processes, one per case."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from common.service.exit_codes import EXIT_REFUSED, EXIT_STOPPED
from tether.runs.supervisor import Child, RunFailed, Supervisor


def _supervisor(tmp_path: Path, code: int) -> Supervisor:
    sup = Supervisor.__new__(Supervisor)  # the poll loop only: no config, no services
    learner = Child(
        "learner", [sys.executable, "-c", f"raise SystemExit({code})"], tmp_path / "l.log", {}
    )
    sup.learner, sup.children, sup.stopping = learner, [learner], False
    learner.start()
    learner.proc.wait(timeout=30)
    return sup


def test_a_finished_learner_ends_the_run(tmp_path):
    assert _supervisor(tmp_path, 0).poll() is False


def test_a_learner_stopped_before_the_end_is_restarted(tmp_path):
    sup = _supervisor(tmp_path, EXIT_STOPPED)
    assert sup.poll() is True
    assert sup.learner.proc is None and sup.learner.restarts == 1
    assert sup.learner.next_start > time.monotonic()


def test_a_refusing_learner_stops_the_run_with_exit_2(tmp_path):
    with pytest.raises(RunFailed) as err:
        _supervisor(tmp_path, EXIT_REFUSED).poll()
    assert err.value.exit_code == EXIT_REFUSED


def test_while_stopping_the_learners_code_is_not_read(tmp_path):
    sup = _supervisor(tmp_path, EXIT_STOPPED)
    sup.stopping = True
    assert sup.poll() is True and sup.learner.restarts == 0
