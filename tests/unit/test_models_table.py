"""The README's "Supported model families" table is the one generated from
``bench/results/models.json``, and that JSON covers every family (none dropped silently)."""

from __future__ import annotations

from bench.models_table import BEGIN, END, load_results, table_markdown
from fixtures.model_families import FAMILIES
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
    assert [r["family"] for r in result["families"]] == list(FAMILIES)
    if result.get("unmeasured"):  # no stamped result: every family listed, none with a figure
        assert all(r.get("pending") for r in result["families"])
        return
    assert not result["quick"], "the README table comes from a full `tether bench models` run"
    for row in result["families"]:
        if row.get("pending"):  # only in a run that stopped early, which the table says
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
    from bench.models_table import pending_row

    done = {**pending_row("llama3"), "build": {"ok": True}, "load": {"ok": False, "error": "E"}}
    del done["pending"]
    result = {"command": "tether bench models", "complete": False,
              "families": [done, pending_row("qwen3-moe")]}  # fmt: skip
    text = table_markdown(result)
    line = next(x for x in text.splitlines() if x.startswith("| Qwen3-MoE (`qwen3-moe`)"))
    assert "not run: the benchmark stopped before this family" in line
    assert "A partial run: 1 of 2 families measured before it stopped." in text
