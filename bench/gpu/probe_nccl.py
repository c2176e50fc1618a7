"""Probe: can two processes on one GPU form an NCCL pair group over a TCPStore, and abort it?"""

import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta

import torch  # noqa: TID253 - a torch probe, run on its own
import torch.distributed as dist  # noqa: TID253 - a torch probe, run on its own


def pg(store, rank, timeout):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout)
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


def bcast(g, t):
    o = dist.BroadcastOptions()
    o.rootRank = 0
    return g.broadcast([t], o)


def child(port, mode):
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    g = pg(store, 1, 30)
    t = torch.zeros(1 << 20, device="cuda")
    bcast(g, t).wait()
    torch.cuda.synchronize()
    print("child got", float(t[:4].sum()), flush=True)
    if mode == "die":
        os._exit(0)  # peer gone before the second broadcast
    bcast(g, t).wait()
    torch.cuda.synchronize()


def main():
    print(
        "torch", torch.__version__, "nccl", torch.cuda.nccl.version(), torch.cuda.get_device_name(0)
    )
    print("TORCH_NCCL_ASYNC_ERROR_HANDLING", os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=child, args=(store.port, sys.argv[1] if len(sys.argv) > 1 else "ok"))
    p.start()
    g = pg(store, 0, 30)
    t = torch.ones(1 << 20, device="cuda")
    t0 = time.monotonic()
    w = bcast(g, t)
    w.wait()
    print("wait returned after", time.monotonic() - t0, "completed?", w.is_completed(), flush=True)
    while not w.is_completed():
        time.sleep(0.001)
    print("first broadcast done after", time.monotonic() - t0, flush=True)
    p.join(20)
    print("child exit", p.exitcode, flush=True)
    if len(sys.argv) > 1 and sys.argv[1] == "die":
        w = bcast(g, t)
        t0 = time.monotonic()
        while not w.is_completed() and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        print(
            "second broadcast completed?",
            w.is_completed(),
            "after",
            time.monotonic() - t0,
            flush=True,
        )
        g.abort()
        print("aborted; process still alive", flush=True)
        time.sleep(40)  # past the 30 s PG timeout: does the watchdog tear us down?
        print("survived the watchdog window", flush=True)


if __name__ == "__main__":
    main()
