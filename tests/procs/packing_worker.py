"""torchrun worker for tests/services/test_packing_fsdp.py: one optimizer step of the learner's
real path (load_policy with its packing probe, rank_micro_batches, make_loss_fn, train_step)
under FSDP2 on gloo, padded and then packed from the same weights, each followed by the
checkpoint's optimizer-state gather; rank 0 writes both steps' loss and gradient norm to
``--out``."""

from __future__ import annotations

import argparse
import json

from common.config.load import load_config
from common.service import process_exit
from services.learner import objective, optim
from services.learner.checkpoint_state import optimizer_state
from services.learner.cycle import Sample, assign_advantages
from services.learner.main import training_settings
from services.learner.model import load_policy, setup_distributed
from services.learner.train_step import train_step


def main() -> None:
    import torch
    import torch.distributed as dist

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, _, device = setup_distributed()
    out = {}
    for pack in (False, True):
        model = load_policy(args.model, device=device, pack_sequences=pack)
        cfg = load_config(
            flags={"run.prompts_per_cycle": 2, "run.responses_per_prompt": 4},
            overrides=[f"learner.pack_sequences={str(pack).lower()}", "learner.micro_batch_size=2"],
            env={},
        ).config
        g = torch.Generator().manual_seed(1)
        samples = [
            Sample(sample_id=str(k), group=k // 4,
                   prompt_ids=torch.randint(3, 250, (3 + k,), generator=g).tolist(),
                   response_ids=torch.randint(3, 250, (2 + 3 * k,), generator=g).tolist(),
                   behaviour_logp=[-1.0] * (2 + 3 * k), reward=float(k % 2), policy_version=0)
            for k in range(8)
        ]  # fmt: skip
        assign_advantages(samples, cfg.learner)
        idx = list(range(len(samples)))
        mbs = objective.rank_micro_batches(cfg.learner, samples, idx, pad_id=0, device=device)
        loss_fn = objective.make_loss_fn(
            training_settings(cfg),
            denominator=objective.step_denominator(cfg.learner, samples, idx),
            stats_out=[],
        )
        opt = optim.build_optimizer(model, lr=1e-3)
        sched = optim.build_scheduler(opt, optim.build_schedule())
        stats = train_step(model, opt, sched, mbs, loss_fn, grad_clip=None)
        # the final checkpoint's optimizer state must still map to the model's parameters
        optimizer_state(model, opt)
        out["packed" if pack else "padded"] = {
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "packed_micro_batches": sum("packed_index" in mb for mb in mbs),
        }
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    process_exit.skip_finalization("gloo process groups")  # see process_exit's docstring
    main()
    process_exit.end(0)
