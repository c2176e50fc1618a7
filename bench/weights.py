"""Benchmark: a ``WeightPublisher.publish`` of N MB to one receiver process against a bare gloo
broadcast of the same bytes, in the same run, on the same machine; then, for each number of
generators in ``generators``, the bytes the learner sends and the seconds a publish takes, down a
chain against pairwise, and what gloo's own broadcast sends from its root.

The publish includes what the bare broadcast does not: the header, bucketing, the xxh3
checksum on both sides (the receiver verifies every unit before it takes the next, as a
generator does before loading it), the announcement through the store and the thread hand-off.
The receiver takes the units through the generator's own ``LoadStream``, which lets go of each
unit's tensors before the next is received, so that the one staging buffer is reused (a loop
that kept the last unit's views, as this benchmark did before, made every unit wait out
``transfer.RELEASE_WAIT_S`` and then fill a new buffer, which a generator never does).
Timed on the learner side, a publish and a bare broadcast in turn (both see the same machine),
and between them the checksum alone: ``tensors_checksum`` of the same tensors in the learner's
process, what each side of a publish does beside the transfer (``checksum_seconds``, one core;
the receiver hashes the same bytes again). On two shared cores every side's hashing competes
with both ends of the transfer for the same cores, so the gap between a publish and a bare
broadcast is set against it, measured in the same rounds;
each figure is the best of ``pair_repeats`` after one warm-up, with the median of the rounds'
ratios and their spread beside it (on two shared cores one round's time varies by tens of
percent, so three rounds decide nothing).

Bytes sent by the learner: the growth of ``wchar`` in ``/proc/self/io`` of this process (the
learner) over a publish: every byte handed to a write-type system call, sockets included (the
weight store's server thread adds a few kB). Bytes over loopback: ``lo``'s transmit counter in
``/proc/net/dev`` (every process). Checked against gloo's broadcast: 1.00x the buffer for one
receiver.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

from bench.weights_hosts import GENERATORS, run_hosts_bench
from bench.weights_slow_link import run_slow_link_bench
from common.service import process_exit
from common.weights.checksum import tensors_checksum
from common.weights.group import broadcast, make_pair_group
from common.weights.publisher import WeightPublisher
from common.weights.receiver import WeightReceiver
from services.generator.update_stream import LoadStream


def _receiver(port: int, bare_port: int, total_bytes: int, repeats: int) -> None:
    import torch

    rx = WeightReceiver("127.0.0.1", port, "bench", timeout_s=120.0)
    rx.join()
    store = torch.distributed.TCPStore("127.0.0.1", bare_port, is_master=False)
    pg = make_pair_group(store, 1, backend="gloo", timeout_s=120.0)
    buf = torch.empty(total_bytes, dtype=torch.uint8)
    for _ in range(repeats + 1):  # alternating, as the learner side does
        # as a generator takes it: a unit at a time, each let go before the next is received
        for _ in LoadStream(rx.begin(wait_s=120.0).units()):
            pass
        broadcast(pg, buf).wait()


def run_weights_bench(
    *, total_mb: int = 200, num_tensors: int = 16, repeats: int = 3, out_path: str | None = None,
    generators: tuple[int, ...] = (), hosts_mbit: float | None = None, work_dir: str = "bench/work",
    quick: bool = False, pair_repeats: int = 15, slow_link: float | None = None,
) -> dict:  # fmt: skip
    """Returns (and writes as JSON to ``out_path``) seconds and GB/s of both and their ratio, and
    with ``generators`` the scaling section (see the module docstring). With ``hosts_mbit``: the
    chain against pairwise on emulated hosts instead (``bench.weights_hosts``), and with
    ``slow_link`` too one generator behind a link that many times slower (``bench.
    weights_slow_link``)."""
    if hosts_mbit and slow_link:
        return run_slow_link_bench(
            out_path=out_path,
            mbit=hosts_mbit,
            factor=slow_link,
            work_dir=work_dir,
            **({"publishes": 4} if quick else {}),
        )
    if hosts_mbit:
        small = {"mb": 32, "repeats": 1} if quick else {}
        return run_hosts_bench(out_path=out_path, mbit=hosts_mbit, work_dir=work_dir,
                               generators=generators or GENERATORS, **small)  # fmt: skip
    import torch

    if total_mb <= 0 or num_tensors <= 0 or repeats <= 0 or pair_repeats <= 0:
        raise ValueError("total_mb, num_tensors, repeats and pair_repeats must be positive")
    numel = total_mb * (1 << 20) // 4 // num_tensors
    named = [(f"w{i}", torch.randn(numel)) for i in range(num_tensors)]
    total_bytes = numel * 4 * num_tensors
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=120.0)
    bare_store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    proc = mp.get_context("spawn").Process(
        target=_receiver, args=(pub.port, bare_store.port, total_bytes, pair_repeats)
    )
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while "bench" not in pub.members():
            if time.monotonic() > deadline or not proc.is_alive():
                raise RuntimeError("the benchmark's receiver process did not join")
            time.sleep(0.05)
        pg = make_pair_group(bare_store, 0, backend="gloo", timeout_s=120.0)
        flat = torch.cat([t for _, t in named]).view(torch.uint8)
        publish_s, bare_s, hash_s = [], [], []
        load_before = os.getloadavg()
        for v in range(pair_repeats + 1):  # alternating, so that both see the same machine
            report = pub.publish(named, v)
            if report.per_member != {"bench": "ok"}:
                raise RuntimeError(f"publish failed: {report.per_member}")
            publish_s.append(report.seconds)
            t0 = time.perf_counter()
            broadcast(pg, flat).wait()
            bare_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            tensors_checksum(named)
            hash_s.append(time.perf_counter() - t0)
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
        pub.close()
    best_pub, best_bare = min(publish_s[1:]), min(bare_s[1:])
    ratios = sorted(b / p for p, b in zip(publish_s[1:], bare_s[1:], strict=True))
    result = {
        "bench": "weights",
        "bytes": total_bytes,
        "num_tensors": num_tensors,
        "publish_seconds": best_pub,
        "bare_broadcast_seconds": best_bare,
        "publish_gb_per_s": total_bytes / best_pub / 1e9,
        "bare_broadcast_gb_per_s": total_bytes / best_bare / 1e9,
        "publish_vs_bare_ratio": best_bare / best_pub,
        "rounds": pair_repeats,
        "round_ratio_median": statistics.median(ratios),
        "round_ratio_quartiles": [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]],
        "checksum_seconds": min(hash_s[1:]),
        "publish_minus_bare_seconds": statistics.median(
            p - b for p, b in zip(publish_s[1:], bare_s[1:], strict=True)
        ),
        "all_publish_seconds": publish_s,
        "all_bare_seconds": bare_s,
        "all_checksum_seconds": hash_s,
        "publish_load_average": [load_before[0], os.getloadavg()[0]],
    }
    if generators:
        result.update(_scaling(named, generators, repeats))
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2))
    return result


def _written() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def _loopback_sent() -> int:
    with open("/proc/net/dev") as f:
        return next(
            int(line.split(":")[1].split()[8]) for line in f if line.strip().startswith("lo:")
        )


def _member(port: int, name: str, count: int) -> None:
    rx = WeightReceiver("127.0.0.1", port, name, timeout_s=120.0)
    rx.join()
    for _ in range(count):  # as a generator takes it (see _receiver)
        for _ in LoadStream(rx.begin(wait_s=300.0).units()):
            pass
    rx.close()  # lets the relay to the member below finish


def _bcast_member(port: int, rank: int, world: int, nbytes: int) -> None:
    import torch

    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False)
    pg = torch.distributed.ProcessGroupGloo(store, rank, world, timedelta(seconds=120))
    broadcast(pg, torch.empty(nbytes, dtype=torch.uint8)).wait()


def _spawn(target, args_list: list[tuple]) -> list:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in args_list]
    for p in procs:
        p.start()
    return procs


def _gloo_root_bytes(n: int, nbytes: int) -> float:
    """What gloo's own broadcast sends from its root to ``n`` others, in copies of the buffer."""
    import torch

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = _spawn(_bcast_member, [(store.port, r, n + 1, nbytes) for r in range(1, n + 1)])
    try:
        pg = torch.distributed.ProcessGroupGloo(store, 0, n + 1, timedelta(seconds=120))
        before = _written()
        broadcast(pg, torch.ones(nbytes, dtype=torch.uint8)).wait()
        return (_written() - before) / nbytes
    finally:
        for p in procs:
            p.join(60)


