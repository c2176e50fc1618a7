"""The buffers one update sends: runs of consecutive tensors of at most a bucket, packed once into
a shared buffer; a tensor at least as big as a bucket goes alone from its own memory (no copy)."""

from __future__ import annotations


def tensor_bytes(t):
    """A flat uint8 view of a contiguous tensor (a copy only if it was not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(__import__("torch").uint8)


def pack_unit(tensors, layout, k: int, device):
    """The buffer sent for unit ``k`` of ``layout`` given its tensors (in order): the tensor's
    own bytes if it is alone, else a packed copy of them (one bucket)."""
    import torch

    start, end, first, last = layout["units"][k]
    if last - first == 1:
        return tensor_bytes(tensors[0]).to(device)
    buf = torch.zeros(end - start, dtype=torch.uint8, device=device)
    for i, t in zip(range(first, last), tensors, strict=True):
        _, _, _, off, nbytes = layout["tensors"][i]
        buf[off - start : off - start + nbytes].copy_(tensor_bytes(t))
    return buf


def unit_buffers(named, layout, device) -> list:
    """The buffer sent for each unit of an update held whole in memory."""
    return [
        pack_unit([t for _, t in named[first:last]], layout, k, device)
        for k, (_, _, first, last) in enumerate(layout["units"])
    ]
