"""Subprocess for tests/services/test_checkpoint.py: save checkpoint 1, then hang inside save 2.

    python tests/procs/checkpoint_writer.py --model DIR --run-dir DIR --hang-seconds S

Saves step 1 normally (policy_version 1), prints ``saved 1``, then turns on the checkpoint test
hook (sleep after the shards of step 2 are written, before ``meta.json`` and the rename) and saves
step 2. The test SIGKILLs this process during that sleep (or while it still writes). ``--async``:
both saves are asynchronous (the shards written by DCP's writer thread).
"""

from __future__ import annotations

import argparse
import os

from services.learner.checkpoint import TEST_HOOK_SLEEP_ENV, start_checkpoint
from services.learner.model import load_policy
from services.learner.optim import build_optimizer, build_schedule, build_scheduler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--hang-seconds", type=float, default=60.0)
    parser.add_argument("--async", dest="async_save", action="store_true")
    args = parser.parse_args()

    import torch

    model = load_policy(args.model, device=torch.device("cpu"), fsdp=False)
    optimizer = build_optimizer(model, lr=1e-3)
    scheduler = build_scheduler(optimizer, build_schedule(warmup_steps=2))
    ids = torch.arange(2, 18).reshape(2, 8)
    for step in (1, 2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step == 2:
            os.environ[TEST_HOOK_SLEEP_ENV] = str(args.hang_seconds)
        start_checkpoint(
            args.run_dir,
            step,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            extra_state={"policy_version": step},
            async_save=args.async_save,
        ).wait()
        print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main()
