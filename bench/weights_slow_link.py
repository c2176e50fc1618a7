"""`tether bench weights --hosts-mbit R --slow-link F`: one generator behind a link F times slower
than the others' (issue 46 item 5), each process on a host of its own (``bench.hosts``), as in
``bench.weights_hosts``, whose member processes this reuses.

A publish lasts until every generator has the version (the learner waits for it before its
next step), and every generator below a slow one in a chain gets it at that one's rate. With
``weights.slow_link_fraction`` a chain round compares when each generator had the update with
the one above it, and one far later leaves the chain; it is then sent the latest version in the
background from a copy the learner holds (``common.weights.roster``). The slow generator is
named to sort first, so the chain starts with it: every generator is held to its rate, and it
takes two rounds to find (the first moves it down the chain, the second judges it).

Four arms, each a fresh learner and fresh members on the same hosts, ``publishes`` versions
each:

- ``fast_only``: the fast generators alone (the reference);
- ``rule_on``: the fast generators and the slow one, the rule on (0.25);
- ``rule_on_again``: the same arm again (the control: how far two runs of one arm differ);
- ``rule_off``: the rule off (``slow_link_fraction = 0``): the slow one stays in the chain.

Per publish: the learner's seconds (``publish`` returning: what a learner's step waits for) and
the seconds until every fast generator has verified the version. Each arm's figures are medians
over its publishes from the third on (``SETTLED``: after the two that find the slow one). The
slow generator's versions (which it had, and when) say how far behind it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.hosts import Hosts
from bench.weights_hosts import PORT, _wait_verified, run_on_hosts
from common.service import process_exit
from common.weights.handshake import secret_from_env
from common.weights.publisher import WeightPublisher
from common.weights.roster import MEASURE_MIN_BYTES

ARMS = ("fast_only", "rule_on", "rule_off", "rule_on_again")
SLOW = "g0"  # first in the chain's order (by name): the fast ones are g1, g2, ...
SETTLED = 2  # publishes before the figures: the slow one is found by then


def learner_main(a: argparse.Namespace) -> None:
    """The learner's host: ``publishes`` versions down the chain, each timed until the fast
    members verified it, then waits for the slow member (if any) to have the last one."""
    import torch

    numel = a.mb * (1 << 20) // 4 // a.tensors
    g = torch.Generator().manual_seed(0)
    named = [(f"w{i}", torch.randn(numel, generator=g)) for i in range(a.tensors)]
    fast = set(a.fast.split(","))
    members = len(fast) + (1 if a.with_slow else 0)
    pub = WeightPublisher(a.address, PORT, timeout_s=a.timeout_s,
                          chunk_bytes=int(a.chunk_mb * (1 << 20)), min_gb_per_s=a.min_gb_per_s,
                          secret=secret_from_env(),
                          slow_link_fraction=a.slow_fraction)  # fmt: skip
    runs: list[dict] = []
    progress = Path(a.progress_dir)
    try:
        deadline = time.monotonic() + a.timeout_s
        while len(pub.members()) < members:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(pub.members())} of {members} members joined")
            time.sleep(0.05)
        for version in range(1, a.publishes + 1):
            t0 = time.time()
            report = pub.publish(named, version)
            if set(report.per_member.values()) != {"ok"}:
                raise RuntimeError(f"publish {version} failed: {report.per_member}")
            done = _wait_verified(progress, len(fast), version, a.timeout_s, names=fast)
            runs.append({"version": version, "seconds": max(done) - t0,
                         "learner_seconds": report.seconds, "members": sorted(report.per_member),
                         "root_bytes": report.root_bytes, "slow": report.slow})  # fmt: skip
        slow_end = None
        if a.with_slow:  # the slow member ends on the last version (sent in the background)
            t_last = time.time()
            done = _wait_verified(progress, 1, a.publishes, 3 * a.timeout_s, names={SLOW})
            slow_end = max(done) - t_last
    finally:
        pub.close()
    out = {"bytes": numel * 4 * a.tensors, "runs": runs, "slow_had_last_after_s": slow_end}
    Path(a.out).write_text(json.dumps(out))


def _slow_versions(progress: Path) -> list[dict]:
    f = progress / f"{SLOW}.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def _arm(net, arm: str, *, fast: list[str], mb: int, tensors: int, chunk_mb: float,
         publishes: int, mbit: float, slow_mbit: float, work: Path) -> dict:  # fmt: skip
    """One arm: a learner and its members on their hosts; the learner's JSON, with the slow
    member's versions."""
    with_slow = arm != "fast_only"
    fraction = 0.0 if arm == "rule_off" else 0.25
    n = len(fast) + with_slow
    # pairwise (the measuring round) carries n models through the learner's link; the slow link
    # one model at its own rate; either may be the longest
    timeout_s = 60.0 + 2 * max(n * mb * 8 / mbit, mb * 8 / slow_mbit)
    progress = work / f"progress_{arm}"
    out = work / f"learner_{arm}.json"
    out.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "bench.weights_slow_link", "--address",
            net.hosts["learner"].address, "--fast", ",".join(fast), "--mb", str(mb), "--tensors",
            str(tensors), "--chunk-mb", str(chunk_mb), "--publishes", str(publishes),
            "--min-gb-per-s", str(min(mbit / n, slow_mbit) / 8e3 / 4), "--slow-fraction",
            str(fraction), "--out", str(out), *(["--with-slow"] if with_slow else [])]  # fmt: skip
    members = [(name, publishes) for name in fast + ([SLOW] if with_slow else [])]
    # the learner and the fast members end; the slow member may still wait for versions
    codes = run_on_hosts(net, argv, members, progress=progress, timeout_s=timeout_s,
                         wait_s=timeout_s * (publishes + 3) + 120, waited=len(fast))  # fmt: skip
    # the learner writes its JSON before it exits: a failure at its exit is recorded, not lost
    # (once here a learner aborted at exit, "terminate called without an active exception")
    if any(c != 0 for c in codes[1:]) or not out.exists() or codes[0] == "timed out":
        raise RuntimeError(f"slow link, arm {arm}: exit codes {codes} (learner first)")
    res = json.loads(out.read_text())
    res["slow_versions"] = _slow_versions(progress)
    res["learner_exit_code"] = codes[0]
    return res