def _scaling(named: list, generators: tuple[int, ...], repeats: int) -> dict:
    """Per N: pairwise and chain publishes to the same N receiver processes, alternating."""
    load_before = os.getloadavg()
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    gloo = {str(n): _gloo_root_bytes(n, 64 << 20) for n in generators}
    table: dict[str, dict[str, dict]] = {"pairwise": {}, "chain": {}}
    version = 0
    for n in generators:
        pub = WeightPublisher("127.0.0.1", 0, timeout_s=300.0)
        procs = _spawn(_member, [(pub.port, f"g{i}", 2 * (repeats + 1)) for i in range(n)])
        runs: dict[str, list] = {"pairwise": [], "chain": []}
        try:
            deadline = time.monotonic() + 300
            while len(pub.members()) < n:
                if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                    raise RuntimeError(f"the benchmark's {n} receiver processes did not join")
                time.sleep(0.05)
            for _ in range(repeats + 1):
                for fanout in ("pairwise", "chain"):
                    pub.fanout, version = fanout, version + 1
                    w0, l0 = _written(), _loopback_sent()
                    report = pub.publish(named, version)
                    if set(report.per_member.values()) != {"ok"}:
                        raise RuntimeError(f"{fanout} publish failed: {report.per_member}")
                    runs[fanout].append({"seconds": report.seconds, "root_bytes": _written() - w0,
                                         "loopback_bytes": _loopback_sent() - l0})  # fmt: skip
            for p in procs:
                p.join(120)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            pub.close()
        for fanout, rs in runs.items():
            timed = rs[1:]
            table[fanout][str(n)] = {
                "seconds": min(r["seconds"] for r in timed),
                "root_bytes": min(r["root_bytes"] for r in timed),
                "root_copies": min(r["root_bytes"] for r in timed) / nbytes,
                "loopback_copies": min(r["loopback_bytes"] for r in timed) / nbytes,
                "all": rs,
            }
    lo, hi = str(min(generators)), str(max(generators))
    ratios = {
        f"ratio_{f}_{k}_n{hi}_vs_n{lo}": table[f][hi][k] / table[f][lo][k]
        for f in ("chain", "pairwise")
        for k in ("root_bytes", "seconds")
    }
    return {
        "generators": list(generators),
        "scaling_bytes": nbytes,
        "gloo_broadcast_root_copies": gloo,
        "scaling": table,
        **ratios,
        "load_average": [load_before[0], *os.getloadavg()],
        "cpu_count": os.cpu_count(),
    }


