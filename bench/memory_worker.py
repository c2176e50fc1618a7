"""torchrun entry of `tether bench memory` and tests/services/test_rank_memory.py: each rank's
peak memory in each phase of the learner's life, measured by the process itself.

    torchrun --nproc_per_node N -m bench.memory_worker --model DIR --out DIR [--phases ...]

Phases, in order (each through the learner's own functions): ``startup`` (``load_policy``,
sharded start-up, and the optimizer), ``step`` (one ``train_step``: gradients and AdamW's state
appear), ``save`` (``save_checkpoint``), ``publish`` (a streamed weight publish to one real
receiver process, ``tests/procs/weight_receiver.py``), ``export`` (``export_hf`` of the live
model). ``--lora R``: the policy is a LoRA adapter of rank R on the frozen base (sharded
start-up on the meta model; run it with ``--phases startup,step,save``). ``--reference`` then measures the paths they replaced, one at a time: the whole model
loaded by every rank (``from_pretrained``, then sharded), the whole bf16 state gathered on rank 0
and published from memory, the whole fp32 state gathered for an export.

What is counted, per phase and rank: ``peak_rss`` = the kernel's high-water mark of the resident
set (``VmHWM``, reset at the phase's start through ``/proc/self/clear_refs``): anonymous memory
plus the file pages mapped and touched (shared libraries, memory-mapped safetensors files) and
shared memory; ``peak_anon`` = the highest ``RssAnon`` seen by a thread sampling every 10 ms
(the process's own heap: tensors, optimizer state, buffers); both also as the growth over the
phase's start (``*_growth``). The page cache of files read or written is not counted (it is
not the process's, and the kernel drops it under pressure). The libraries a phase uses are
imported before the first phase (their import is not the phase's memory). Run it with glibc's
``MALLOC_MMAP_THRESHOLD_`` fixed (the bench and the test set 64 KiB): freed tensors then leave
the RSS at once, instead of staying on glibc's heap, where a later phase would reuse them
unseen and a phase's peak would not be its own. Rank R writes ``DIR/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common.ports import free_port
from common.service import process_exit
from common.weights.layout import build_layout
from common.weights.publisher import WeightPublisher
from services.learner import gather
from services.learner.checkpoint import save_checkpoint
from services.learner.export import export_hf
from services.learner.gather import full_state_dict_cpu
from services.learner.lora import LoraSettings
from services.learner.model import (
    _shard,
    load_policy,
    setup_distributed,
    token_logprobs_and_entropy,
)
from services.learner.optim import build_optimizer, build_schedule, build_scheduler
from services.learner.train_step import train_step

PHASES = ("startup", "step", "save", "publish", "export")


def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of this process, in bytes."""
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class Meter:
    """Per-phase peaks of this process (see the module docstring)."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, Any]] = {}
        self._peak_anon = 0
        self._on = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            if self._on.is_set():
                self._peak_anon = max(self._peak_anon, _status()["RssAnon"])
            time.sleep(0.01)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # reset VmHWM to the current RSS
        start = _status()
        self._peak_anon = start["RssAnon"]
        self._on.set()
        t0 = time.monotonic()
        try:
            yield
        finally:
            self._on.clear()
            end = _status()
            peak_anon = max(self._peak_anon, end["RssAnon"])
            self.phases[name] = {
                "seconds": round(time.monotonic() - t0, 2),
                "peak_rss": end["VmHWM"],
                "peak_rss_growth": end["VmHWM"] - start["VmRSS"],
                "peak_anon": peak_anon,
                "peak_anon_growth": peak_anon - start["RssAnon"],
                "end_rss": end["VmRSS"],
                "end_file": end["RssFile"],
                "end_shmem": end["RssShmem"],
            }


def _batch(vocab: int, *, rows: int, seq: int, rank: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, vocab, (rows, seq), generator=gen)
    response = torch.zeros_like(ids)
    response[:, seq // 4 :] = 1
    return {"ids": ids, "resp": response, "tokens": float(response.sum())}


def _start_receiver(port: int, out: Path, *, count: int) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).parents[1] / "tests" / "procs" / "weight_receiver.py"),
           "--port", str(port), "--member", "mem-0", "--timeout", "600", "--count", str(count),
           "--log", str(out / "receiver.jsonl")]  # fmt: skip
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _publish(model: Any, pub: Any, *, version: int, device: Any) -> Any:
    """The learner's streamed publish (``LearnerService.publish`` without the bus)."""
    import torch

    items = gather.publish_items(model)
    specs = gather.publish_specs(items, torch.bfloat16)
    session = pub.begin(specs, version) if pub is not None else None
    layout = session.layout if session is not None else build_layout(specs, version, pub_bucket())
    gather.stream_publish(items, layout=layout, dtype=torch.bfloat16, session=session,
                          device=device)  # fmt: skip
    return session.close() if session is not None else None


