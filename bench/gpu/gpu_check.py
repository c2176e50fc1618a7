"""`make gpu-check`: the learner's GPU path in one run, on one H100/H200 with torch and
transformers only (no vLLM), in at most ~8 minutes; one JSON with the commit.

    python -m bench.gpu.gpu_check [--out bench/results/gpu/gpu_check.json] [--dry-run]

At a Qwen2.5-3B shape (36 layers, hidden 2048, vocabulary 151936; random weights), in bf16
compute with fp32 master weights, through the learner's own functions:

- ``full``: sharded start-up, an optimizer step, a checkpoint save, a second step, a resume from
  the checkpoint and the second step again (its loss must repeat), and a streamed publish to a
  local receiver process (``tests/procs/weight_receiver.py``, gloo: a second NCCL member on the
  same GPU is refused) whose checksum must match; each phase's peak GPU memory
  (``torch.cuda.max_memory_allocated``) beside ``tether plan --memory``'s phase terms
  (``memory_plan.phase_peaks``, one rank).
- ``offload``: the same start-up, step and save with ``learner.cpu_offload`` (the process group
  is ``cpu:gloo,cuda:nccl``, ``model.process_group_backend``).
- ``packing``: one batch of uneven sequences, padded and packed (``packing.add_packed``),
  through one model: the largest log-prob difference and each forward+backward's seconds.

Every section is recorded even when another fails (its error and traceback in the JSON).
``--dry-run``: the same sections on this CPU at a tiny shape, in fp32 (what
``tests/services/test_gpu_check.py`` runs, so that the script cannot rot).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.memory_worker import _publish, _start_receiver
from bench.provenance import device_name, git_state
from common.ports import free_port
from common.service import process_exit
from common.service.stack import stack_problems
from common.weights.publisher import WeightPublisher
from services.learner import packing
from services.learner.checkpoint import load_checkpoint, save_checkpoint
from services.learner.model import load_policy, setup_distributed, token_logprobs_and_entropy
from services.learner.optim import build_optimizer, build_schedule, build_scheduler
from services.learner.train_step import train_step
from tether.demo.tiny_model import build_tiny_model
from tether.runs.memory_plan import ModelShape, phase_peaks

SHAPE_3B: dict[str, Any] = {"hidden_size": 2048, "num_layers": 36, "num_heads": 16, "num_kv_heads": 2,
            "intermediate_size": 11008, "vocab_size": 151936}  # fmt: skip
SHAPE_TINY: dict[str, Any] = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
              "intermediate_size": 128, "vocab_size": 512}  # fmt: skip
TOKENS = {False: 4096, True: 64}  # one micro-batch per step, by --dry-run
DEFAULT_OUT = Path("bench/results/gpu/gpu_check.json")


class Memory:
    """Each phase's peak device memory (CUDA; ``None`` on the CPU dry run)."""

    def __init__(self, device: Any) -> None:
        self.cuda = device.type == "cuda"
        self.phases: dict[str, Any] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() if self.cuda else None
        self.phases[name] = {"seconds": round(time.perf_counter() - t0, 3), "peak_bytes": peak}


def _shape(dry_run: bool) -> Any:
    s = SHAPE_TINY if dry_run else SHAPE_3B
    return ModelShape(name="gpu-check", hidden=s["hidden_size"], layers=s["num_layers"],
                      heads=s["num_heads"], kv_heads=s["num_kv_heads"],
                      head_dim=s["hidden_size"] // s["num_heads"],
                      intermediate=s["intermediate_size"], vocab=s["vocab_size"], tied=True,
                      qkv_bias=True)  # fmt: skip