def run_slow_link_bench(
    *, out_path: str | Path | None = None, mbit: float = 200.0, factor: float = 10.0,
    fast: int = 3, mb: int = 72, tensors: int = 18, chunk_mb: float = 4.0, publishes: int = 6,
    work_dir: str | Path = "bench/work", **_: Any,
) -> dict:  # fmt: skip
    """The four arms (module docstring); returns and writes the JSON."""
    if publishes <= SETTLED:
        raise ValueError(f"publishes must be over {SETTLED} (the ones that find the slow link)")
    if mb * (1 << 20) < MEASURE_MIN_BYTES:
        raise ValueError(f"the model ({mb} MiB) is too small to measure a link on "
                         f"(MEASURE_MIN_BYTES: {MEASURE_MIN_BYTES >> 20} MiB)")  # fmt: skip
    work = Path(work_dir).resolve() / "weights_slow_link"
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    slow_mbit = mbit / factor
    names = [f"g{i}" for i in range(1, fast + 1)]
    arms: dict[str, dict] = {}
    with Hosts() as net:
        net.add("learner", mbit=mbit)
        for name in names:
            net.add(name, mbit=mbit)
        net.add(SLOW, mbit=slow_mbit)
        for arm in ARMS:
            print(
                f"slow link: {arm} ({fast} generators at {mbit:g} Mbit/s"
                f"{'' if arm == 'fast_only' else f', one at {slow_mbit:g}'})",
                flush=True,
            )
            res = _arm(
                net,
                arm,
                fast=names,
                mb=mb,
                tensors=tensors,
                chunk_mb=chunk_mb,
                publishes=publishes,
                mbit=mbit,
                slow_mbit=slow_mbit,
                work=work,
            )
            settled = res["runs"][SETTLED:]
            learner = [r["learner_seconds"] for r in settled]
            arms[arm] = {
                "median_learner_seconds": statistics.median(learner),
                "min_learner_seconds": min(learner),
                "max_learner_seconds": max(learner),
                "median_fast_verified_seconds": statistics.median(r["seconds"] for r in settled),
                "first_publishes_learner_seconds": [
                    r["learner_seconds"] for r in res["runs"][:SETTLED]
                ],
                **res,
            }
    nbytes = arms["fast_only"]["bytes"]
    ref = arms["fast_only"]["median_learner_seconds"]
    result = {
        "bench": "weights_slow_link",
        "link_mbit": mbit,
        "slow_link_mbit": slow_mbit,
        "fast_generators": fast,
        "bytes": nbytes,
        "chunk_mb": chunk_mb,
        "publishes": publishes,
        "one_model_over_a_fast_link_seconds": nbytes * 8 / 1e6 / mbit,
        "one_model_over_the_slow_link_seconds": nbytes * 8 / 1e6 / slow_mbit,
        "arms": arms,
        "settled_from_publish": SETTLED + 1,
        **{
            f"ratio_{arm}_vs_fast_only": arms[arm]["median_learner_seconds"] / ref
            for arm in ARMS[1:]
        },
        "ratio_control_rule_on_again_vs_rule_on": (
            arms["rule_on_again"]["median_learner_seconds"]
            / arms["rule_on"]["median_learner_seconds"]
        ),
        "load_average": [load_before[0], *os.getloadavg()],
        "cpu_count": os.cpu_count(),
    }
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2))
    return result