_BUCKET = [64 << 20]


def pub_bucket() -> int:
    return _BUCKET[0]


def _reference(args: argparse.Namespace, meter: Meter, pub: Any, *, rank: int, device: Any) -> None:
    """The paths the phases replaced, each measured alone."""
    import torch
    from transformers import AutoModelForCausalLM

    with meter.phase("ref_startup_whole"):
        whole = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        _shard(whole, device=device, param_dtype=torch.float32)
    with meter.phase("ref_publish_whole"):
        state = full_state_dict_cpu(whole, dtype=torch.bfloat16)
        if pub is not None:
            pub.publish(state.items(), 2)
        del state
    with meter.phase("ref_export_gather_whole"):
        state = full_state_dict_cpu(whole, drop_tied=False)
        del state


def _touch(model: Any) -> None:
    """Read every local shard once. On CPU, fp32 shards of an fp32 checkpoint are views of the
    mapped safetensors files (no copy), so their pages are only resident after a first read; the
    start-up phase counts them as resident, as a step would make them."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            float(local.float().sum())


def _warm_imports(model_dir: str) -> None:
    """Import what the phases use (the model's own class included), outside every phase."""
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import transformers.core_model_loading  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class

    _get_model_class(AutoConfig.from_pretrained(model_dir), AutoModelForCausalLM._model_mapping)


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--shard-mb", type=float, default=256.0)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rows", type=int, default=1, help="sequences per rank in the step")
    parser.add_argument("--lora", type=int, default=0, help="a LoRA policy of this rank (0: none)")
    args = parser.parse_args()
    phases = args.phases.split(",")
    out = Path(args.out)
    meter = Meter()
    _BUCKET[0] = int(args.bucket_mb * 2**20)

    import torch

    rank, world, device = setup_distributed()
    _warm_imports(args.model)
    base = _status()

    lora = LoraSettings(rank=args.lora, alpha=2 * args.lora) if args.lora else None
    with meter.phase("startup"):
        model = load_policy(args.model, device=device, lora=lora)
        optimizer = build_optimizer(model, lr=1e-5)
        scheduler = build_scheduler(optimizer, build_schedule(warmup_steps=1))
        _touch(model)
    if "step" in phases:
        batch = _batch(int(model.config.vocab_size), rows=args.rows, seq=args.seq, rank=rank)
        total = torch.tensor([batch["tokens"]])
        torch.distributed.all_reduce(total)

        def loss_fn(m: Any, mb: Any) -> Any:
            ones = torch.ones_like(mb["ids"])
            logp, _ = token_logprobs_and_entropy(m, mb["ids"], ones, mb["resp"])
            return -(logp * mb["resp"]).sum() / total.item()

        with meter.phase("step"):
            train_step(model, optimizer, scheduler, [batch], loss_fn, grad_clip=1.0)
    if "save" in phases:
        with meter.phase("save"):
            save_checkpoint(out / "run", 1, model=model, optimizer=optimizer,
                            scheduler=scheduler, extra_state={})  # fmt: skip
    pub = receiver = None
    if ("publish" in phases or args.reference) and rank == 0:
        pub = WeightPublisher("127.0.0.1", free_port(), timeout_s=600.0,
                              bucket_bytes=pub_bucket())  # fmt: skip
        count = ("publish" in phases) + bool(args.reference)
        receiver = _start_receiver(pub.port, out, count=count)
        while not pub.members():
            time.sleep(0.1)
    report = None
    if "publish" in phases:
        torch.distributed.barrier()
        with meter.phase("publish"):
            report = _publish(model, pub, version=1, device=device)
    if "export" in phases:
        with meter.phase("export"):
            export_hf(model, out / "export", args.model, shard_bytes=int(args.shard_mb * 2**20))
    if args.reference:
        _reference(args, meter, pub, rank=rank, device=device)
    if receiver is not None:
        receiver.wait(timeout=600)
    result = {
        "rank": rank,
        "world_size": world,
        "baseline_rss": base["VmRSS"],
        "phases": meter.phases,
        "publish": None
        if report is None
        else {"checksum": report.checksum, "bytes": report.bytes, "per_member": report.per_member},
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    if pub is not None:
        # let go of the weight store, its accept thread and the members' groups here, in order,
        # not in the interpreter's teardown: left to it, rank 0 once aborted at exit ("terminate
        # called without an active exception", CI at 703a737) after writing its result
        pub.close()
        del pub, report
        gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    process_exit.skip_finalization("gloo process groups")  # see process_exit's docstring
    main()
    process_exit.end(0)
