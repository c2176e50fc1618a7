"""``worker_in_engine_core``: the switches it sets while an engine core process starts (which
inherits them), and that it puts the environment back afterwards."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.engine import worker_in_engine_core

CORE = "VLLM_ENABLE_V1_MULTIPROCESSING"
COMPILE = "TORCH_COMPILE_DISABLE"
# what torch makes of the environment in a new process, as vLLM's engine core process starts
DYNAMO_DISABLED = "import torch._dynamo.config as c; print(c.disable)"


def test_an_eager_engine_core_compiles_nothing_and_the_environment_comes_back(monkeypatch):
    monkeypatch.delenv(COMPILE, raising=False)
    monkeypatch.setenv(CORE, "1")
    with worker_in_engine_core(eager=True):
        assert (os.environ[CORE], os.environ[COMPILE]) == ("0", "1")
        child = subprocess.run([sys.executable, "-c", DYNAMO_DISABLED], capture_output=True,
                               text=True, check=True)  # fmt: skip
        assert child.stdout.strip() == "True", child.stderr[-2000:]
    assert os.environ[CORE] == "1" and COMPILE not in os.environ


@pytest.mark.parametrize("given", [None, "0"])
def test_a_compiled_engine_or_the_users_own_setting_is_left_alone(monkeypatch, given):
    if given is None:
        monkeypatch.delenv(COMPILE, raising=False)
    else:
        monkeypatch.setenv(COMPILE, given)
    monkeypatch.delenv(CORE, raising=False)
    with worker_in_engine_core(eager=given is not None):  # eager, but the user said 0
        assert os.environ[CORE] == "0" and os.environ.get(COMPILE) == given
    assert CORE not in os.environ and os.environ.get(COMPILE) == given
