"""What a sharded checkpoint holds as tensors, and how it is written and read: the model's and
the optimizer's state as each rank has it (its FSDP shards), saved with
``torch.distributed.checkpoint`` (DCP) into safetensors files.

Storage: DCP's Hugging Face safetensors writer in its distributed mode. Every rank writes its
own files (``shard-<rank>-model-<i>-of-<n>.safetensors``); each file's safetensors header
records, as JSON, where each of its slices sits in the whole tensor (``DCP_SHARDING_INFO``).
A reader builds DCP's metadata from those headers, so the checkpoint has no ``.metadata``
pickle (DCP's default file system format stores one and reads it with ``pickle.load``), and any
number of ranks can read it: each reads only the slices its own shards overlap (DCP's resharding
planner). The planning between ranks, in memory, goes through DCP's object collectives.

Keys: ``model/<Hugging Face name>`` (fp32 master weights; a tied ``lm_head.weight`` left out)
and ``optim/<parameter name>/<state name>`` (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``);
the optimizer's parameter groups and non-tensor state go to JSON beside them.

Files are cut by ``FILE_BYTES`` of whole-tensor bytes (about ``FILE_BYTES / world_size`` per
rank and file): the writer builds each file's bytes in memory before writing it, so that is a
save's extra memory per rank beyond its shards (and, with ``async_save``, a copy of the shards
taken so that training can go on while the copy is written).
"""

from __future__ import annotations

import contextlib
import copy
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MODEL, OPTIM = "model/", "optim/"
FILE_BYTES = 1 << 30


def model_state(model: Any) -> dict[str, Any]:
    """This rank's model state (DTensor shards under FSDP, views of the parameters themselves),
    keyed ``model/<name>``; a tied ``lm_head.weight`` is left out (the embedding holds it)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = get_model_state_dict(model)
    return {MODEL + k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}


def optimizer_state(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors keyed ``optim/<param>/<name>``, JSON: param groups and non-tensor state)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd: Any = get_optimizer_state_dict(model, optimizer)
    tensors: dict[str, Any] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, param_state in osd["state"].items():
        for name, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OPTIM}{fqn}/{name}"] = value
            else:
                scalars.setdefault(fqn, {})[name] = value
    return tensors, {"param_groups": osd["param_groups"], "scalars": scalars}


def _file_mapping(state: dict[str, Any]) -> dict[str, int]:
    """Key -> file index (from 1): files of about ``FILE_BYTES`` of whole tensors each."""
    mapping, index, used = {}, 1, 0
    for key in sorted(state):
        t = state[key]
        nbytes = t.numel() * t.element_size()
        if used and used + nbytes > FILE_BYTES:
            index, used = index + 1, 0
        mapping[key] = index
        used += nbytes
    return mapping


def writer(directory: Path, state: dict[str, Any]) -> Any:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    return HuggingFaceStorageWriter(
        str(directory), fqn_to_index_mapping=_file_mapping(state), save_distributed=True
    )


def save(directory: Path, state: dict[str, Any], *, group: Any, async_save: bool) -> Any:
    """Write ``state`` (every rank its own part) into ``directory``; a collective over
    ``group``. Returns DCP's future when ``async_save`` (the copy is taken before it returns),
    else ``None`` once every rank's files are written and fsynced."""
    import torch.distributed.checkpoint as dcp

    kwargs: dict[str, Any] = {"storage_writer": writer(directory, state)}
    with _one_process(kwargs, group):
        if async_save:
            return dcp.async_save(state, async_stager=_compact_stager(), **kwargs)
        dcp.save(state, **kwargs)
    return None


def _compact_stager() -> Any:
    """DCP's blocking stager, copying each tensor's own elements instead of deep-copying its
    storage. DCP's own (``_create_cpu_state_dict``) deep-copies a CPU DTensor, whose storage on
    ranks > 0 of an FSDP2 model is the whole parameter's buffer with the shard as a view into
    it; that copy fails ("Attempted to call copy_() on an invalid python storage"; found by
    tests/e2e/test_e2e_ranks.py) and would copy every rank's storage whole anyway."""
    import torch
    from torch.distributed.checkpoint.staging import BlockingAsyncStager
    from torch.distributed.tensor import DTensor

    def cpu_copy(v: Any) -> Any:
        if isinstance(v, DTensor):
            if v.device.type != "cpu":
                return v.to("cpu")  # a copy, as DCP's own stager makes for device tensors
            return DTensor.from_local(
                v.to_local().detach().clone(), v.device_mesh, v.placements,
                shape=v.shape, stride=v.stride(), run_check=False,
            )  # fmt: skip
        if isinstance(v, torch.Tensor):
            return v.detach().to("cpu", copy=True)
        return copy.deepcopy(v)

    class CompactStager(BlockingAsyncStager):
        def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:  # type: ignore[override]
            return {k: cpu_copy(v) for k, v in state_dict.items()}

    return CompactStager()


