"""A generator's side of one update, measured (no vLLM): holds model-shaped tensors of its own,
joins the learner's weight sync, takes one update a unit at a time with the code the vLLM worker
runs (``Receipt.units`` -> ``update_stream.LoadStream``), copying each tensor into its own as a
weight loader does, and writes one JSON line: its peak resident memory over the update above
what it held before (``VmHWM`` after resetting it through ``/proc/self/clear_refs``), the
largest unit of the update, and the checksum of its tensors afterwards."""

from __future__ import annotations

import argparse
import json

from common.service import process_exit
from common.weights.checksum import tensors_checksum
from common.weights.layout import dtype_of, largest_unit
from common.weights.receiver import WeightReceiver
from services.generator.update_stream import LoadStream


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--specs", required=True, help="JSON [[name, dtype, shape], ...]")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch

    with open(a.specs) as f:
        specs = json.load(f)
    model = {n: torch.zeros(shape, dtype=dtype_of(dt)) for n, dt, shape in specs}  # resident
    rx = WeightReceiver("127.0.0.1", a.port, "mem", timeout_s=120.0)
    rx.join()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current RSS
    before = _status_kib("VmRSS")
    receipt = rx.begin(wait_s=120.0)
    stream = LoadStream(receipt.units())
    for name, t in stream:
        model[name].copy_(t)
    peak = _status_kib("VmHWM")
    result = {
        "error": stream.error,
        "peak_extra_bytes": (peak - before) * 1024,
        "largest_unit_bytes": largest_unit(receipt.layout),
        "model_bytes": sum(t.numel() * t.element_size() for t in model.values()),
        "staging_allocations": rx._staging.allocations,
        "checksum": tensors_checksum(model.items()),
        "version": rx.version,
    }
    with open(a.out, "w") as f:
        f.write(json.dumps(result) + "\n")
    rx.close()


if __name__ == "__main__":
    process_exit.skip_finalization("gloo process groups")  # see process_exit's docstring
    main()
    process_exit.end(0)
