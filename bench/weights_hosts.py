"""`tether bench weights --hosts-mbit R`: a publish down the chain against pairwise, each
generator and the learner on a host of its own (``bench.hosts``: a network namespace whose link
is shaped to R Mbit/s each way), for N = 1, 2, 4, 8 generators.

On loopback every copy (the learner's and each relay's) goes through the same two cores, so the
seconds say nothing about hosts. Here each host's link is the bottleneck, as on a cluster: the
learner's link carries the model once down a chain (its time stays near one model over one link
plus a piece per hop), N times pairwise.

Processes: the learner (``WeightPublisher`` at its host's address, the real settings: address,
port, handshake) and each generator (``WeightReceiver``, taking each update a unit at a time
through the generator's own ``LoadStream`` and verifying it, as a generator does) are children
started with ``ip netns exec``; gloo binds the address the host's name resolves to, as on a real
host. The learner alternates a pairwise and a chain publish to the same members; each figure is
the best of ``repeats`` after one warm-up.
Bytes on the learner's link: its ``eth0`` transmit counter over a publish.

Scale: links of R Mbit/s with the model and the piece (``weights.chunk_mb``) scaled down
together. A chain's fill is one piece per hop, so what carries over to a cluster is a piece's
time on a link against the model's. Defaults: 200 Mbit/s, 128 MB in 1 MB pieces (128 pieces,
42 ms each on the link, 7 × 42 ms = 0.29 s of fill at N = 8 against 5.4 s for the model). A
run's pieces are 16 MB (gloo) or 64 MB (NCCL) on links of 25-400 Gbit/s: 0.3-5 ms each, and a
16 GB model has 250-1000 of them, so the fill here is an upper bound. With 4 MB pieces (32 of
168 ms) the fill alone was 21 % of the model's time and N8 ÷ N1 measured 1.36 (the result at
51bb1ed). R is kept low enough that the machine's cores are not the bottleneck (between two
namespaces an unshaped gloo broadcast measured ~3 Gbit/s on this 2-core machine; at N = 8 the
hosts together carry 8 × R each way).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.hosts import Hosts
from bench.workload import child_env
from common.service import process_exit
from common.weights.handshake import secret_from_env
from common.weights.publisher import WeightPublisher
from common.weights.receiver import WeightReceiver
from services.generator.update_stream import LoadStream

PORT = 29650  # the learner's weight store, inside its own namespace (nothing else there)
GENERATORS = (1, 2, 4, 8)


def _tx_bytes() -> int:
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def _wait_verified(progress: Path, members: int, version: int, timeout_s: float,
                   names: set[str] | None = None) -> list[float]:  # fmt: skip
    """When each member (of ``names``, if given) had ``version`` verified (the wall clock is the
    machine's, shared by the namespaces). A pairwise publish returns when the learner's sends are done, while the tail of
    the update may still be in the link's queue and the socket buffers; a publish is timed until
    every generator has it, and the next one starts after that (a new round's route calls off a
    receive still in flight)."""
    end = time.monotonic() + timeout_s
    while True:
        done = {}
        for f in progress.glob("*.jsonl"):
            if names is not None and f.stem not in names:
                continue
            for line in f.read_text().splitlines():
                rec = json.loads(line)
                if rec["version"] == version:
                    done[f.stem] = rec["verified_at"]
        if len(done) >= members:
            return list(done.values())
        if time.monotonic() > end:
            raise RuntimeError(f"version {version}: {len(done)} of {members} members verified it")
        time.sleep(0.01)


def learner_main(a: argparse.Namespace) -> None:
    """The learner's host: publishes ``repeats + 1`` times each way, each timed until every
    member has verified it; writes JSON to ``out``."""
    import torch

    numel = a.mb * (1 << 20) // 4 // a.tensors
    g = torch.Generator().manual_seed(0)
    named = [(f"w{i}", torch.randn(numel, generator=g)) for i in range(a.tensors)]
    nbytes = numel * 4 * a.tensors
    pub = WeightPublisher(a.address, PORT, timeout_s=a.timeout_s,
                          chunk_bytes=int(a.chunk_mb * (1 << 20)),
                          min_gb_per_s=a.min_gb_per_s, secret=secret_from_env())  # fmt: skip
    runs: dict[str, list] = {"pairwise": [], "chain": []}
    try:
        deadline = time.monotonic() + a.timeout_s
        while len(pub.members()) < a.members:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(pub.members())} of {a.members} members joined")
            time.sleep(0.05)
        version = 0
        for _ in range(a.repeats + 1):
            for fanout in ("pairwise", "chain"):
                pub.fanout, version = fanout, version + 1
                tx0, t0 = _tx_bytes(), time.time()
                report = pub.publish(named, version)
                if set(report.per_member.values()) != {"ok"}:
                    raise RuntimeError(f"{fanout} publish failed: {report.per_member}")
                done = _wait_verified(Path(a.progress_dir), a.members, version, a.timeout_s)
                runs[fanout].append({"seconds": max(done) - t0, "learner_seconds": report.seconds,
                                     "link_bytes": _tx_bytes() - tx0})  # fmt: skip
    finally:
        pub.close()
    Path(a.out).write_text(json.dumps({"bytes": nbytes, "runs": runs}))


def member_main(a: argparse.Namespace) -> None:
    """A generator's host: takes ``count`` updates a unit at a time, each verified."""
    rx = WeightReceiver(a.learner, PORT, a.name, timeout_s=a.timeout_s, secret=secret_from_env())
    rx.join()
    log = Path(a.progress_dir) / f"{a.name}.jsonl"
    for _ in range(a.count):
        receipt = rx.begin(wait_s=a.timeout_s)
        # as a generator takes it (bench.weights): each unit let go before the next is received
        stream = LoadStream(receipt.units())
        for _ in stream:
            pass
        if stream.error:
            raise RuntimeError(f"update {receipt.version} failed: {stream.error}")
        with log.open("a") as f:  # every unit arrived and matched its checksum
            f.write(json.dumps({"version": receipt.version, "verified_at": time.time()}) + "\n")
    rx.close()  # lets the relay to the member below finish


def _wait_listening(address: str, port: int, proc, *, timeout_s: float) -> None:
    """Until the learner's weight store accepts connections (reached from this namespace, which
    is on the switch): a generator started before it would find nothing there."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((address, port), timeout=1.0).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(
                    f"the learner's weight store at {address}:{port} never "
                    f"listened (learner exit code {proc.poll()})"
                ) from None
            time.sleep(0.1)


def run_on_hosts(net, learner_argv: list[str], members: list[tuple[str, int]], *,
                 progress: Path, timeout_s: float, wait_s: float,
                 waited: int | None = None) -> list:  # fmt: skip
    """Start the learner (``learner_argv``) on its host, then each member (name, updates to
    take: ``member_main``) on its own, all with ``--timeout-s`` and a fresh ``--progress-dir``
    and this run's weights secret; wait up to ``wait_s`` each for the learner and the first
    ``waited`` members (all by default), kill what is left. Returns their exit codes."""
    shutil.rmtree(progress, ignore_errors=True)
    progress.mkdir(parents=True)
    common = ["--timeout-s", str(timeout_s), "--progress-dir", str(progress)]
    # the children import bench from this clone; the handshake's secret, as a run has it
    env = dict(child_env(None), TETHER_WEIGHTS_SECRET=secrets.token_hex(16))
    learner = net.hosts["learner"]
    procs = [net.popen("learner", [*learner_argv, *common], env=env)]
    _wait_listening(learner.address, PORT, procs[0], timeout_s=120.0)
    member = [sys.executable, "-m", "bench.weights_hosts", "member", "--learner", learner.address,
              *common]  # fmt: skip
    procs += [net.popen(name, [*member, "--name", name, "--count", str(count)], env=env)
              for name, count in members]  # fmt: skip
    try:
        codes = [p.wait(wait_s) for p in procs[: None if waited is None else 1 + waited]]
    except subprocess.TimeoutExpired:
        codes = ["timed out"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes


def _one_n(net, n: int, *, mb: int, tensors: int, chunk_mb: float, repeats: int, mbit: float,
           work: Path) -> dict:  # fmt: skip
    """The learner and ``n`` members on their hosts; the learner's JSON."""
    timeout_s = 60.0 + 4 * n * mb * 8 / mbit  # pairwise: n models through the learner's link
    out = work / f"learner_n{n}.json"
    out.unlink(missing_ok=True)
    learner = [sys.executable, "-m", "bench.weights_hosts", "learner", "--address",
               net.hosts["learner"].address, "--members", str(n), "--mb", str(mb), "--tensors",
               str(tensors), "--chunk-mb", str(chunk_mb), "--repeats", str(repeats),
               "--min-gb-per-s", str(mbit / 8e3 / 4 / n), "--out", str(out)]  # fmt: skip
    codes = run_on_hosts(net, learner, [(f"g{i}", 2 * (repeats + 1)) for i in range(n)],
                         progress=work / f"progress_n{n}", timeout_s=timeout_s,
                         wait_s=timeout_s * 2 * (repeats + 1) + 120)  # fmt: skip
    if any(c != 0 for c in codes) or not out.exists():
        raise RuntimeError(f"weights on hosts, N={n}: exit codes {codes} (learner first)")
    return json.loads(out.read_text())


def run_hosts_bench(
    *, out_path: str | Path | None = None, mbit: float = 200.0, generators=GENERATORS,
    mb: int = 128, tensors: int = 16, chunk_mb: float = 1.0, repeats: int = 2,
    work_dir: str | Path = "bench/work", **_: Any,
) -> dict:  # fmt: skip

    generators = tuple(sorted(set(generators)))
    work = Path(work_dir).resolve() / "weights_hosts"
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    table: dict[str, dict[str, dict]] = {"pairwise": {}, "chain": {}}
    nbytes = 0
    with Hosts() as net:
        net.add("learner", mbit=mbit)
        for i in range(max(generators)):
            net.add(f"g{i}", mbit=mbit)
        for n in generators:
            print(f"weights on hosts: N={n} ({mbit:g} Mbit/s links)", flush=True)
            res = _one_n(net, n, mb=mb, tensors=tensors, chunk_mb=chunk_mb, repeats=repeats,
                         mbit=mbit, work=work)  # fmt: skip
            nbytes = res["bytes"]
            for fanout, rs in res["runs"].items():
                timed = rs[1:]
                best = min(r["seconds"] for r in timed)
                table[fanout][str(n)] = {
                    "seconds": best,
                    "link_copies": min(r["link_bytes"] for r in timed) / nbytes,
                    "link_rate_share": nbytes * 8 / 1e6 / mbit / best,
                    "all": rs,
                }
    lo, hi = str(min(generators)), str(max(generators))
    result = {
        "bench": "weights_hosts",
        "link_mbit": mbit,
        "bytes": nbytes,
        "num_tensors": tensors,
        "chunk_mb": chunk_mb,
        "pieces": nbytes / (chunk_mb * (1 << 20)),
        "piece_seconds_on_link": chunk_mb * (1 << 20) * 8 / 1e6 / mbit,
        "generators": list(generators),
        "one_model_over_one_link_seconds": nbytes * 8 / 1e6 / mbit,
        "scaling": table,
        **{
            f"ratio_{f}_seconds_n{hi}_vs_n{lo}": table[f][hi]["seconds"] / table[f][lo]["seconds"]
            for f in ("chain", "pairwise")
        },  # fmt: skip
        "load_average": [load_before[0], *os.getloadavg()],
        "cpu_count": os.cpu_count(),
    }
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2))
    return result


