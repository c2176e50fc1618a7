"""torchrun entry for tests/services/test_learner_fsdp.py: FSDP2 training steps on real gloo ranks.

    torchrun --nproc_per_node 2 tests/procs/fsdp_worker.py --model DIR --batch FILE --out DIR

Each rank takes its share of the batch (rank 0: rows 0 and 1 as two micro-batches; rank 1: rows
2-3 as one micro-batch plus a zero-weight padding micro-batch, so the ranks split the batch
differently and the padding path runs), runs two optimizer steps with gradient checkpointing,
checkpoints after the first, then resumes a fresh model from that checkpoint and repeats step
two. Rank 0 writes the updated weights and the step stats to ``--out``.

The loss (``token_mean_nll``) is the test's own, not Tether's algorithm: minus the sum of
response-token log-probs divided by the number of response tokens in the WHOLE batch, so
micro-batch losses add up to the batch's token-mean loss.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common.service import process_exit
from common.weights.layout import build_layout
from services.learner.checkpoint import load_checkpoint, save_checkpoint
from services.learner.gather import full_state_dict_cpu, publish_items, publish_specs, stream_units
from services.learner.model import load_policy, setup_distributed, token_logprobs_and_entropy
from services.learner.optim import build_optimizer, build_schedule, build_scheduler
from services.learner.train_step import train_step

LR = 1e-3
GRAD_CLIP = 1.0


def token_mean_nll(model, micro_batch):
    """Test loss: -sum(logp * weight) / global_tokens (pre-normalised by the whole batch)."""
    logp, _ = token_logprobs_and_entropy(
        model, micro_batch["input_ids"], micro_batch["attention_mask"], micro_batch["response_mask"]
    )
    weight = micro_batch["response_mask"].float() * micro_batch["loss_weight"]
    return -(logp * weight).sum() / micro_batch["global_tokens"]


def micro_batch(batch: dict, rows: slice, *, weight: float = 1.0) -> dict:
    """Rows of the batch as one micro-batch; ``weight=0`` makes a padding micro-batch."""
    out = {k: batch[k][rows] for k in ("input_ids", "attention_mask", "response_mask")}
    if weight == 0.0:  # padding: no response token selected at all (the empty-selection path)
        out["response_mask"] = out["response_mask"] * 0
    out["loss_weight"] = weight
    out["global_tokens"] = batch["response_mask"].sum().float()
    return out


def build_training(
    model_dir: str, *, fsdp: bool, gradient_checkpointing: bool, offload: bool = False
):
    """Policy + AdamW + warm-up/cosine schedule, as the learner builds them."""
    import torch

    model = load_policy(
        model_dir,
        device=torch.device("cpu"),
        fsdp=fsdp,
        gradient_checkpointing=gradient_checkpointing,
        offload=offload,
    )
    optimizer = build_optimizer(model, lr=LR, weight_decay=0.01)
    schedule = build_schedule(warmup_steps=1, total_steps=4, decay="cosine", min_lr_ratio=0.1)
    return model, optimizer, build_scheduler(optimizer, schedule)


def rank_micro_batches(batch: dict, rank: int) -> list[dict]:
    if rank == 0:
        return [micro_batch(batch, slice(0, 1)), micro_batch(batch, slice(1, 2))]
    return [micro_batch(batch, slice(2, 4)), micro_batch(batch, slice(0, 1), weight=0.0)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--unit-kib", type=int, default=64, help="the streamed publish's units")
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file, save_file

    rank, world_size, _ = setup_distributed()
    torch.manual_seed(1234)
    batch = load_file(args.batch)
    mbs = rank_micro_batches(batch, rank)
    out = Path(args.out)
    model, optimizer, scheduler = build_training(args.model, fsdp=True, gradient_checkpointing=True)
    stats = []
    for step in (1, 2):
        stats.append(
            train_step(model, optimizer, scheduler, mbs, token_mean_nll, grad_clip=GRAD_CLIP)
        )
        if step == 1:
            save_checkpoint(
                out / "run",
                1,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                extra_state={"policy_version": 1},
            )
    weights = full_state_dict_cpu(model)
    # The publish path: units of (at most) --unit-kib gathered in bf16, one at a time.
    items = publish_items(model)
    layout = build_layout(publish_specs(items, torch.bfloat16), 1, args.unit_kib << 10)
    streamed_bf16 = {}
    for k, tensors in stream_units(items, layout, dtype=torch.bfloat16, rank0=rank == 0):
        _, _, first, last = layout["units"][k]
        streamed_bf16.update(
            {n: t for (n, _), t in zip(items[first:last], tensors, strict=rank == 0)}
        )
    units = len(layout["units"])
    # Resume a fresh model from the step-1 checkpoint and redo step 2.
    model2, optimizer2, scheduler2 = build_training(
        args.model, fsdp=True, gradient_checkpointing=True
    )
    extra = load_checkpoint(out / "run", model=model2, optimizer=optimizer2, scheduler=scheduler2)
    resumed = train_step(model2, optimizer2, scheduler2, mbs, token_mean_nll, grad_clip=GRAD_CLIP)
    resumed_weights = full_state_dict_cpu(model2)
    if rank == 0:
        save_file(weights, str(out / "fsdp_weights.safetensors"))
        save_file(resumed_weights, str(out / "resumed_weights.safetensors"))
        save_file(streamed_bf16, str(out / "streamed_bf16.safetensors"))
        report = {
            "world_size": world_size,
            "steps": [{"loss": s.loss, "grad_norm": s.grad_norm, "lr": s.lr} for s in stats],
            "resumed": {"loss": resumed.loss, "grad_norm": resumed.grad_norm, "lr": resumed.lr},
            "extra": extra,
            "publish_units": units,
        }
        (out / "report.json").write_text(json.dumps(report))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    process_exit.skip_finalization("gloo process groups")  # see process_exit's docstring
    main()
    process_exit.end(0)