def readme_row(r: dict) -> str:
    """The bench/README.md row of a result."""
    a = r["arms"]
    med = {k: a[k]["median_learner_seconds"] for k in ARMS}
    measured = (
        f"{r['bytes'] / 1e6:.0f} MB, {r['fast_generators']} generators at {r['link_mbit']:g} "
        f"Mbit/s and one at {r['slow_link_mbit']:g}, first in the chain (one model over a fast "
        f"link {r['one_model_over_a_fast_link_seconds']:.1f} s, over the slow one "
        f"{r['one_model_over_the_slow_link_seconds']:.1f} s); median publish (the learner's "
        f"wait), publishes {r['settled_from_publish']}-{r['publishes']}: the fast ones alone "
        f"{med['fast_only']:.1f} s, with the slow one {med['rule_on']:.1f} s (again: "
        f"{med['rule_on_again']:.1f} s), rule off {med['rule_off']:.1f} s"
    )
    ratio = (
        f"with the slow one ÷ fast alone **{r['ratio_rule_on_vs_fast_only']:.2f}**, rule off "
        f"**{r['ratio_rule_off_vs_fast_only']:.2f}**; control (the same arm twice) "
        f"{r['ratio_control_rule_on_again_vs_rule_on']:.2f}"
    )
    on = a["rule_on"]
    got = [v["version"] for v in on["slow_versions"]]
    first = ", ".join(f"{x:.1f}" for x in on["first_publishes_learner_seconds"])
    notes = (
        f"weights.slow_link_fraction 0.25: publishes 1-{len(on['first_publishes_learner_seconds'])}"
        f" ({first} s) find the slow generator, which then leaves the chain and is sent the "
        f"latest version in the background: it had versions {got} of {r['publishes']}, the last "
        f"{on['slow_had_last_after_s']:.1f} s after it was published"
    )
    load = (r.get("machine", {}).get("load_average") or r["load_average"])[0]
    return (
        f"| weights (slow link) | random fp32 tensors | {measured} | {ratio} | {notes} | "
        f"{load:.1f} | `{r.get('command', 'tether bench weights --hosts-mbit')}` |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description="the learner's host of the slow-link benchmark")
    p.add_argument("--address", required=True)
    p.add_argument("--fast", required=True, help="the fast members' names, comma-separated")
    p.add_argument("--with-slow", action="store_true", help="a slow member joins too")
    p.add_argument("--mb", type=int, required=True)
    p.add_argument("--tensors", type=int, required=True)
    p.add_argument("--chunk-mb", type=float, required=True)
    p.add_argument("--publishes", type=int, required=True)
    p.add_argument("--min-gb-per-s", type=float, required=True)
    p.add_argument("--slow-fraction", type=float, required=True)
    p.add_argument("--timeout-s", type=float, required=True)
    p.add_argument("--progress-dir", required=True)
    p.add_argument("--out", required=True)
    learner_main(p.parse_args())


if __name__ == "__main__":
    process_exit.skip_finalization("the weight sync's gloo groups")  # see process_exit's docstring
    main()
    process_exit.end(0)
