"""Helpers of the weight-sync tests: test weights, receiver processes (``tests/procs/
weight_receiver.py``) and their event logs, a publish on a thread."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch  # noqa: TID253 - tests of torch tensors on the wire

from common.weights.handshake import SECRET_ENV
from common.weights.publisher import WeightPublisher
from tests.paths import REPO

ROOT = REPO
RECEIVER = ROOT / "tests" / "procs" / "weight_receiver.py"


def weights(seed: int, n: int = 8, mb: float = 4.0) -> list:
    g = torch.Generator().manual_seed(seed)
    rows = int(mb * (1 << 20) / 4 / 256)
    named = [(f"layer{i}.w", torch.randn(rows, 256, generator=g)) for i in range(n)]
    return named + [
        ("norm.bias", torch.randn(7, generator=g).bfloat16()),
        ("step", torch.tensor(3)),
    ]


def start_receiver(tmp_path: Path, port: int, member: str, *extra: str, secret: str = ""):
    """A receiver process (tests/procs/weight_receiver.py); ``secret``: its weights secret."""
    log = tmp_path / f"{member}-{time.monotonic_ns()}.jsonl"
    cmd = [sys.executable, str(RECEIVER), "--port", str(port), "--member", member]
    cmd += ["--log", str(log), "--timeout", "20", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{SECRET_ENV: secret})
    return subprocess.Popen(cmd, env=env), log


def events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


# How long a receiver process may take to start and join: it imports torch first, which took
# over 30 s on a 2-core CI machine running another suite (a join wait timed out there).
JOIN_S = 120.0


def wait_for(pred, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def publish_in_thread(pub: WeightPublisher, named, version: int) -> dict:
    box: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        box["report"] = pub.publish(named, version)
        box["elapsed"] = time.monotonic() - t0

    box["thread"] = threading.Thread(target=run, daemon=True)
    box["thread"].start()
    return box


def passes(session, named):
    """Make every pass ``session`` asks for (the learner's rank 0), then close it."""
    named = sorted(named)
    while (feed := session.next_pass()) is not None:
        for k, (_, _, first, last) in enumerate(session.layout["units"]):
            session.put(feed, k, [t for _, t in named[first:last]])
    return session.close()


def stream(pub: WeightPublisher, named, version: int):
    """A streamed publish of ``named`` as the learner's rank 0 makes one
    (``services.learner.gather.stream_publish``, one rank): every pass the round asks for."""
    return passes(pub.begin(named, version), named)


def stop_all(procs: list, pub: WeightPublisher) -> None:
    """End the receiver processes still running (woken first, in case one was SIGSTOPped) and
    the publisher."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
    pub.close()
