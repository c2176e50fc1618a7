"""A plain weight-sync receiver process for tests and the benchmark (no vLLM).

Joins the learner's weight sync, receives until ``--count`` updates arrived (rejoining, as a
generator does, when the learner dropped it) and appends one JSON line per event to ``--log``:
``{"event": "joined", "epoch": E}``, ``{"event": "update", "version": V, "checksum": C,
"bytes": B}`` (checksum recomputed from the received tensors) or ``{"event": "error", "error":
"..."}``. ``--stall-after-unit K`` makes it write ``{"event": "stalled"}`` after unit K of receive
attempt number ``--stall-on-update`` and sleep ``--stall-seconds`` (so a test can SIGKILL, SIGSTOP
or time it out mid-broadcast). ``--unit-seconds S`` makes it take S seconds over every unit (a
member that takes updates slower than its peers, as one behind a slow link does: its sender
waits on it). ``--save PATH`` stores the last update as safetensors. On leaving
it lets its relay to the member below in a chain finish.
"""

from __future__ import annotations

import argparse
import json
import time

from common.service import process_exit
from common.weights.checksum import tensors_checksum
from common.weights.handshake import secret_from_env
from common.weights.layout import WeightSyncError
from common.weights.receiver import WeightReceiver


def _log(path: str, **event) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--member", required=True)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--log", required=True)
    p.add_argument("--stall-after-unit", type=int, default=-1)
    p.add_argument("--stall-on-update", type=int, default=1, help="1-based receive attempt")
    p.add_argument("--stall-seconds", type=float, default=3600.0)
    p.add_argument("--unit-seconds", type=float, default=0.0)
    p.add_argument("--save", default="")
    a = p.parse_args()

    rx = WeightReceiver(a.host, a.port, a.member, timeout_s=a.timeout, secret=secret_from_env())
    try:
        _log(a.log, event="joined", epoch=rx.join())
    except WeightSyncError as e:  # e.g. refused: the weights secret (common.weights.handshake)
        _log(a.log, event="error", error=str(e), version=None)
        raise SystemExit(1) from None
    updates = [0]

    def on_unit(k: int) -> None:
        time.sleep(a.unit_seconds)
        if k == a.stall_after_unit and updates[0] == a.stall_on_update:
            _log(a.log, event="stalled")
            time.sleep(a.stall_seconds)

    received = 0
    while received < a.count:
        if not rx.joined:
            _log(a.log, event="joined", epoch=rx.join())
        updates[0] += 1
        try:
            version, named = rx.receive(on_unit=on_unit)
        except WeightSyncError as e:
            _log(a.log, event="error", error=str(e), version=rx.version)
            continue
        received += 1
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        _log(a.log, event="update", version=version, checksum=tensors_checksum(named), bytes=nbytes)
        if a.save:
            from safetensors.torch import save_file

            save_file({n: t.clone() for n, t in named}, a.save)
    rx.close()  # lets the relay to the member below in the chain finish


if __name__ == "__main__":
    process_exit.skip_finalization("gloo process groups")  # see process_exit's docstring
    main()
    process_exit.end(0)
