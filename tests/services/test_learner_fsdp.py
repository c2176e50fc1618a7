"""Learner core: FSDP2 on 2 real gloo ranks vs 1 process, micro-batch invariance, LR schedule.

The 2-rank run is a real ``torchrun`` subprocess (tests/procs/fsdp_worker.py); the 1-process
reference runs here without FSDP on the same batch, with the same test loss. It runs on the tiny
test model and on the one real pretrained model, SmolLM2-135M-Instruct (``tests.real_model``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.learner.model import load_policy, setup_distributed, token_logprobs_and_entropy
from services.learner.optim import build_optimizer, build_schedule, build_scheduler
from services.learner.train_step import train_step
from tests.paths import REPO
from tests.real_model import staged_smollm2
from tether.demo.tiny_model import build_tiny_model

WORKER = REPO / "tests" / "procs" / "fsdp_worker.py"
# fp32 on CPU; reduction order and the matmuls' blocking differ between 1 and 2 ranks (one
# micro-batch of 4 rows against micro-batches of 1-2), so not bitwise. Through SmolLM2's 30 layers
# on random tokens (loss 11.7, gradients clipped from a norm of 30) these differences reach 1e-5
# of the gradient norm at the first step. A bug (a shard not updated, a gradient not averaged
# over the ranks, a micro-batch lost) is off by O(1) in one of these; the bounds leave 10-30x
# room over what was measured, and no bound on single elements: Adam's first step moves an
# element by ~lr whatever its gradient's size, so an element whose gradient is at the noise
# floor can move either way (its max |difference| came out 4.4e-6 on one install, 2.3e-4 on
# another, with every other figure alike).
LOSS_RTOL = 1e-5  # measured 2e-8 (SmolLM2)
GRAD_NORM_RTOL = 1e-3  # measured 1e-7 (tiny), 1.1e-5 and 5.2e-5 at steps 1 and 2 (SmolLM2)
# The whole update (weights after two steps minus before), 2 ranks against 1 process: the norm of
# the difference over the norm of the update (measured 2.5e-6 on the tiny model, 3.0e-6 and
# 6.9e-5 on SmolLM2 on two installs).
UPDATE_RTOL = 1e-3
# The same for each tensor on its own, so that one wrong tensor cannot hide in the whole: worst
# measured 3.7e-5 (tiny, a k_proj bias), 3.4e-4 (SmolLM2, a layer norm's weight).
TENSOR_RTOL = 1e-2


def _worker_module():
    spec = importlib.util.spec_from_file_location("fsdp_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=64, num_layers=2)


@pytest.fixture(scope="module", params=["tiny", "smollm2-135m"])
def model_dir(request, tiny_model_dir) -> Path:
    return tiny_model_dir if request.param == "tiny" else staged_smollm2()


def _make_batch(seed: int = 0) -> dict:
    """4 rows, right-padded, prompts of different lengths, response tokens masked in."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows, seq_len = 4, 24
    input_ids = torch.randint(0, 250, (rows, seq_len), generator=gen)
    attention_mask = torch.ones(rows, seq_len, dtype=torch.long)
    response_mask = torch.zeros(rows, seq_len, dtype=torch.long)
    for row, (prompt_len, total_len) in enumerate([(5, 24), (8, 20), (3, 14), (10, 22)]):
        attention_mask[row, total_len:] = 0
        input_ids[row, total_len:] = 0
        response_mask[row, prompt_len:total_len] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
    }


def _norm(tensors) -> float:
    """The L2 norm of tensors taken together, in float64."""
    return sum(float(t.double().square().sum()) for t in tensors) ** 0.5


