"""``tether.runs.graceful_torchrun`` against plain torchrun, both real: a rank whose stop takes
longer than torchrun's shutdown timeout. Plain torchrun SIGKILLs it and exits 1; the wrapper
lets it finish (within its --shutdown-timeout) and exits with the rank's own code (torchrun's is
1 for any failing rank): 0, 75 for a clean stop, 2 for a refused configuration."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.service.exit_codes import EXIT_REFUSED, EXIT_STOPPED, combined
from tether.runs.graceful_torchrun import shutdown_timeout

RANK = Path(__file__).resolve().parents[1] / "procs" / "slow_stop_rank.py"
STOP_S = 4.0


def _run(
    module: str, tmp_path: Path, timeout_flag: str, rank_code: int = 0
) -> tuple[int, bool, float]:
    out = tmp_path / f"{module.rsplit('.', 1)[-1]}-{rank_code}.done"
    proc = subprocess.Popen(
        [sys.executable, "-m", module, timeout_flag, "--standalone", "--nproc_per_node=1",
         str(RANK), str(out), str(STOP_S), str(rank_code)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not Path(str(out) + ".started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the rank never started"
        time.sleep(0.1)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # to the launcher only, as a kubelet does to PID 1
    code = proc.wait(timeout=60)
    return code, out.exists(), time.monotonic() - t0


def test_plain_torchrun_kills_a_slow_stop_and_the_wrapper_does_not(tmp_path):
    code, landed, _ = _run("torch.distributed.run", tmp_path, "--shutdown-timeout=1")
    assert code != 0 and not landed  # the old behaviour: work lost, and a failure
    code, landed, took = _run(
        "tether.runs.graceful_torchrun", tmp_path, f"--shutdown-timeout={STOP_S + 20:.0f}"
    )
    assert code == 0 and landed and took >= STOP_S


def test_the_wrapper_exits_with_a_cleanly_stopped_ranks_code(tmp_path):
    # what a learner stopped before the run's end does: torchrun says 1, the wrapper says 75
    code, landed, took = _run(
        "tether.runs.graceful_torchrun", tmp_path, f"--shutdown-timeout={STOP_S + 20:.0f}",
        rank_code=EXIT_STOPPED,
    )  # fmt: skip
    assert code == EXIT_STOPPED and landed and took >= STOP_S


def test_a_refused_configuration_exits_2_through_the_wrapper_and_1_through_torchrun(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\nname = "x"\nmodel = "/nonexistent/model"\n')
    codes = {}
    for module in ("torch.distributed.run", "tether.runs.graceful_torchrun"):
        codes[module] = subprocess.run(
            [sys.executable, "-m", module, "--standalone", "--nproc_per_node=1",
             "-m", "tether.cli", "learner", "--config", str(bad)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=120,
        ).returncode  # fmt: skip
    assert codes == {"torch.distributed.run": 1, "tether.runs.graceful_torchrun": EXIT_REFUSED}


@pytest.mark.parametrize(
    "torchrun,ranks,expected",
    [(0, [], 0), (0, [0, 0], 0), (1, [75, 75], 75), (1, [0, 75], 75), (1, [75, 2], 2),
     (1, [2], 2), (1, [75, 1], 1), (1, [], 1), (137, [75], 75), (1, [0], 1)],
)  # fmt: skip
def test_combined_exit_code(torchrun, ranks, expected):
    assert combined(torchrun, ranks) == expected


def test_the_wrapper_kills_ranks_that_overrun_its_timeout(tmp_path):
    code, landed, took = _run("tether.runs.graceful_torchrun", tmp_path, "--shutdown-timeout=1")
    assert code != 0 and not landed and took < STOP_S + 10


@pytest.mark.parametrize(
    "argv,expected",
    [(["--shutdown-timeout", "290"], 290.0), (["--shutdown_timeout=110", "-m", "x"], 110.0),
     (["--nproc_per_node=2"], 30.0)],
)  # fmt: skip
def test_shutdown_timeout_is_read_like_torchrun(argv, expected, monkeypatch):
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert shutdown_timeout(argv) == expected
