"""torchrun entry for tests/services/test_offload_groups.py: the learner's offload path
(``learner.cpu_offload``) on 2 real gloo ranks, on a process group whose device backend is a
fake that refuses host tensors as NCCL does.

    torchrun --nproc_per_node 2 tests/procs/offload_worker.py --model DIR --out DIR --groups old|new

FAKE: ``fake_nccl`` stands in for NCCL, which cannot run here (no GPU): torch's data-less
``FakeProcessGroup`` registered as NCCL is, for the ``cuda`` device type only, so a CPU tensor
handed to a group built with it alone fails as it does on a GPU machine ("No backend type
associated with device type cpu"). The group is built from
``model.process_group_backend("cuda", "fake_nccl", offload=...)``: ``--groups old`` is what the
learner built before (the device backend alone: ``offload=False``), ``--groups new`` what it
builds with offload on (``cpu:gloo,cuda:fake_nccl``). The model computes on this CPU, so every
tensor here is a host tensor: the run shows where host tensors go, i.e. the offload path's
collectives outside FSDP (and FSDP's own, which on a GPU would carry device tensors to NCCL).

Path: sharded start-up with offload, one ``train_step`` (gradient norm, loss sum), a checkpoint
save, a streamed publish's gather (``gather.stream_units``) and a resume. Rank 0 writes
``report.json``: the step's loss and grad norm, the published tensors' count.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path

# torchrun runs this file as a script: the clone goes on the path before its packages are imported
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.service import process_exit  # noqa: E402
from common.weights.layout import build_layout  # noqa: E402
from services.learner import gather  # noqa: E402
from services.learner.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from services.learner.model import process_group_backend  # noqa: E402
from services.learner.train_step import train_step  # noqa: E402
from tests.procs.fsdp_worker import build_training, micro_batch, token_mean_nll  # noqa: E402


def register_fake_nccl() -> None:
    """FAKE NCCL: torch's ``FakeProcessGroup`` (a backend that carries no data), registered as
    NCCL is, for the ``cuda`` device type only: c10d refuses to hand it a CPU tensor exactly as
    it refuses NCCL one."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common_opts, backend_opts):
        return FakeProcessGroup._create_internal(
            common_opts.group_rank, common_opts.group_size, backend_opts
        )

    dist.Backend.register_backend("fake_nccl", create, extended_api=True, devices=["cuda"])


def main() -> None:
    import torch
    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--groups", choices=("old", "new"), required=True)
    args = ap.parse_args()
    register_fake_nccl()
    backend = process_group_backend("cuda", "fake_nccl", offload=args.groups == "new")
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    out = Path(args.out)
    torch.manual_seed(0)
    model, optimizer, scheduler = build_training(
        args.model, fsdp=True, gradient_checkpointing=False, offload=True
    )
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, 250, (2, 16), generator=gen)
    resp = torch.zeros_like(ids)
    resp[:, 6:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": resp}
    batch["response_mask"] = resp

    stats = train_step(model, optimizer, scheduler, [micro_batch(batch, slice(0, 2))],
                       token_mean_nll, grad_clip=1.0)  # fmt: skip
    save_checkpoint(out / "run", 1, model=model, optimizer=optimizer, scheduler=scheduler,
                    extra_state={})  # fmt: skip

    items = gather.publish_items(model)
    layout = build_layout(gather.publish_specs(items, None), 1, 1 << 20)
    published = sum(len(t) for _, t in gather.stream_units(
        items, layout, dtype=None, rank0=rank == 0, device=torch.device("cpu")))  # fmt: skip
    resumed = load_checkpoint(out / "run", model=model, optimizer=optimizer, scheduler=scheduler)
    if rank == 0:
        report = {"backend": backend, "loss": stats.loss, "grad_norm": stats.grad_norm,
                  "published": published, "resumed_step": (resumed or {}).get("checkpoint_step")}  # fmt: skip
        (out / "report.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    process_exit.skip_finalization("gloo process groups")  # see process_exit's docstring
    main()
    process_exit.end(0)
