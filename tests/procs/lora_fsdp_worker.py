"""torchrun entry for tests/services/test_lora_learner.py: a LoRA policy under FSDP2 on real gloo
ranks.

    torchrun --nproc_per_node 2 tests/procs/lora_fsdp_worker.py --model DIR --batch FILE --out DIR

The ranks build the LoRA policy (``load_policy(lora=…)``), each takes its share of the batch
(``fsdp_worker.rank_micro_batches``), runs two optimizer steps with gradient checkpointing and
checkpoints after the first; then a fresh LoRA policy resumes from that checkpoint and repeats
step two. Rank 0 writes the adapter at start, after the two steps and after the resumed step
(PEFT names, ``lora.adapter_state``), the step stats, and the optimizer state's tensor names.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from common.service import process_exit
from services.learner.checkpoint import load_checkpoint, save_checkpoint
from services.learner.lora import LoraSettings, adapter_state
from services.learner.model import load_policy, setup_distributed
from services.learner.optim import build_optimizer, build_schedule, build_scheduler
from services.learner.train_step import train_step

RANK, ALPHA, SEED = 8, 16, 3
LR = 1e-2


def fsdp_worker():
    spec = importlib.util.spec_from_file_location(
        "fsdp_worker", Path(__file__).with_name("fsdp_worker.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_training(model_dir: str, *, fsdp: bool, gradient_checkpointing: bool):
    """A LoRA policy + AdamW + constant schedule, as the learner builds them."""
    import torch

    model = load_policy(
        model_dir,
        device=torch.device("cpu"),
        fsdp=fsdp,
        gradient_checkpointing=gradient_checkpointing,
        lora=LoraSettings(rank=RANK, alpha=ALPHA),
        seed=SEED,
    )
    optimizer = build_optimizer(model, lr=LR, weight_decay=0.01)
    schedule = build_schedule(warmup_steps=1, total_steps=4, decay="constant")
    return model, optimizer, build_scheduler(optimizer, schedule)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    base = fsdp_worker()
    rank, world, _ = setup_distributed()
    out = Path(args.out)
    batch = load_file(args.batch)
    mbs = base.rank_micro_batches(batch, rank)
    model, optimizer, scheduler = build_training(args.model, fsdp=True, gradient_checkpointing=True)
    initial = adapter_state(model)
    steps = []
    for step in range(2):
        st = train_step(model, optimizer, scheduler, mbs, base.token_mean_nll, grad_clip=1.0)
        steps.append({"loss": st.loss, "grad_norm": st.grad_norm, "lr": st.lr})
        if step == 0:
            save_checkpoint(out / "run", 1, model=model, optimizer=optimizer,
                            scheduler=scheduler, extra_state={"policy_version": 1})  # fmt: skip
    trained = adapter_state(model)
    osd = get_optimizer_state_dict(model, optimizer)  # what a checkpoint saves (by FQN)
    model2, optimizer2, scheduler2 = build_training(
        args.model, fsdp=True, gradient_checkpointing=True
    )
    extra = load_checkpoint(out / "run", model=model2, optimizer=optimizer2, scheduler=scheduler2)
    st = train_step(model2, optimizer2, scheduler2, mbs, base.token_mean_nll, grad_clip=1.0)
    resumed = adapter_state(model2)
    if rank == 0:
        save_file(initial, str(out / "initial.safetensors"))
        save_file(trained, str(out / "trained.safetensors"))
        save_file(resumed, str(out / "resumed.safetensors"))
        report = {
            "world_size": world,
            "steps": steps,
            "resumed": {"loss": st.loss, "grad_norm": st.grad_norm, "lr": st.lr},
            "extra": extra,
            "optimizer_params": sorted(osd["state"]),
        }
        (out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    process_exit.skip_finalization("gloo process groups")  # see process_exit's docstring
    main()
    process_exit.end(0)
