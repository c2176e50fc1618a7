"""``shutdown_engine_core`` finishes vLLM's forced kill when a process exits under it (vLLM 0.32
lets psutil's NoSuchProcess out of ``kill_process_tree`` and leaves the rest of the tree). The
engine client is a fake of its shape only (``resources.engine_manager.processes``); the
process tree killed is real."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import psutil

from common.engine import kill_process_tree, shutdown_engine_core
from tests.waiting import wait_until

# an engine process with one child, both waiting for a signal until killed
TREE = (
    "import signal, subprocess, sys;"
    "subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()']);"
    "signal.pause()"
)


def _tree() -> tuple[subprocess.Popen, psutil.Process]:
    parent = subprocess.Popen([sys.executable, "-c", TREE])
    proc = psutil.Process(parent.pid)
    wait_until(lambda: proc.children(), timeout_s=30, what="the engine process's child")
    return parent, proc.children()[0]


def test_a_shutdown_that_loses_a_process_under_it_still_kills_the_whole_tree():
    parent, child = _tree()
    core = SimpleNamespace(resources=SimpleNamespace(engine_manager=SimpleNamespace(
        processes=[SimpleNamespace(pid=parent.pid)])))  # fmt: skip

    def vllm_shutdown():
        raise psutil.NoSuchProcess(child.pid + 1_000_000)  # as vLLM's kill_process_tree does

    assert child.is_running()
    shutdown_engine_core(core, vllm_shutdown)  # kills and reaps the tree (so Popen sees no code)
    assert not psutil.pid_exists(parent.pid)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def test_a_clean_shutdown_is_left_alone_and_a_gone_process_is_no_error():
    calls = []
    shutdown_engine_core(SimpleNamespace(), lambda: calls.append(1))
    assert calls == [1]
    parent = subprocess.Popen([sys.executable, "-c", "pass"])
    parent.wait(timeout=30)
    kill_process_tree(parent.pid)  # already reaped: nothing to do