@contextlib.contextmanager
def _one_process(kwargs: dict[str, Any], group: Any) -> Iterator[None]:
    """DCP's arguments for this process: ``group`` under a process group, else ``no_dist``
    (one process, as in ``fsdp=False`` tests; DCP's warning that it assumes so is silenced)."""
    import torch.distributed as dist

    if dist.is_initialized():
        kwargs["process_group"] = group
        yield
        return
    kwargs["no_dist"] = True
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def saved_keys(directory: Path) -> dict[str, tuple[list[int], Any]]:
    """Every key the checkpoint holds: its whole shape and dtype (from the files' headers)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    meta = HuggingFaceStorageReader(str(directory)).read_metadata()
    return {
        k: (list(m.size), m.properties.dtype)  # type: ignore[union-attr]
        for k, m in meta.state_dict_metadata.items()
    }


def optimizer_template(model: Any, saved: dict[str, tuple[list[int], Any]]) -> dict[str, Any]:
    """Empty tensors to load the saved optimizer state into, sharded like the parameters they
    belong to (state of a parameter's shape, e.g. ``exp_avg``) or whole (e.g. ``step``)."""
    import torch

    params = dict(model.named_parameters())
    out: dict[str, Any] = {}
    for key, (shape, dtype) in saved.items():
        if not key.startswith(OPTIM):
            continue
        fqn = key[len(OPTIM) :].rsplit("/", 1)[0]
        param = params.get(fqn)
        if param is not None and list(param.shape) == shape:
            out[key] = torch.zeros_like(param, dtype=dtype)
        else:
            out[key] = torch.zeros(shape, dtype=dtype)
    return out


def load(directory: Path, state: dict[str, Any], *, group: Any) -> None:
    """Fill ``state``'s tensors in place from ``directory`` (each rank reads what its shards
    overlap, whatever the number of ranks that wrote it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    kwargs: dict[str, Any] = {"storage_reader": HuggingFaceStorageReader(str(directory))}
    with _one_process(kwargs, group):
        dcp.load(state, **kwargs)


def joined_optimizer_state(
    tensors: dict[str, Any], meta: dict[str, Any], *, prefix: str = OPTIM
) -> dict[str, Any]:
    """The optimizer state dict ``set_optimizer_state_dict`` takes, from the loaded tensors
    (keyed ``<prefix><parameter name>/<state name>``) and the JSON part. Format-1 checkpoints
    (``checkpoint_v1``) key their tensors without the prefix."""
    state: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        fqn, name = key[len(prefix) :].rsplit("/", 1)
        state.setdefault(fqn, {})[name] = value
    for fqn, values in meta["scalars"].items():
        state.setdefault(fqn, {}).update(values)
    groups = [
        {k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def full_tensors(directory: Path, *, prefix: str = MODEL) -> Iterator[tuple[str, torch.Tensor]]:
    """Each whole tensor under ``prefix`` (prefix removed), assembled from the slices every rank
    wrote, one tensor at a time, in name order: what an export reads (at most one whole tensor
    in memory at a time, besides the memory-mapped files)."""
    import torch
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    handles = {f: safe_open(str(f), framework="pt") for f in files}
    try:
        where: dict[str, list[tuple[Any, list[int] | None]]] = {}
        for h in handles.values():
            info = json.loads((h.metadata() or {}).get("DCP_SHARDING_INFO", "{}"))
            for key in h.keys():
                if key.startswith(prefix):
                    where.setdefault(key, []).append((h, info.get(key, {}).get("saved_offsets")))
        shapes = saved_keys(directory)
        for key in sorted(where):
            shape, dtype = shapes[key]
            out = torch.empty(shape, dtype=dtype)
            for h, offsets in where[key]:
                part = h.get_tensor(key)
                start = offsets or [0] * part.dim()
                out[tuple(slice(o, o + n) for o, n in zip(start, part.shape, strict=True))] = part
                del part
            yield key[len(prefix) :], out
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