def readme_row(r: dict) -> str:
    """The bench/README.md row of a result."""
    hi, lo = max(r["generators"]), min(r["generators"])
    ch, pw = r["scaling"]["chain"], r["scaling"]["pairwise"]
    per_n = "; ".join(f"N={n}: chain {ch[str(n)]['seconds']:.1f} s, pairwise "
                      f"{pw[str(n)]['seconds']:.1f} s" for n in r["generators"])  # fmt: skip
    piece_s = r.get("piece_seconds_on_link", r["chunk_mb"] * (1 << 20) * 8 / 1e6 / r["link_mbit"])
    measured = (f"{r['bytes'] / 1e6:.0f} MB in {r['pieces']:.0f} pieces ({piece_s * 1e3:.0f} ms "
                f"each on a link), each host's link "
                f"{r['link_mbit']:g} Mbit/s (one model over one link "
                f"{r['one_model_over_one_link_seconds']:.1f} s): {per_n}")  # fmt: skip
    ratio = (f"chain N={hi} ÷ N={lo} **{r[f'ratio_chain_seconds_n{hi}_vs_n{lo}']:.2f}**, "
             f"pairwise **{r[f'ratio_pairwise_seconds_n{hi}_vs_n{lo}']:.2f}**")  # fmt: skip
    notes = ("each process on its own network namespace (emulated host), links shaped by tc tbf; "
             "best of the timed rounds; the learner's link carried "
             f"{ch[str(hi)]['link_copies']:.2f}× the model down the chain at N={hi}, "
             f"{pw[str(hi)]['link_copies']:.2f}× pairwise")  # fmt: skip
    load = (r.get("machine", {}).get("load_average") or r["load_average"])[0]
    return (
        f"| weights (hosts) | random fp32 tensors | {measured} | {ratio} | {notes} | "
        f"{load:.1f} | `{r.get('command', 'tether bench weights --hosts-mbit')}` |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description="one host of `tether bench weights --hosts-mbit`")
    sub = p.add_subparsers(dest="role", required=True)
    lp = sub.add_parser("learner")
    lp.add_argument("--address", required=True)
    lp.add_argument("--members", type=int, required=True)
    lp.add_argument("--mb", type=int, required=True)
    lp.add_argument("--tensors", type=int, required=True)
    lp.add_argument("--chunk-mb", type=float, required=True)
    lp.add_argument("--repeats", type=int, required=True)
    lp.add_argument("--min-gb-per-s", type=float, required=True)
    lp.add_argument("--out", required=True)
    mp = sub.add_parser("member")
    mp.add_argument("--learner", required=True)
    mp.add_argument("--name", required=True)
    mp.add_argument("--count", type=int, required=True)
    for sp in (lp, mp):
        sp.add_argument("--timeout-s", type=float, required=True)
        sp.add_argument("--progress-dir", required=True, help="a JSON line per verified update")
    a = p.parse_args()
    learner_main(a) if a.role == "learner" else member_main(a)


if __name__ == "__main__":
    process_exit.skip_finalization("the weight sync's gloo groups")  # see process_exit's docstring
    main()
    process_exit.end(0)
