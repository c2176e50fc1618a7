"""Gathering the sharded model's full weights (Hugging Face names) onto rank 0: for a weight
publish, an export, a test. Every function here is a collective under FSDP: every rank calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class HostStaging:
    """Reusable host memory for repeated weight gathers (the learner's publishes).

    Two flat buffers are used in turn, so the tensors of the previous gather stay intact while the
    next one is written (the weight publisher keeps the latest publish to serve late joiners). On
    CUDA they are page-locked: the device-to-host copies then run at full bus speed and
    asynchronously, instead of faulting fresh pageable pages in every time (measured at the 3B
    shape on an H100: see bench/README.md).
    """

    def __init__(self) -> None:
        self._buffers: list[Any] = [None, None]
        self._turn = 0

    def take(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        import torch

        self._turn ^= 1
        buf = self._buffers[self._turn]
        if buf is None or buf.numel() < nbytes:
            self._buffers[self._turn] = None  # free the old one before allocating the new one
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            self._buffers[self._turn] = buf
        return buf


def full_state_dict_cpu(
    model: torch.nn.Module,
    *,
    drop_tied: bool = True,
    dtype: torch.dtype | None = None,
    staging: HostStaging | None = None,
) -> dict[str, Any]:
    """Full (unsharded) weights with Hugging Face names, on CPU, on rank 0 (``{}`` elsewhere).

    A collective under FSDP: every rank must call it. Tensors are gathered one at a time on the
    device (peak extra device memory: the largest tensor), cast to ``dtype`` there when given
    (e.g. bf16 for a weight publish: half the bytes to copy, hash and send), and copied to CPU
    on rank 0: into fresh tensors by default (checkpoints, exports), or into views of a
    ``staging`` buffer (publishes; valid until the next-but-one call with that staging). Default
    dtype: the master weights' (fp32). With ``drop_tied`` the ``lm_head.weight`` of a
    tied-embedding model is left out (HF and vLLM loaders re-tie it; vLLM's ``load_weights``
    expects it absent).
    """
    import torch
    from torch.distributed.tensor import DTensor

    from services.learner.dist import rank_world

    rank0 = rank_world()[0] == 0
    tied = drop_tied and getattr(model.config, "tie_word_embeddings", False)
    items = [(n, t) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")]

    def out_dtype(t: Any) -> Any:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    from common.weights.layout import ALIGN  # the same tensor alignment as the wire layout

    on_cuda = any(t.device.type == "cuda" for _, t in items)
    flat = None
    if staging is not None and rank0:
        offsets, total = [], 0
        for _, t in items:
            offsets.append(total)
            total += -(-t.numel() * out_dtype(t).itemsize // ALIGN) * ALIGN
        flat = staging.take(max(total, 1), pinned=on_cuda)
    state: dict[str, Any] = {}
    for i, (name, tensor) in enumerate(items):
        t = tensor.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()  # all-gather: every rank takes part, only rank 0 keeps it
        if not rank0:
            continue
        t = t.to(out_dtype(t))
        if flat is None:
            state[name] = t.to("cpu", copy=True)
            continue
        nbytes = t.numel() * t.element_size()
        dst = flat[offsets[i] : offsets[i] + nbytes].view(t.dtype).view(t.shape)
        dst.copy_(t, non_blocking=t.device.type == "cuda")
        state[name] = dst
    if flat is not None and on_cuda:
        torch.cuda.synchronize()  # the asynchronous copies into page-locked memory have landed
    return state
