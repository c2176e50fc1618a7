"""The learner's GPU path, run for real on a CUDA machine (CI has no GPU; this is run by hand).

    python bench/gpu/check.py --out DIR [--steps env,mixed,learner,learner3b] [--tiny]

Steps (each writes ``DIR/<step>.json``; a failing step is recorded and the next one still runs):

- ``env``: torch, CUDA device, NCCL version.
- ``mixed``: the learner's own functions on CUDA, with an NCCL process group (one rank) and FSDP2:
  the same random batch scored by the bf16 mixed-precision policy and the fp32 policy (how far
  apart their token log-probs are), then a few optimizer steps of each on one objective (raise
  the log-prob of the batch's response tokens) so bf16 compute with fp32 master weights and fp32
  gradient reduction is seen to train like fp32.
- ``learner``: ``tether bench learner`` at its default shape (service vs bare loop).
- ``learner3b``: the same at a Qwen2.5-3B shape (36 layers, hidden 2048, vocab 151936),
  512-token prompts + 2560-token responses, 120 responses per step, micro-batches of 2 with
  gradient checkpointing: the measured train tokens/s per GPU that ``tether plan`` assumes.

``--tiny`` shrinks every size so the script itself can be checked on a CPU (gloo, fp32).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

# run as a script (`python bench/gpu/check.py`): the clone goes on the path before its packages
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.learner import run_learner_bench  # noqa: E402
from common.service import process_exit  # noqa: E402
from common.weights.checksum import tensors_checksum  # noqa: E402
from common.weights.layout import WeightSyncError, build_layout  # noqa: E402
from common.weights.publisher import WeightPublisher  # noqa: E402
from common.weights.receiver import WeightReceiver  # noqa: E402
from services.learner.gather import full_state_dict_cpu, publish_items, publish_specs, stream_units  # noqa: E402
from services.learner.model import load_policy, setup_distributed, token_logprobs_and_entropy  # noqa: E402
from tether.demo.tiny_model import build_tiny_model  # noqa: E402


def step_env(tiny: bool) -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name(0)
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        out["bf16_supported"] = torch.cuda.is_bf16_supported()
        out["memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    return out


def step_mixed(tiny: bool) -> dict:
    import torch

    _, _, device = setup_distributed()
    hidden, layers, prompt, resp, batch = (64, 2, 8, 16, 2) if tiny else (512, 6, 64, 256, 8)
    model_dir = build_tiny_model(
        Path(tempfile.mkdtemp(prefix="tether-gpu-mixed-")) / "model",
        hidden_size=hidden,
        num_layers=layers,
        num_heads=max(4, hidden // 64),
        max_position_embeddings=prompt + resp + 8,
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (batch, prompt + resp), generator=g).to(device)
    attn = torch.ones_like(ids)
    rmask = torch.zeros_like(ids)
    rmask[:, prompt:] = 1
    n_tok = int(rmask.sum())
    half = torch.bfloat16 if device.type == "cuda" else torch.float32
    result: dict = {"device": str(device), "compute_dtype": str(half), "tokens": n_tok}
    curves = {}
    for name, dtype in (("fp32", torch.float32), ("mixed", half)):
        model = load_policy(model_dir, device=device, param_dtype=dtype)
        with torch.no_grad():
            lp, _ = token_logprobs_and_entropy(model, ids, attn, rmask)
        result[f"logp_{name}"] = lp[rmask.bool()].double().cpu()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        curve = []
        for _ in range(8):
            lp, _ = token_logprobs_and_entropy(model, ids, attn, rmask)
            loss = -(lp * rmask).sum() / n_tok
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(-float(loss.detach()))
        curves[name] = curve
        del model, opt
    diff = (result.pop("logp_mixed") - result.pop("logp_fp32")).abs()
    result["logp_abs_diff_mean"] = float(diff.mean())
    result["logp_abs_diff_max"] = float(diff.max())
    result["mean_logp_per_step"] = curves
    result["mixed_minus_fp32_final"] = curves["mixed"][-1] - curves["fp32"][-1]
    return result


def _learner(tiny: bool, **kwargs) -> dict:
    if tiny:
        kwargs = {
            "cycles": 2,
            "prompts": 2,
            "per_prompt": 2,
            "prompt_tokens": 32,
            "response_tokens": 16,
            "hidden": 64,
            "layers": 2,
            "repeats": 1,
        } | {k: v for k, v in kwargs.items() if k == "overrides"}
    return run_learner_bench(**kwargs)


def step_learner(tiny: bool) -> dict:
    return _learner(tiny)


def step_learner3b(tiny: bool) -> dict:
    return _learner(
        tiny,
        cycles=2,
        prompt_tokens=512,
        response_tokens=2560,
        hidden=2048,
        layers=36,
        heads=16,
        kv_heads=2,
        intermediate=11008,
        vocab=151936,
        repeats=1,
        overrides=["learner.micro_batch_size=2", "learner.gradient_checkpointing=true"],
    )


def step_publish3b(tiny: bool) -> dict:
    """Where a publish's time goes at the 3B shape: gathering the FSDP weights to CPU (the old
    DCP path in fp32, whole in fp32 and in bf16, and unit by unit as the streamed publish does),
    hashing, and ``WeightPublisher.publish`` to no member (pack + hash; the send itself needs a
    second GPU for NCCL)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    _, _, device = setup_distributed()
    shape: dict[str, Any] = (
        {"hidden_size": 64, "num_layers": 2, "num_heads": 4}
        if tiny
        else {
            "hidden_size": 2048,
            "num_layers": 36,
            "num_heads": 16,
            "num_kv_heads": 2,
            "intermediate_size": 11008,
            "vocab_size": 151936,
        }  # fmt: skip
    )
    model_dir = build_tiny_model(Path("bench/work/gpu-publish"), **shape)  # in the clone, ignored
    model = load_policy(model_dir, device=device)
    half = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict = {}

    def timed(key, fn):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        value = fn()
        out[key] = time.perf_counter() - t0
        return value

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    timed("gather_dcp_fp32_s", lambda: get_model_state_dict(model, options=opts))
    fp32 = timed("gather_fp32_s", lambda: full_state_dict_cpu(model))
    bf16 = timed("gather_bf16_s", lambda: full_state_dict_cpu(model, dtype=half))
    items = publish_items(model)
    layout = build_layout(publish_specs(items, half), 1, 64 << 20)
    streamed: dict = {}

    def stream() -> None:
        for k, tensors in stream_units(items, layout, dtype=half, rank0=True):
            _, _, first, last = layout["units"][k]
            streamed.update(
                {n: t.cpu() for (n, _), t in zip(items[first:last], tensors, strict=True)}
            )

    timed("gather_bf16_streamed_s", stream)
    out["streamed_equals_plain"] = all(bool((streamed[k] == bf16[k]).all()) for k in bf16)
    out["bytes_fp32"] = sum(t.numel() * t.element_size() for t in fp32.values())
    out["bytes_bf16"] = sum(t.numel() * t.element_size() for t in bf16.values())
    timed("checksum_fp32_s", lambda: tensors_checksum(fp32.items()))
    pub = WeightPublisher("127.0.0.1", 0, timeout_s=120.0)
    try:
        timed("publish_fp32_s", lambda: pub.publish(fp32.items(), 1))
        timed("publish_bf16_s", lambda: pub.publish(bf16.items(), 2))
    finally:
        pub.close()
    return out


