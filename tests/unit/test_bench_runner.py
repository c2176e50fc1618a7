"""`tether bench`'s plumbing without running a benchmark: where a result's README goes, the git
stamp on every result, and a child process stopped with its group when the parent is
interrupted (real subprocesses)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import child_process
from bench.lora import readme_row
from bench.provenance import CLONE, git_state, stamp
from bench.runner import ORDER, Interrupted, command_line, readme_for, stop_on_signals
from bench.smoke import LIMITS


def test_a_readme_goes_beside_the_results_never_above_them(tmp_path):
    assert readme_for(CLONE / "bench" / "results") == CLONE / "bench" / "README.md"
    scratch = tmp_path / "scratch"
    assert readme_for(scratch) == scratch / "README.md"  # not tmp_path / "README.md"


def test_every_result_is_stamped_with_the_commit_and_the_dirty_flag(tmp_path):
    state = git_state()
    assert len(state["commit"]) == 40 and isinstance(state["dirty"], bool)
    result = tmp_path / "x.json"
    result.write_text(json.dumps({"bench": "x"}))
    stamp(result, state)
    assert json.loads(result.read_text())["git"] == state
    assert git_state(tmp_path) == {"commit": None, "dirty": None}  # not a checkout


def test_sigterm_becomes_an_exception_that_runs_the_cleanups():
    cleaned = []
    with pytest.raises(Interrupted, match="SIGTERM") as info, stop_on_signals():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            cleaned.append(True)
    assert cleaned == [True] and info.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored


CHILD = """
import signal, subprocess, sys, time
grand = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "w").write(str(grand.pid))
signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[2], "w").write("asked"), sys.exit(0)))
time.sleep(60)
"""


def test_an_interrupted_child_is_asked_to_stop_then_its_group_is_killed(tmp_path):
    pid_file, asked = tmp_path / "grandchild", tmp_path / "asked"
    cmd = [sys.executable, "-c", CHILD, str(pid_file), str(asked)]
    with pytest.raises(subprocess.TimeoutExpired):
        child_process.run(cmd, timeout_s=3.0, grace_s=5.0)
    assert asked.read_text() == "asked"  # SIGTERM first: it could clean up
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the child's own child outlived it: the process group was not killed")


def test_make_bench_smoke_covers_every_benchmark_with_a_limit():
    assert set(LIMITS) == set(ORDER)


def test_the_lora_rows_keep_a_long_family_error_whole_to_a_list_item():
    mode = {"publish_bytes": 1e6, "publish_seconds_median": 0.1, "step_seconds_median": 1.0,
            "learner_state_bytes": 2**20, "peak_rss_bytes": 2**30, "trainable_parameters": 1e6}  # fmt: skip
    long = "vLLM cannot put LoRA on: " + ", ".join(
        f"model.layers.{i}.mlp.experts" for i in range(9)
    )
    result = {
        "full": mode, "lora": mode, "settings": {"hidden_size": 512, "rank": 16},
        "machine": {"load_average": [0.5]},
        **{f"{k}_lora_over_full": 1.0 for k in ("publish_bytes", "publish_seconds_median",
           "step_seconds_median", "learner_state_bytes", "peak_rss_bytes")},
        "families": [{"family": "moe", "ok": False, "error": long}],
    }  # fmt: skip
    rows = readme_row(result)
    assert len(rows) == 2 and rows[0].startswith("| lora | 1.0 M, rank 16 |")
    cell = rows[1].split(" | ")[2]
    assert cell.startswith("moe ✗ vLLM cannot put LoRA on: model.layers.0.mlp.experts")
    assert cell.endswith("experts, …") and len(cell) < 180  # cut after a whole module name
    result["families"] = [{"family": "moe", "ok": False, "error": "x" * 300}]  # no list in it
    assert readme_row(result)[1].split(" | ")[2] == "moe ✗ " + "x" * 160 + "…"


def test_a_bad_hosts_link_rate_is_refused_by_the_cli_with_exit_2():
    tether = Path(sys.executable).with_name("tether")  # the installed command, as a user runs it
    for bad in ("-1", "0", "fast"):
        proc = subprocess.run([str(tether), "bench", "weights", f"--hosts-mbit={bad}"],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 2
        assert (
            f"--hosts-mbit: '{bad}': give each emulated host's link rate in Mbit/s" in proc.stderr
        )
        assert "Traceback" not in proc.stderr


def test_the_slow_link_command_names_what_it_runs():
    cmd = command_line("weights", generators=(1, 2, 4, 8), hosts_mbit=200.0, slow_link=10.0)
    assert cmd == "tether bench weights --hosts-mbit 200 --slow-link 10"
    scaling = command_line("weights", generators=(1, 2, 4, 8), hosts_mbit=200.0)
    assert scaling == "tether bench weights --generators 1,2,4,8 --hosts-mbit 200"
