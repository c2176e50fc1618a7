"""How `tether train`'s supervisor reads the learner's exit code (``common.service.exit_codes``):
0 is a finished run; 75 (stopped before the run's end by someone else's SIGTERM) is restarted
and resumes; 2 stops the run with exit code 2. Real child processes, one per case."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from common.config.schema import TetherConfig
from common.service.exit_codes import EXIT_REFUSED, EXIT_STOPPED
from tether.runs.supervisor import Child, RunFailed, Supervisor


def _supervisor(tmp_path: Path, code: int, *, said: str = "", **run) -> Supervisor:
    """A supervisor of one learner process that writes ``said`` to stderr and exits ``code``."""
    sup = Supervisor.__new__(Supervisor)  # the poll loop only: no services
    sup.cfg = TetherConfig.model_validate({"run": run})
    script = f"import sys; print({said!r}, file=sys.stderr); raise SystemExit({code})"
    learner = Child("learner", [sys.executable, "-c", script], tmp_path / "l.log", {})
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


def test_a_learner_that_cannot_go_on_is_reported_as_such_not_as_a_refused_config(tmp_path):
    said = (
        "tether learner: cannot go on: cycle 4: 8 of its prompts or groups were dead-lettered "
        "(max_deliveries), which leaves 0 group(s), too few for its 2 optimizer step(s)."
    )
    with pytest.raises(RunFailed) as err:
        _supervisor(tmp_path, EXIT_REFUSED, said=said).poll()
    assert err.value.exit_code == EXIT_REFUSED
    text = str(err.value)
    assert "learner cannot go on (exit code 2): cycle 4: 8 of its prompts" in text
    assert "refused its configuration" not in text and "tether bus redrive" in text


def test_the_crash_limit_is_a_setting_and_quotes_the_last_error(tmp_path):
    sup = _supervisor(
        tmp_path, 1, said="OSError: [Errno 28] No space left on device", max_crashes=2
    )
    assert sup.poll() is True and sup.learner.restarts == 1  # the first crash: restarted
    sup.learner.start()
    sup.learner.proc.wait(timeout=30)
    with pytest.raises(RunFailed) as err:
        sup.poll()
    assert "crashed 2 times within 300 s" in str(err.value)
    assert "run.max_crashes = 2" in str(err.value)
    assert "No space left on device" in str(err.value)