def _same_gpu_receiver(port: int, q) -> None:
    try:
        WeightReceiver("127.0.0.1", port, "same-gpu", timeout_s=30.0).join()
        q.put("joined")
    except WeightSyncError as e:
        q.put(f"WeightSyncError: {e}")


def step_nccl_same_gpu(tiny: bool) -> dict:
    """An NCCL publisher and a generator on the same GPU: the generator must refuse at join with
    a message naming the fix (NCCL itself would fail later with "Duplicate GPU detected")."""
    pub = WeightPublisher("127.0.0.1", 0, backend="nccl", timeout_s=30.0)
    try:
        q = mp.get_context("spawn").Queue()
        proc = mp.get_context("spawn").Process(target=_same_gpu_receiver, args=(pub.port, q))
        proc.start()
        outcome = q.get(timeout=120)
        proc.join(30)
    finally:
        pub.close()
    return {"publisher_device": pub.device, "receiver": outcome}


STEPS = {
    "env": step_env,
    "mixed": step_mixed,
    "learner": step_learner,
    "learner3b": step_learner3b,
    "publish3b": step_publish3b,
    "nccl_same_gpu": step_nccl_same_gpu,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", default="env,mixed,learner")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in args.steps.split(","):
        if name not in STEPS:
            print(f"unknown step {name!r}; choose from {', '.join(STEPS)}")
            return 2
        t0 = time.perf_counter()
        try:
            res = {"ok": True, **STEPS[name](args.tiny)}
        except Exception as e:  # record and go on: one broken step must not hide the others
            failed += 1
            res = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc(),
            }
        res["seconds"] = time.perf_counter() - t0
        (out / f"{name}.json").write_text(json.dumps(res, indent=2, default=str))
        print(f"== {name}: {json.dumps(res, default=str)[:1500]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    process_exit.skip_finalization("gloo process groups")  # see process_exit's docstring
    raise SystemExit(process_exit.end(main()))