def _batch(vocab: int, tokens: int, device: Any) -> dict[str, Any]:
    import torch

    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    resp = torch.ones_like(ids)
    resp[:, : tokens // 8] = 0  # a prompt, then the response
    return {"ids": ids.to(device), "resp": resp.to(device), "attn": torch.ones_like(ids).to(device)}


def _loss_fn(tokens: float) -> Callable[[Any, Any], Any]:
    def loss(m: Any, mb: Any) -> Any:
        logp, _ = token_logprobs_and_entropy(m, mb["ids"], mb["attn"], mb["resp"])
        return -(logp * mb["resp"]).sum() / tokens

    return loss


def _versus_plan(mem: Memory, shape: Any, *, offload: bool, tokens: int) -> dict[str, Any]:
    plan = phase_peaks(shape, ranks=1, offload=offload, tokens_per_micro_batch=tokens)
    pairs = {"step": "forward_backward", "save": "checkpoint", "publish": "publish"}
    out = {}
    for phase, key in pairs.items():
        got = mem.phases.get(phase, {}).get("peak_bytes")
        out[phase] = {"measured": got, "plan": plan[key],
                      "plan_over_measured": plan[key] / got if got else None}  # fmt: skip
    return out


def section_full(ctx: dict[str, Any]) -> dict[str, Any]:
    device, tokens, work = ctx["device"], ctx["tokens"], ctx["work"]
    mem = Memory(device)
    batch = _batch(ctx["shape"].vocab, tokens, device)
    loss_fn = _loss_fn(float(batch["resp"].sum()))
    with mem.phase("load"):
        model = load_policy(ctx["model_dir"], device=device)
        opt = build_optimizer(model, lr=1e-5)
        sched = build_scheduler(opt, build_schedule(warmup_steps=1))
    with mem.phase("step"):
        first = train_step(model, opt, sched, [batch], loss_fn, grad_clip=1.0)
    with mem.phase("save"):
        save_checkpoint(work / "run", 1, model=model, optimizer=opt, scheduler=sched,
                        extra_state={})  # fmt: skip
    second = train_step(model, opt, sched, [batch], loss_fn, grad_clip=1.0)
    with mem.phase("resume"):
        load_checkpoint(work / "run", model=model, optimizer=opt, scheduler=sched)
        again = train_step(model, opt, sched, [batch], loss_fn, grad_clip=1.0)
    pub = WeightPublisher("127.0.0.1", free_port(), timeout_s=300.0)
    receiver = _start_receiver(pub.port, work, count=1)
    try:
        deadline = time.monotonic() + 120
        while not pub.members() and time.monotonic() < deadline:
            time.sleep(0.1)
        with mem.phase("publish"):
            report = _publish(model, pub, version=1, device=device)
        receiver.wait(timeout=300)
    finally:
        pub.close()
        if receiver.poll() is None:
            receiver.kill()
    events = [json.loads(x) for x in (work / "receiver.jsonl").read_text().splitlines()]
    got = [e.get("checksum") for e in events if e["event"] == "update"]
    shutil.rmtree(work / "run", ignore_errors=True)  # the disk: a 3B checkpoint is ~36 GB
    return {
        "losses": [first.loss, second.loss, again.loss],
        "resumed_loss_abs_diff": abs(again.loss - second.loss),
        "publish": {
            "bytes": report.bytes,
            "checksum_matches": got == [report.checksum],
            "per_member": report.per_member,
        },  # fmt: skip
        "phases": mem.phases,
        "versus_plan": _versus_plan(mem, ctx["shape"], offload=False, tokens=tokens),
    }


def section_offload(ctx: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    device, tokens, work = ctx["device"], ctx["tokens"], ctx["work"]
    mem = Memory(device)
    batch = _batch(ctx["shape"].vocab, tokens, device)
    with mem.phase("load"):
        model = load_policy(ctx["model_dir"], device=device, offload=True)
        opt = build_optimizer(model, lr=1e-5)
        sched = build_scheduler(opt, build_schedule(warmup_steps=1))
    loss_fn = _loss_fn(float(batch["resp"].sum()))
    with mem.phase("step"):
        step = train_step(model, opt, sched, [batch], loss_fn, grad_clip=1.0)
    with mem.phase("save"):
        save_checkpoint(work / "run-offload", 1, model=model, optimizer=opt, scheduler=sched,
                        extra_state={})  # fmt: skip
    shutil.rmtree(work / "run-offload", ignore_errors=True)
    return {
        "process_group": str(dist.get_backend_config()),
        "loss": step.loss,
        "grad_norm": step.grad_norm,
        "phases": mem.phases,
        "versus_plan": _versus_plan(mem, ctx["shape"], offload=True, tokens=tokens),
    }


def section_packing(ctx: dict[str, Any]) -> dict[str, Any]:
    import torch

    device, tokens = ctx["device"], ctx["tokens"]
    model = load_policy(ctx["model_dir"], device=device, pack_sequences=True)
    gen = torch.Generator().manual_seed(1)
    lengths = [tokens // 4, tokens // 2, tokens // 8, tokens // 3]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    attn, resp = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(3, ctx["shape"].vocab, (n,), generator=gen)
        attn[b, :n] = 1
        resp[b, n // 4 : n] = 1
    batch = packing.add_packed({"input_ids": ids, "attention_mask": attn, "response_mask": resp},
                               pad_id=0)  # fmt: skip
    batch = {k: v.to(device) for k, v in batch.items()}
    out: dict[str, Any] = {"lengths": lengths, "attention": packing.attention_implementation(model)}
    logps = {}
    autocast: Any = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    for name, packed in (("padded", None), ("packed", packing.packed_of(batch))):
        t0 = time.perf_counter()
        if autocast is not None:
            autocast.__enter__()
        logp, _ = token_logprobs_and_entropy(model, batch["input_ids"], batch["attention_mask"],
                                             batch["response_mask"], packed=packed)  # fmt: skip
        logp.sum().backward()
        if autocast is not None:
            autocast.__exit__(None, None, None)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out[f"{name}_seconds"] = round(time.perf_counter() - t0, 4)
        logps[name] = logp.detach()
        model.zero_grad(set_to_none=True)
    mask = batch["response_mask"].bool()
    out["logp_max_abs_diff"] = float((logps["packed"] - logps["padded"])[mask].abs().max())
    return out


SECTIONS = {"full": section_full, "offload": section_offload, "packing": section_packing}


def run_check(*, out_path: Path, dry_run: bool, work: Path | None = None) -> dict[str, Any]:
    import torch

    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu-check: no CUDA device here; run it on a GPU machine or --dry-run")
    t_start = time.monotonic()
    work = work or Path(tempfile.mkdtemp(prefix="tether-gpu-check-"))
    _, _, device = setup_distributed(offload=True)  # cpu:gloo,cuda:nccl: both paths run
    shape = _shape(dry_run)
    spec = SHAPE_TINY if dry_run else SHAPE_3B
    t0 = time.monotonic()
    model_dir = build_tiny_model(work / "model", **spec)
    result: dict[str, Any] = {
        "bench": "gpu_check",
        "dry_run": dry_run,
        "device": device_name(),
        "torch": torch.__version__,
        "stack": dict(zip(("refused", "warned"), stack_problems(generator=False), strict=True)),
        "shape": spec,
        "params": shape.params,
        "tokens_per_micro_batch": TOKENS[dry_run],
        "model_build_seconds": round(time.monotonic() - t0, 1),
        "git": git_state(),
    }
    ctx = {"device": device, "tokens": TOKENS[dry_run], "work": work, "shape": shape,
           "model_dir": model_dir}  # fmt: skip
    for name, fn in SECTIONS.items():
        t1 = time.monotonic()
        try:
            result[name] = {"ok": True, **fn(ctx)}
        except Exception as exc:  # record and go on: one broken section must not hide the rest
            result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                            "trace": traceback.format_exc()}  # fmt: skip
        result[name]["seconds"] = round(time.monotonic() - t1, 1)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["seconds"] = round(time.monotonic() - t_start, 1)
    result["ok"] = all(result[n]["ok"] for n in SECTIONS)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--dry-run", action="store_true", help="tiny shape on this CPU, fp32")
    args = ap.parse_args()
    result = run_check(out_path=Path(args.out), dry_run=args.dry_run)
    summary = {n: result[n]["ok"] for n in SECTIONS}
    print(f"gpu-check: {summary} in {result['seconds']} s -> {args.out}", file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    process_exit.skip_finalization("gloo process groups")  # see process_exit's docstring
    raise SystemExit(process_exit.end(main()))