@pytest.mark.slow
def test_two_rank_fsdp_matches_single_process(model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    worker = _worker_module()
    batch = _make_batch()
    save_file(batch, str(tmp_path / "batch.safetensors"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--standalone", str(WORKER), "--model", str(model_dir),
        "--batch", str(tmp_path / "batch.safetensors"), "--out", str(tmp_path),
        "--unit-kib", "64" if model_dir.name == "model" else "4096",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["world_size"] == 2

    # Reference: one process, no FSDP, the whole batch as a single micro-batch.
    model, optimizer, scheduler = worker.build_training(
        str(model_dir), fsdp=False, gradient_checkpointing=False
    )
    whole = [worker.micro_batch(batch, slice(0, 4))]
    ref_stats = [
        train_step(
            model, optimizer, scheduler, whole, worker.token_mean_nll, grad_clip=worker.GRAD_CLIP
        )
        for _ in range(2)
    ]
    fsdp_weights = load_file(str(tmp_path / "fsdp_weights.safetensors"))
    ref_weights = {k: v.detach() for k, v in model.state_dict().items() if k in fsdp_weights}
    assert set(ref_weights) == set(fsdp_weights)
    max_diff = max(float((ref_weights[k] - fsdp_weights[k]).abs().max()) for k in ref_weights)
    print(f"2-rank FSDP vs 1 process: max |weight diff| after 2 steps = {max_diff:.3e}")
    for ref, got in zip(ref_stats, report["steps"], strict=True):
        print(
            f"loss 1-proc {ref.loss:.8f} 2-rank {got['loss']:.8f}; grad norm {ref.grad_norm:.6f} / {got['grad_norm']:.6f}"
        )
        assert got["loss"] == pytest.approx(ref.loss, rel=LOSS_RTOL)
        assert got["grad_norm"] == pytest.approx(ref.grad_norm, rel=GRAD_NORM_RTOL)
        assert got["lr"] == pytest.approx(ref.lr, rel=1e-12)
    initial: dict = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        initial.update(load_file(str(f)))
    assert set(fsdp_weights) <= set(initial)
    off = _norm(fsdp_weights[k] - ref_weights[k] for k in ref_weights)
    update = _norm(ref_weights[k] - initial[k] for k in ref_weights)
    print(f"|2-rank update - 1-process update| / |update| = {off / update:.3e}")
    assert off / update < UPDATE_RTOL
    per_tensor = {k: _norm([fsdp_weights[k] - ref_weights[k]]) / _norm([ref_weights[k] - initial[k]])
                  for k in ref_weights}  # fmt: skip
    worst = max(per_tensor, key=per_tensor.__getitem__)
    print(f"worst tensor {worst}: |difference| / |update| = {per_tensor[worst]:.3e}")
    assert per_tensor[worst] < TENSOR_RTOL, worst
    # The weights really moved (a broken optimizer step would also "match").
    moved = max(float((fsdp_weights[k] - initial[k]).abs().max()) for k in fsdp_weights)
    assert moved > worker.LR / 2  # Adam's first step moves an element by up to ~lr

    # 2-rank checkpoint resume: step 2 redone from the step-1 checkpoint is identical.
    assert report["extra"] == {"policy_version": 1, "checkpoint_step": 1}
    assert report["resumed"] == report["steps"][1]
    resumed = load_file(str(tmp_path / "resumed_weights.safetensors"))
    assert all(bool((resumed[k] == fsdp_weights[k]).all()) for k in fsdp_weights)

    # The streamed publish's gather (units of 64 KiB, cast to bf16 before the gather): the same
    # weights, cast once, every tensor exactly once.
    import torch

    half = load_file(str(tmp_path / "streamed_bf16.safetensors"))
    assert set(half) == set(fsdp_weights) and report["publish_units"] > 3
    assert all(half[k].dtype == torch.bfloat16 for k in half)
    assert all(bool((half[k] == fsdp_weights[k].to(torch.bfloat16)).all()) for k in fsdp_weights)


def _grads_via_train_step(model_dir: Path, batch: dict, splits: list[slice]) -> dict:
    """Run train_step with SGD(lr=1) so the weight change is exactly minus the gradient."""
    import torch

    worker = _worker_module()
    model = load_policy(model_dir, device=torch.device("cpu"), fsdp=False)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    mbs = [worker.micro_batch(batch, rows) for rows in splits]
    train_step(model, optimizer, scheduler, mbs, worker.token_mean_nll, grad_clip=None)
    return {k: before[k] - v.detach() for k, v in model.named_parameters()}


def test_gradient_independent_of_micro_batch_split(tiny_model_dir: Path) -> None:
    batch = _make_batch(seed=1)
    one = _grads_via_train_step(tiny_model_dir, batch, [slice(0, 4)])
    four = _grads_via_train_step(tiny_model_dir, batch, [slice(i, i + 1) for i in range(4)])
    uneven = _grads_via_train_step(tiny_model_dir, batch, [slice(0, 3), slice(3, 4)])
    scale = max(float(g.abs().max()) for g in one.values())
    for other in (four, uneven):
        diff = max(float((one[k] - other[k]).abs().max()) for k in one)
        print(f"max |grad diff| = {diff:.3e} (max |grad| = {scale:.3e})")
        assert diff < 1e-6 * max(1.0, scale)
    assert scale > 1e-3  # the gradient is not trivially zero


def test_lr_schedule_boundaries() -> None:
    import torch

    sched = build_schedule(warmup_steps=4, total_steps=14, decay="cosine", min_lr_ratio=0.1)
    assert [sched(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert sched(4) == 1.0  # warm-up end: cosine starts at the peak
    assert sched(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert sched(14) == pytest.approx(0.1)  # the floor at total_steps ...
    assert sched(100) == pytest.approx(0.1)  # ... and after it
    ratio = build_schedule(warmup_ratio=0.25, total_steps=8, decay="constant")
    assert ratio.warmup_steps == 2 and ratio(1) == 1.0 and ratio(7) == 1.0

    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, lr=0.02)
    scheduler = build_scheduler(optimizer, sched)
    lrs = []
    for _ in range(15):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(0.005) and lrs[3] == pytest.approx(0.02)
    assert lrs[14] == pytest.approx(0.002)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))  # monotone decay
    assert math.isclose(optimizer.param_groups[1]["weight_decay"], 0.0)  # bias: no decay


@pytest.mark.parametrize(
    "kwargs",
    [
        {"decay": "linear"},
        {"warmup_steps": 2, "warmup_ratio": 0.1, "total_steps": 10},
        {"decay": "cosine"},
        {"min_lr_ratio": 1.5},
    ],
)
def test_lr_schedule_rejects_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        build_schedule(**kwargs)


def test_token_logprobs_match_log_softmax(tiny_model_dir: Path) -> None:
    import torch

    model = load_policy(tiny_model_dir, device=torch.device("cpu"), fsdp=False)
    batch = _make_batch(seed=2)
    logp, entropy = token_logprobs_and_entropy(
        model,
        batch["input_ids"],
        batch["attention_mask"],
        batch["response_mask"],
        with_entropy=True,
    )
    with torch.no_grad():
        full = torch.log_softmax(
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, -1
        )
    expected = full[:, :-1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["response_mask"][:, 1:].bool()
    assert torch.allclose(logp[:, 1:][mask], expected[mask], atol=1e-5)
    assert bool((logp[:, 1:][~mask] == 0).all()) and bool((logp[:, 0] == 0).all())
    expected_entropy = -(full.exp() * full).sum(-1)[:, :-1]
    assert torch.allclose(entropy[:, 1:][mask], expected_entropy[mask], atol=1e-4)


def test_cpu_offload_trains_as_without_it(tiny_model_dir: Path) -> None:
    """learner.cpu_offload: FSDP2's CPUOffloadPolicy on every unit, and the same steps (on this
    CPU the shards are in host memory either way; on a GPU the same code keeps them there)."""
    import torch
    import torch.distributed as dist

    worker = _worker_module()
    batch = _make_batch()
    created = not dist.is_initialized()
    setup_distributed()
    try:
        losses = {}
        for offload in (False, True):
            torch.manual_seed(0)
            model, optimizer, scheduler = worker.build_training(
                str(tiny_model_dir), fsdp=True, gradient_checkpointing=False, offload=offload
            )
            groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules()
                      if hasattr(m, "_get_fsdp_state")]  # fmt: skip
            assert {p.offload_to_cpu for g in groups if g for p in g.fsdp_params} == {offload}
            mbs = [worker.micro_batch(batch, slice(0, 4))]
            losses[offload] = [
                train_step(
                    model, optimizer, scheduler, mbs, worker.token_mean_nll, grad_clip=1.0
                ).loss
                for _ in range(3)
            ]
        assert losses[True] == pytest.approx(losses[False], abs=1e-6)
    finally:
        if created:
            dist.destroy_process_group()
