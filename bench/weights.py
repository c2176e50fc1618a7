"""Benchmark: a ``WeightPublisher.publish`` of N MB to one receiver process against a bare gloo
broadcast of the same bytes, in the same run, on the same machine.

The publish includes what the bare broadcast does not: the header, bucketing, the xxh3
checksum on both sides (the receiver verifies before returning) and the thread hand-off.
Timed on the learner side; each figure is the best of ``repeats`` after one warm-up.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path


def _receiver(port: int, bare_port: int, total_bytes: int, repeats: int) -> None:
    import torch

    from common.weights.group import broadcast, make_pair_group
    from common.weights.receiver import WeightReceiver

    rx = WeightReceiver("127.0.0.1", port, "bench", timeout_s=120.0)
    rx.join()
    for _ in range(repeats + 1):
        rx.receive(wait_s=120.0)
    store = torch.distributed.TCPStore("127.0.0.1", bare_port, is_master=False)
    pg = make_pair_group(store, 1, backend="gloo", timeout_s=120.0)
    buf = torch.empty(total_bytes, dtype=torch.uint8)
    for _ in range(repeats + 1):
        broadcast(pg, buf).wait()


def run_weights_bench(
    *, total_mb: int = 256, num_tensors: int = 16, repeats: int = 3, out_path: str | None = None
) -> dict:
    """Returns (and writes as JSON to ``out_path``) seconds and GB/s of both and their ratio."""
    import torch

    from common.weights.group import broadcast, make_pair_group
    from common.weights.publisher import WeightPublisher

    if total_mb <= 0 or num_tensors <= 0 or repeats <= 0:
        raise ValueError("total_mb, num_tensors and repeats must be positive")
    numel = total_mb * (1 << 20) // 4 // num_tensors
    named = [(f"w{i}", torch.randn(numel)) for i in range(num_tensors)]
    total_bytes = numel * 4 * num_tensors
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=120.0)
    bare_store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    proc = mp.get_context("spawn").Process(
        target=_receiver, args=(pub.port, bare_store.port, total_bytes, repeats)
    )
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while "bench" not in pub.members():
            if time.monotonic() > deadline or not proc.is_alive():
                raise RuntimeError("the benchmark's receiver process did not join")
            time.sleep(0.05)
        publish_s = []
        for v in range(repeats + 1):
            report = pub.publish(named, v)
            if report.per_member != {"bench": "ok"}:
                raise RuntimeError(f"publish failed: {report.per_member}")
            publish_s.append(report.seconds)
        pg = make_pair_group(bare_store, 0, backend="gloo", timeout_s=120.0)
        flat = torch.cat([t for _, t in named]).view(torch.uint8)
        bare_s = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            broadcast(pg, flat).wait()
            bare_s.append(time.perf_counter() - t0)
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
        pub.close()
    best_pub, best_bare = min(publish_s[1:]), min(bare_s[1:])
    result = {
        "bytes": total_bytes,
        "num_tensors": num_tensors,
        "publish_seconds": best_pub,
        "bare_broadcast_seconds": best_bare,
        "publish_gb_per_s": total_bytes / best_pub / 1e9,
        "bare_broadcast_gb_per_s": total_bytes / best_bare / 1e9,
        "publish_vs_bare_ratio": best_bare / best_pub,
        "all_publish_seconds": publish_s,
        "all_bare_seconds": bare_s,
    }
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    print(json.dumps(run_weights_bench(out_path="runs/bench/weights.json"), indent=2))
