"""The `tether` command as a user runs it: exit codes, one-paragraph errors, dry runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib

import pytest

from common.config.load import load_config
from tests.paths import REPO
from tether.cli.tool_verbs import NOT_IN_A_CLONE


def tether(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "tether.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_config_check_ok():
    r = tether("config", "check", "--prompts-per-cycle", "30", "--responses-per-prompt", "4")
    assert r.returncode == 0, r.stderr
    assert "120 × 1" in r.stdout


def test_config_check_violation_exit_2_one_paragraph_no_traceback():
    r = tether(
        "config",
        "check",
        "--prompts-per-cycle",
        "30",
        "--responses-per-prompt",
        "4",
        "--train-batch-size",
        "96",
        "--train-steps-per-cycle",
        "1",
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    err_lines = [ln for ln in r.stderr.splitlines() if "configuration error" in ln]
    assert len(err_lines) == 1 and "30 × 4 × 1 = 120" in err_lines[0]


def test_unknown_set_key_exit_2():
    r = tether("config", "check", "--set", "learner.lrate=1")
    assert r.returncode == 2 and "Did you mean 'learner.lr'" in r.stderr


def test_deprecated_flag_warns_with_new_name():
    r = tether("config", "check", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4")
    assert r.returncode == 0, r.stderr
    assert "deprecated" in r.stderr and "prompts_per_cycle" in r.stderr


def test_explain_walks_a_cycle():
    r = tether(
        "config",
        "explain",
        "--prompts-per-cycle",
        "30",
        "--responses-per-prompt",
        "4",
        "--train-steps-per-cycle",
        "2",
    )
    assert r.returncode == 0, r.stderr
    for text in (
        "30 prompts",
        "120 responses",
        "2 optimizer step(s)",
        "60 responses",
        "gradient accumulation",
        "max_staleness = 3",
    ):
        assert text in r.stdout


def test_explain_warns_about_group_of_one():
    r = tether("config", "explain", "--responses-per-prompt", "1")
    assert "no baseline" in r.stdout


@pytest.mark.parametrize("service", ["generator", "scorer", "learner", "train"])
def test_service_dry_run_prints_resolved_config_that_loads_back(service, tmp_path):
    r = tether(service, "--dry-run", "--prompts-per-cycle", "6", "--train-steps-per-cycle", "2")
    assert r.returncode == 0, r.stderr
    doc = tomllib.loads(r.stdout)
    assert doc["run"]["train_batch_size"] == 12
    f = tmp_path / "resolved.toml"
    f.write_text(r.stdout)
    again = load_config(config_file=f, env={}).config
    assert again.run.train_batch_size == 12 and again.run.max_staleness == 3


def test_env_variable_is_a_source():
    env = dict(os.environ, TETHER_RUN__PROMPTS_PER_CYCLE="5")
    r = tether("config", "check", env=env)
    assert r.returncode == 0 and "5 prompts" in r.stdout


def test_bad_config_file_exit_2(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[learner]\nlr = -1\n")
    r = tether("learner", "--config", str(f), "--dry-run")
    assert r.returncode == 2 and "learner.lr = -1" in r.stderr


def test_import_seed_001_exits_2_with_fixes():
    r = tether(
        "config", "import", "--from", "verl", "tests/fixtures/import/verl_seed001_solver_grpo.sh"
    )
    assert r.returncode == 2
    assert "120" in r.stderr and "96" in r.stderr and r.stdout == ""


@pytest.mark.parametrize(
    "peer,fixture",
    [
        ("openrlhf", "openrlhf_rloo_ray_job.sh"),
        ("slime", "slime_glm_old_names.sh"),
        ("verl", "verl_ppo_trainer.yaml"),
        ("roll", "roll_rlvr_megatron.yaml"),
    ],
)
def test_imported_toml_passes_config_check(peer, fixture, tmp_path):
    r = tether("config", "import", "--from", peer, f"tests/fixtures/import/{fixture}")
    assert r.returncode == 0, r.stderr
    assert "→" in r.stderr or "->" in r.stderr  # the mapping table
    f = tmp_path / "imported.toml"
    f.write_text(r.stdout)
    check = tether("config", "check", "--config", str(f))
    assert check.returncode == 0, check.stderr


def test_bench_outside_a_clone_exits_2_with_the_way_to_a_clone(tmp_path):
    """An installed wheel holds tether/, common/ and services/ but not bench/: `tether bench`
    says where the benchmarks live instead of failing on an import."""
    site = tmp_path / "site"
    for package in ("tether", "common", "services"):
        shutil.copytree(
            REPO / package, site / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    env = dict(os.environ, PYTHONPATH=str(site))
    r = subprocess.run(
        [sys.executable, "-m", "tether.cli", "bench", "bus", "--quick"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert NOT_IN_A_CLONE in r.stderr
    assert "Traceback" not in r.stderr
