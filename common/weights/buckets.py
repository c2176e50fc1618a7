"""The buffers one update sends: runs of consecutive tensors of at most a bucket, packed once into
a shared buffer; a tensor at least as big as a bucket goes alone from its own memory (no copy)."""

from __future__ import annotations


def tensor_bytes(t):
    """A flat uint8 view of a contiguous tensor (a copy only if it was not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(__import__("torch").uint8)


def unit_buffers(named, layout, device) -> list:
    """The tensor sent for each unit: the tensor's own bytes if alone, else a packed copy."""
    import torch

    out = []
    for start, end, first, last in layout["units"]:
        if last - first == 1:
            out.append(tensor_bytes(named[first][1]).to(device))
            continue
        buf = torch.zeros(end - start, dtype=torch.uint8, device=device)
        for i in range(first, last):
            _, _, _, off, nbytes = layout["tensors"][i]
            buf[off - start : off - start + nbytes].copy_(tensor_bytes(named[i][1]))
        out.append(buf)
    return out
