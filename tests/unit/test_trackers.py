"""Tracker settings: a tracker the user asked for but did not install stops `tether train` with
exit code 2 and the install command, before the run directory or Redis exist."""

from __future__ import annotations

import importlib.util

from tether.cli.main import main


def test_missing_wandb_is_a_usage_error_with_the_fix(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    code = main(
        [
            "train",
            "--set",
            f'run.run_dir="{tmp_path}"',
            "--set",
            'learner.trackers=["tensorboard", "wandb"]',
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "learner.trackers includes 'wandb'" in err and "pip install wandb" in err
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_unknown_tracker_is_refused_by_the_schema(capsys):
    code = main(["config", "check", "--set", 'learner.trackers=["mlflow"]'])
    assert code == 2
    assert "learner.trackers" in capsys.readouterr().err
