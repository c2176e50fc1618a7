"""torchrun entry for tests/services/test_checkpoint_ranks.py: a sharded checkpoint written by N
ranks and resumed by M.

    torchrun --nproc_per_node N tests/procs/reshard_worker.py --model DIR --run-dir DIR \\
        --out FILE (--save | --resume)

The batch (4 rows, fixed) is split over the ranks by rows (rank r takes rows r, r + N, ...), so
the global loss of a step does not depend on the number of ranks. ``--save``: one optimizer step,
an asynchronous checkpoint started after it and finished after step 2 (so it holds the state
after step 1 while training went on), then steps 2 and 3. ``--resume``: load that checkpoint,
then steps 2 and 3. Rank 0 writes the losses of steps 2 and 3 to ``--out``: step 2's loss is
the resumed weights', step 3's depends on the resumed optimizer state too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.service import process_exit
from services.learner.checkpoint import load_checkpoint, start_checkpoint
from services.learner.model import setup_distributed
from services.learner.train_step import train_step

sys.path.insert(0, str(Path(__file__).parent))

import fsdp_worker as fw  # noqa: E402 - the same loss and training set-up as the FSDP test


def _batch():
    import torch

    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 250, (4, 14), generator=gen)
    response = torch.zeros_like(ids)
    response[:, 6:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": response}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--out", required=True)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", action="store_true")
    mode.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    import torch

    rank, world, _ = setup_distributed()
    batch = _batch()
    mb = fw.micro_batch(batch, slice(0, 4))
    mb = {
        k: v[rank::world] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in mb.items()
    }
    model, optimizer, scheduler = fw.build_training(
        args.model, fsdp=True, gradient_checkpointing=False
    )

    def step():
        return train_step(model, optimizer, scheduler, [mb], fw.token_mean_nll, grad_clip=1.0)

    if args.save:
        step()
        pending = start_checkpoint(args.run_dir, 1, model=model, optimizer=optimizer,
                                   scheduler=scheduler, extra_state={"v": 1},
                                   async_save=True)  # fmt: skip
        losses = [step().loss]
        pending.wait()
        losses.append(step().loss)
    else:
        extra = load_checkpoint(args.run_dir, model=model, optimizer=optimizer, scheduler=scheduler)
        assert extra == {"v": 1, "checkpoint_step": 1}, extra
        losses = [step().loss, step().loss]
    if rank == 0:
        Path(args.out).write_text(json.dumps({"world": world, "losses": losses}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    process_exit.skip_finalization("gloo process groups")  # see process_exit's docstring
    main()
    process_exit.end(0)
