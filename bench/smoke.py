"""`make bench-smoke`: every `tether bench NAME` at its smallest size (``--quick``), each under a
time limit, into a scratch folder; fails when one does not run to the end or writes no stamped
result. Benchmarks nothing (the machine may be busy): it keeps the benchmarks from rotting
between the runs that produce the README's figures, and must pass before a figure is claimed.

    python -m bench.smoke [NAME ...] [--root DIR]     # default: every benchmark, bench/work/smoke

Each benchmark runs as `python -m tether.cli bench NAME --quick --out DIR/results --work-dir
DIR/work` in a child process (``bench.child_process``: stopped with its children on a timeout
or Ctrl-C). The seconds each took are printed and written to ``DIR/smoke.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import child_process
from bench.provenance import CLONE
from bench.runner import ORDER

# seconds each benchmark's smallest size may take on this project's 2-core machine, with room
# for a busy one (measured: see bench/README.md, "Smoke run")
LIMITS = {
    "bus": 300, "weights": 300, "scorer": 300, "generator": 600, "episodes": 900, "learner": 600,
    "pipeline": 1200, "peer": 1200, "quality": 1500, "staleness": 1200, "reproducibility": 1200,
    "models": 1800,
    # not yet timed by a smoke run: the 1200 s default until one is
    "memory": 1200, "lora": 1200, "demos": 1200, "replay": 1200,
    "race": 1800,  # TRL and Tether 180 s of RL each, start-ups, shutdown, the evaluator: ~15 min
}  # fmt: skip
DEFAULT_LIMIT_S = 1200  # a benchmark added to the runner before it is given its own limit


def run_smoke(name: str, *, root: Path) -> dict[str, Any]:
    """One benchmark's smallest size; what happened."""
    out = root / "results"
    cmd = [sys.executable, "-m", "tether.cli", "bench", name, "--quick", "--out", str(out),
           "--work-dir", str(root / "work")]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(CLONE))
    started = time.monotonic()
    try:
        proc = child_process.run(cmd, timeout_s=LIMITS.get(name, DEFAULT_LIMIT_S), env=env)
        code, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        code, tail = None, f"over its limit of {LIMITS.get(name, DEFAULT_LIMIT_S)} s: stopped"
    seconds = time.monotonic() - started
    stamped = [
        f.name
        for f in [*out.glob(f"{name}*.json"), *out.glob(f"{name}/*.json")]  # demos/<kind>
        if f.stat().st_mtime >= time.time() - seconds - 1
        and (json.loads(f.read_text()).get("git") or {}).get("commit")
    ]
    ok = code == 0 and bool(stamped)
    return {"name": name, "ok": ok, "exit_code": code, "seconds": seconds, "results": stamped,
            "limit_s": LIMITS.get(name, DEFAULT_LIMIT_S), "tail": "" if ok else tail}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.smoke", description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(ORDER)}")
    ap.add_argument("--root", default=str(CLONE / "bench" / "work" / "smoke"))
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in ORDER]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}: choose from {', '.join(ORDER)}")
    root = Path(args.root).resolve()
    shutil.rmtree(root / "results", ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.names or ORDER:
        row = run_smoke(name, root=root)
        rows.append(row)
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {name:10s} {row['seconds']:6.0f} s "
              f"(limit {row['limit_s']} s) {' '.join(row['results'])}", flush=True)  # fmt: skip
        if not row["ok"]:
            print(row["tail"], flush=True)
    total = sum(r["seconds"] for r in rows)
    load = os.getloadavg()
    print(f"total {total:.0f} s, load average {load[0]:.1f}")
    (root / "smoke.json").write_text(json.dumps({"rows": rows, "total_s": total,
                                                 "load_average": list(load)}, indent=2))  # fmt: skip
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