def readme_row(r: dict) -> str:
    """The bench/README.md row of a result."""
    measured = (
        f"{r['bytes'] / 1e6:.0f} MB in {r['num_tensors']} tensors to 1 receiver: publish "
        f"{r['publish_seconds']:.3f} s vs a bare gloo broadcast {r['bare_broadcast_seconds']:.3f} s"
    )
    ratio = f"publish ÷ bare speed **{r['publish_vs_bare_ratio']:.2f}**"
    if "round_ratio_median" in r:
        lo, hi = r["round_ratio_quartiles"]
        ratio += (
            f" (best of {r['rounds']} rounds each; per round median "
            f"{r['round_ratio_median']:.2f}, quartiles {lo:.2f}–{hi:.2f})"
        )
    if r.get("generators"):
        hi = max(r["generators"])
        measured += (
            f"; learner bytes per publish to {hi} receivers: chain "
            f"{r['scaling']['chain'][str(hi)]['root_copies']:.2f}× the model, pairwise "
            f"{r['scaling']['pairwise'][str(hi)]['root_copies']:.2f}×"
        )
        ratio += f", chain seconds N={hi} ÷ N=1 **{r[f'ratio_chain_seconds_n{hi}_vs_n1']:.2f}**"
    notes = ("best of the timed rounds, alternating; the publish also hashes (xxh3) every byte on "
             "both sides and the receiver verifies each unit, on the same 2 cores")  # fmt: skip
    if "checksum_seconds" in r:
        measured += (
            f"; publish − bare {r['publish_minus_bare_seconds']:.3f} s (median of rounds) against "
            f"the checksum alone, {r['checksum_seconds']:.3f} s of one core on each side"
        )
    load = (r.get("machine", {}).get("load_average") or r["publish_load_average"])[0]
    return (f"| weights | random fp32 tensors | {measured} | {ratio} | {notes} | {load:.1f} | "
            f"`{r.get('command', 'tether bench weights')}` |")  # fmt: skip


if __name__ == "__main__":
    process_exit.skip_finalization("gloo process groups")  # see process_exit's docstring
    print(
        json.dumps(
            run_weights_bench(out_path="runs/bench/weights.json", generators=(1, 2)), indent=2
        )
    )
    process_exit.end(0)
