"""Services on emulated hosts (``bench.hosts``) for the end-to-end tests: the hosts themselves
(root only; CI runs as root, where their absence is a failure) and a service started on one, as
compose and Kubernetes start it (no launcher), with its real settings."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.hosts import Hosts, unavailable
from tests.deploy_tools import REQUIRE
from tether.runs.supervisor import tether_command

LINK_MBIT = 1000  # every host's link, each way


@contextmanager
def emulated_hosts(*names: str, mbit: float = LINK_MBIT) -> Iterator[Hosts]:
    """A host per name, each link shaped to ``mbit``; skipped where namespaces cannot be made
    (not root), a failure under CI's ``TETHER_TEST_REQUIRE_REDIS7=1``."""
    why = unavailable()
    if why:
        if REQUIRE:
            pytest.fail(
                f"TETHER_TEST_REQUIRE_REDIS7=1 (CI) but emulated hosts cannot be made: {why}"
            )
        pytest.skip(f"emulated hosts: {why}")
    with Hosts() as net:
        for name in names:
            net.add(name, mbit=mbit)
        yield net


def start_service(net: Hosts, host: str, kind: str, config: Path, url: str, log_dir: Path,
                  env: dict[str, str], *args: str) -> subprocess.Popen:  # fmt: skip
    """`tether <kind> --config <config> <args>` on ``host``, its Redis URL ``url``, its output in
    ``log_dir/<host>.log``."""
    log = (log_dir / f"{host}.log").open("wb")
    full = {**os.environ, **env, "TETHER_RUN__REDIS_URL": url, "PYTHONUNBUFFERED": "1"}
    cmd = tether_command(kind, "--config", str(config), *args)
    return net.popen(host, cmd, stdout=log, stderr=subprocess.STDOUT, env=full)


def tether_json(config: Path, url: str, *verb: str) -> dict:
    """`tether <verb> --json` of the run in ``config``, from this (the machine's) namespace, with
    the Redis URL ``url``: its parsed output (a failure shows its stderr)."""
    return json.loads(tether_verb(config, url, *verb, "--json"))


def tether_verb(config: Path, url: str, *verb: str) -> str:
    """`tether <verb>` of the run in ``config`` with the Redis URL ``url``, from this (the
    machine's) namespace: its output (a failure shows its stderr)."""
    proc = subprocess.run(
        tether_command(*verb, "--config", str(config), "--redis-url", url),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout
