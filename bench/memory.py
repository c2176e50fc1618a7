"""`tether bench memory`: each learner rank's peak memory through its life, on 1 and on 2 gloo
ranks, for a random model of the Qwen2.5-0.5B shape (``--quick``: a small one).

Every rank runs ``bench/memory_worker.py`` under torchrun: sharded start-up, one training step
(one micro-batch of ``seq`` tokens per rank: the same per-rank work at either size, so the
activations do not shrink with the ranks), a checkpoint save, a streamed weight publish to one
receiver process and an export, each phase's peak measured by the process itself (the kernel's
``VmHWM`` reset per phase, and a sampled peak of ``RssAnon``; the worker's docstring says what
is counted). The ratio is the 2-rank run's highest per-rank peak over the 1-rank run's
(target ≤ 0.6: half the model states per rank, plus what does not shard). Before it starts it
checks ``MemAvailable`` against what the 1-rank run needs and refuses to run short of it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.episodes import provenance
from bench.memory_worker import MALLOC_ENV
from tether.demo.tiny_model import build_tiny_model

log = logging.getLogger(__name__)

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B's config.json (tied embeddings, 14 heads of 64, 2 KV heads)
    "qwen2.5-0.5b": {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
                     "intermediate_size": 4864, "vocab_size": 151936},
    "quick": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
              "intermediate_size": 1024, "vocab_size": 32768},
}  # fmt: skip
TARGET = 0.6


def _mem_available() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _run(world: int, model: Path, out: Path, *, seq: int, lora: int = 0) -> list[dict[str, Any]]:
    shutil.rmtree(out, ignore_errors=True)  # the bench's own folder: a previous run's export
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
           "--standalone", "-m", "bench.memory_worker", "--model", str(model), "--out", str(out),
           "--seq", str(seq), "--bucket-mb", "64", "--shard-mb", "256"]  # fmt: skip
    if lora:  # the adapter's publish and export are a few MB: start-up, step and save
        cmd += ["--lora", str(lora), "--phases", "startup,step,save"]
    t0 = time.monotonic()

    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **MALLOC_ENV})
    if proc.returncode != 0:
        raise RuntimeError(f"memory worker ({world} ranks) failed:\n{proc.stderr[-4000:]}")
    log.info("memory bench: %d rank(s) done in %.0f s", world, time.monotonic() - t0)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _peak(ranks: list[dict[str, Any]], key: str) -> int:
    return max(p[key] for r in ranks for p in r["phases"].values())


def derive(r: dict[str, Any]) -> dict[str, Any]:
    """The figures computed from the per-rank records in ``r["ranks"]``: the highest per-rank
    peak at 1 and 2 ranks and their ratios (the runner writes them; a test recomputes them)."""
    one, two = r["ranks"]["1"], r["ranks"]["2"]
    out: dict[str, float] = {
        "peak_rss_1": _peak(one, "peak_rss"),
        "peak_rss_2": _peak(two, "peak_rss"),
        "peak_anon_1": _peak(one, "peak_anon"),
        "peak_anon_2": _peak(two, "peak_anon"),
    }
    out["ratio_peak_rss"] = out["peak_rss_2"] / out["peak_rss_1"]
    out["ratio_peak_anon"] = out["peak_anon_2"] / out["peak_anon_1"]
    return out


LORA_RANK = 16


def run_memory_bench(
    *,
    out_path: Path,
    quick: bool = False,
    work_dir: Path = Path("bench/work"),
    seq: int = 256,
    mode: str = "full",
) -> dict[str, Any]:
    """``mode``: ``full`` (full fine-tuning), ``lora`` (a rank-16 LoRA policy on the frozen
    base: start-up, step and save), ``scale`` (``bench.memory_scale``: the learner step at the
    32B shapes under fake tensors, world size 8, against ``tether plan --memory``)."""
    if mode == "scale":
        from bench.memory_scale import run_scale_bench  # noqa: PLC0415 - loads torch

        return run_scale_bench(out_path=out_path, quick=quick)
    if mode not in ("full", "lora"):
        raise ValueError(f"bench memory --size {mode!r}: choose full, lora or scale")

    lora = LORA_RANK if mode == "lora" else 0
    shape_name = "quick" if quick else "qwen2.5-0.5b"
    shape = SHAPES[shape_name]
    model = build_tiny_model(work_dir / f"memory-{shape_name}", **shape)
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))  # fp32 on disk
    need = (2 if lora else 5) * weights  # 1 rank: weights (+ gradients, 2 AdamW moments)
    available = _mem_available()
    if available < need:
        raise RuntimeError(
            f"bench memory needs about {need / 2**30:.1f} GiB free for the 1-rank run of the "
            f"{shape_name} shape and {available / 2**30:.1f} GiB are available: run it when the "
            "machine is quieter, or with --quick"
        )
    runs = {}
    for world in (1, 2):
        runs[world] = _run(world, model, work_dir / f"memory-out-{shape_name}-{world}", seq=seq,
                           lora=lora)  # fmt: skip
    result = {
        "bench": "memory",
        "shape": shape_name,
        "lora_rank": lora,
        "model_shape": shape,
        "weights_fp32_bytes": weights,
        "seq_per_rank": seq,
        "ranks": {str(w): r for w, r in runs.items()},
        "target": TARGET,
        "machine": {"load_average": list(os.getloadavg()), "mem_available_bytes": available},
        **provenance(),
    }
    result.update(derive(result))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    print(format_memory(result))
    return result


def format_memory(r: dict[str, Any]) -> str:
    """Per phase: the highest per-rank peak at 1 and 2 ranks (GiB), then the ratios."""
    gib = 2**30
    phases = list(r["ranks"]["1"][0]["phases"])
    lines = [
        "| phase | 1 rank: peak RSS (anon) | 2 ranks: highest rank's peak RSS (anon) |",
        "|---|---|---|",
    ]
    for ph in phases:
        one = r["ranks"]["1"][0]["phases"][ph]
        two = r["ranks"]["2"]
        rss2 = max(x["phases"][ph]["peak_rss"] for x in two)
        anon2 = max(x["phases"][ph]["peak_anon"] for x in two)
        lines.append(
            f"| {ph} | {one['peak_rss'] / gib:.2f} ({one['peak_anon'] / gib:.2f}) GiB "
            f"| {rss2 / gib:.2f} ({anon2 / gib:.2f}) GiB |"
        )
    lines.append(
        f"| **peak** | {r['peak_rss_1'] / gib:.2f} ({r['peak_anon_1'] / gib:.2f}) GiB "
        f"| {r['peak_rss_2'] / gib:.2f} ({r['peak_anon_2'] / gib:.2f}) GiB: "
        f"**{r['ratio_peak_rss']:.2f}×** ({r['ratio_peak_anon']:.2f}× anon), target ≤ "
        f"{r['target']} |"
    )
    return "\n".join(lines)


def row_memory(r: dict[str, Any]) -> str:
    """The row of bench/README.md's results table."""
    load = r.get("machine", {}).get("load_average", [float("nan")])[0]
    quick = r["shape"] == "quick"
    lora = r.get("lora_rank", 0)
    what = f"LoRA rank {lora} on the frozen " if lora else ""
    flags = (" --quick" if quick else "") + (" --size lora" if lora else "")
    return (
        f"| memory | {what}{r['shape']} shape, {r['weights_fp32_bytes'] / 2**30:.2f} GiB fp32, "
        f"1 vs 2 gloo ranks | per-rank peak RSS, 2 ranks ÷ 1 rank | "
        f"**{r['ratio_peak_rss']:.2f}** (anon {r['ratio_peak_anon']:.2f}) | ≤ {r['target']} "
        f"| {load:.1f} | `tether bench memory{flags}` |"
    )
