"""How `tether bench models` records a family's stages (``bench/models.py``): every stage that
fails says why, and a family that fails early stays in the results with its error."""

from __future__ import annotations

import json
from argparse import Namespace

import fixtures.model_families as families
from bench import models, runner
from bench.real_models import REAL_MODELS, family_names
from bench.runner import families_problem, run_bench
from fixtures.model_families import FAMILIES


def test_a_stage_that_passes_records_its_numbers_and_time() -> None:
    row: dict = {"family": "x"}
    assert models._stage(row, "parity_before", lambda: {"ok": True, "mean_abs": 2e-6, "k3": 0.0})
    assert row["parity_before"]["ok"] and row["parity_before"]["mean_abs"] == 2e-6
    assert row["parity_before"]["seconds"] >= 0 and "error" not in row["parity_before"]


def test_a_stage_that_fails_on_its_numbers_says_why() -> None:
    row: dict = {"family": "x"}
    assert not models._stage(row, "parity_after", lambda: {"ok": False, "mean_abs": 0.82})
    assert row["parity_after"]["error"] == "mean |Δ| 8.20e-01 over the 1e-3 target"


def test_a_stage_that_raises_records_the_exception_text() -> None:
    def load() -> dict:
        raise ValueError("head size 96 is not supported by the CPU attention backend")

    row: dict = {"family": "x"}
    assert not models._stage(row, "load", load)
    assert row["load"]["error"] == (
        "ValueError: head size 96 is not supported by the CPU attention backend"
    )
    assert row["load"]["ok"] is False


def test_a_family_whose_build_fails_is_kept_with_its_error(monkeypatch, tmp_path) -> None:
    def broken(name: str, root=None):
        raise RuntimeError(f"cannot build {name}")

    monkeypatch.setattr(families, "build_family", broken)
    row = models._family_row(
        "llama3", root=tmp_path, data={}, redis_url="", device=None, quick=False
    )
    assert row["family"] == "llama3" and row["architecture"] == "LlamaForCausalLM"
    assert row["build"]["ok"] is False
    assert row["build"]["error"] == "RuntimeError: cannot build llama3"
    assert "load" not in row  # later stages are left out, not marked as passed


def test_the_training_reward_varies_between_responses() -> None:
    """Every training step needs responses whose rewards differ (a reward that is the same for
    every response of an untrained model gives no gradient)."""
    share = models.distinct_char_share
    rewards = {share(prompt="p", response=r, ground_truth=None, metadata={}) for r in
               ("aaaa", "abab", "abcd", "")}  # fmt: skip
    assert rewards == {0.0, 0.25, 0.5, 1.0}


def test_a_run_of_a_few_families_goes_to_a_file_of_its_own(monkeypatch, tmp_path) -> None:
    """``--families`` never writes models.json (the full result would lose the other rows)."""
    seen: dict = {}

    def fake_bench(*, out_path, **kwargs):  # stands in for run_models_bench
        seen.update(kwargs)
        out_path.write_text(json.dumps({"bench": "models"}))
        return {}

    monkeypatch.setattr(runner, "_bench_fn", lambda what: fake_bench)
    runner.run_one("models", out_dir=tmp_path, quick=False, work_dir=tmp_path / "w",
                   families=("smollm2-135m",))  # fmt: skip
    assert seen["families"] == ["smollm2-135m"]
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["models_smollm2-135m.json"]
    written = json.loads((tmp_path / "models_smollm2-135m.json").read_text())
    assert written["command"] == "tether bench models --families smollm2-135m"


def test_families_that_do_not_exist_are_refused_with_exit_2(tmp_path, capsys) -> None:
    out = tmp_path / "results"
    assert run_bench(Namespace(what="models", families=("llama3", "gpt9"), out=str(out))) == 2
    err = capsys.readouterr().err
    assert "--families: no family gpt9; choose from llama3," in err and "smollm2-135m" in err
    assert run_bench(Namespace(what="lora", families=("llama3",), out=str(out))) == 2
    assert "not of lora; drop it" in capsys.readouterr().err
    assert not out.exists()  # refused before anything ran


def test_the_real_model_is_in_a_full_run_not_in_a_quick_one_unless_named() -> None:
    """Staging the real model downloads and converts it: the smoke run (``--quick``) keeps to the
    fixture families, a full run ends with the real model, ``--families`` can name it either way."""
    assert family_names() == [*FAMILIES, *REAL_MODELS] and "smollm2-135m" in REAL_MODELS
    assert family_names(quick=True) == list(FAMILIES)
    assert families_problem("models", ("smollm2-135m",)) == ""
    assert "no family nope" in families_problem("models", ("nope",))
