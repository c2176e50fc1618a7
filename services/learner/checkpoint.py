"""Atomic, resumable learner checkpoints (no pickle anywhere: safetensors + JSON).

Layout under ``<run_dir>/checkpoints/``::

    step-<N>/model.safetensors       full fp32 weights, Hugging Face names (tied lm_head left out)
      or, for a LoRA learner (``learner.lora_rank``; meta ``"adapter": true``):
    step-<N>/adapter_model.safetensors   the fp32 adapter, PEFT's names (the base is run.model)
    step-<N>/adapter_config.json         its PEFT config (rank, alpha, target modules)
    step-<N>/optimizer.safetensors   AdamW tensors, keyed ``<param fqn>/<state name>``
    step-<N>/optimizer.json          param groups (lr, betas, ...) and non-tensor state
    step-<N>/scheduler.json          LambdaLR state (its schedule object is plain JSON)
    step-<N>/extra_state.json        caller's state: policy version, stream/data position, ...
    step-<N>/rng-rank<R>.json        torch / numpy / python (and CUDA) RNG states of rank R
    step-<N>/config.json             the model's HF config (for ``tether export``)
    step-<N>/meta.json               written last: step, world size, format version
    latest                           "step-<N>": replaced by write-temp + fsync + rename

A save writes everything into ``tmp-<N>-<pid>/``, fsyncs every file and the directory, renames it
to ``step-<N>/``, fsyncs ``checkpoints/``, then replaces ``latest``. A SIGKILL at any point leaves
the previous ``latest`` intact; a half-written ``tmp-*`` is ignored and removed by the next save.

Full (gathered) state dicts are used instead of DCP's sharded format because DCP reads its
metadata with ``pickle.load``; the price is that rank 0 holds one full copy of the weights and
optimizer state in CPU memory while saving. Resuming with a different number of ranks works.
Multi-node runs need ``run_dir`` on a filesystem every rank sees (each rank writes its RNG file
and reads the checkpoint itself).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.protocol.run_dir import RunDir
from services.learner import lora
from services.learner.dist import barrier, broadcast_int, rank_world
from services.learner.gather import full_state_dict_cpu

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's name, so the directory reads as an adapter
# Test hook: seconds to sleep after every file is written and before the rename (SIGKILL tests).
TEST_HOOK_SLEEP_ENV = "TETHER_TEST_HOOK_CHECKPOINT_SLEEP_BEFORE_RENAME_S"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path))
    _fsync_file(path)


def _rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    np_state: Any = np.random.get_state()
    state: dict[str, Any] = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    if torch.cuda.is_available():
        state["cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()
        ]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(
        torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8)
    )
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = [
            torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
            for s in state["cuda"]
        ]
        torch.cuda.set_rng_state_all(cuda_states)


def _optimizer_full_state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """Gathered optimizer state keyed by parameter names (a collective under FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def _split_optimizer_state(osd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, param_state in osd["state"].items():
        for name, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{fqn}/{name}"] = value.detach().cpu()
            else:
                scalars.setdefault(fqn, {})[name] = value
    return tensors, {"param_groups": osd["param_groups"], "scalars": scalars}


def _join_optimizer_state(tensors: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        fqn, name = key.rsplit("/", 1)
        state.setdefault(fqn, {})[name] = value
    for fqn, values in meta["scalars"].items():
        state.setdefault(fqn, {}).update(values)
    groups = []
    for group in meta["param_groups"]:
        groups.append({k: tuple(v) if k == "betas" else v for k, v in group.items()})
    return {"state": state, "param_groups": groups}


def _write_files(
    tmp: Path, *, model: Any, model_sd: dict, osd: dict, scheduler: Any, extra: str, meta: dict
) -> None:
    tensors, optim_meta = _split_optimizer_state(osd)
    if meta.get("adapter"):  # LoRA: the trained adapter only; the frozen base is the model dir
        _save_tensors(tmp / ADAPTER_FILE, model_sd)
        _write_json(
            tmp / "adapter_config.json",
            lora.adapter_config(model, base_model=meta.get("source_model_dir") or ""),
        )
    else:
        _save_tensors(tmp / "model.safetensors", model_sd)
    _save_tensors(tmp / "optimizer.safetensors", tensors)
    _write_json(tmp / "optimizer.json", optim_meta)
    _write_json(tmp / "scheduler.json", scheduler.state_dict())
    with open(tmp / "extra_state.json", "w", encoding="utf-8") as f:
        f.write(extra)
        f.flush()
        os.fsync(f.fileno())
    _write_json(tmp / "config.json", json.loads(model.config.to_json_string()))
    _write_json(tmp / "meta.json", meta)  # last: its presence marks a complete directory
    _fsync_dir(tmp)


def _publish(root: Path, tmp: Path, step: int) -> Path:
    """Rename ``tmp`` to ``step-<N>`` and point ``latest`` at it (each step durable)."""
    final = root / f"step-{step}"
    if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
        trash = root / f"trash-{step}-{os.getpid()}"
        final.rename(trash)
        shutil.rmtree(trash)
    tmp.rename(final)
    _fsync_dir(root)
    pointer_tmp = root / f"latest.tmp-{os.getpid()}"
    with open(pointer_tmp, "w", encoding="utf-8") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    pointer_tmp.replace(root / "latest")
    _fsync_dir(root)
    return final


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    found = []
    for path in root.iterdir() if root.exists() else []:
        match = _STEP_DIR.match(path.name)
        if match and (path / "meta.json").exists():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _prune(root: Path, *, keep_last: int, keep: Path) -> None:
    for _, path in _step_dirs(root)[:-keep_last]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)
    # Leftovers of saves killed mid-way (this save's own tmp dir is already renamed).
    for path in root.iterdir():
        if path.name.startswith(("tmp-", "trash-", "latest.tmp-")):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


# Tests only: seconds every rank sleeps at the start of each save (before anything is written),
# to stand for a real model's slow checkpoint (tests/services/test_learner_shutdown.py).
TEST_ONLY_DELAY_ENV = "TETHER_TEST_ONLY_CHECKPOINT_DELAY_S"


def _test_only_delay() -> None:
    delay_s = float(os.environ.get(TEST_ONLY_DELAY_ENV) or 0)
    if delay_s > 0:
        logger.warning(
            "%s=%g: sleeping before this checkpoint (a test hook)", TEST_ONLY_DELAY_ENV, delay_s
        )
        time.sleep(delay_s)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    extra_state: dict[str, Any],
    keep_last: int = 3,
) -> Path:
    """Save a complete checkpoint for optimizer step ``step``; every rank must call it.

    ``extra_state`` must be JSON-serialisable (policy version, data-dispatch position, consumed
    trajectory ids, stream position, ...). Returns the final ``step-<N>`` directory.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (checkpoints to keep), got {keep_last}")
    try:
        extra = json.dumps(extra_state)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint extra_state must be JSON-serialisable: {exc}") from exc
    rank, world = rank_world()
    t0 = time.perf_counter()
    _test_only_delay()
    # Collectives first, on every rank, in the same order.
    adapter = lora.is_lora(model)
    model_sd = lora.adapter_state(model) if adapter else full_state_dict_cpu(model, drop_tied=True)
    osd = _optimizer_full_state(model, optimizer)
    root = RunDir(Path(run_dir)).checkpoints
    device = next(model.parameters()).device
    tmp = root / f"tmp-{step}-{broadcast_int(os.getpid(), device)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    barrier()
    _write_json(tmp / f"rng-rank{rank}.json", _rng_state())
    barrier()
    final = root / f"step-{step}"
    if rank == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": world,
            "source_model_dir": getattr(model, "tether_source_dir", None),  # tokenizer for export
            "adapter": adapter,  # LoRA: adapter files instead of model.safetensors
        }
        _write_files(
            tmp,
            model=model,
            model_sd=model_sd,
            osd=osd,
            scheduler=scheduler,
            extra=extra,
            meta=meta,
        )
        hook_sleep = float(os.environ.get(TEST_HOOK_SLEEP_ENV, "0") or 0)
        if hook_sleep > 0:
            logger.warning(
                "test hook %s: sleeping %.1f s before rename", TEST_HOOK_SLEEP_ENV, hook_sleep
            )
            time.sleep(hook_sleep)
        final = _publish(root, tmp, step)
        _prune(root, keep_last=keep_last, keep=final)
        logger.info("checkpoint %s saved in %.2f s", final, time.perf_counter() - t0)
    barrier()
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The directory ``latest`` points to; if the pointer is missing or broken, the newest
    complete ``step-<N>``; ``None`` when there is no checkpoint."""
    root = RunDir(Path(run_dir)).checkpoints
    pointer = root / "latest"
    if pointer.exists():
        target = root / pointer.read_text(encoding="utf-8").strip()
        if _STEP_DIR.match(target.name) and (target / "meta.json").exists():
            return target
        logger.warning(
            "checkpoint pointer %s is broken; using the newest complete checkpoint", pointer
        )
    dirs = _step_dirs(root)
    return dirs[-1][1] if dirs else None


def read_model_state(checkpoint_dir: Path, *, tie_word_embeddings: bool) -> dict[str, Any]:
    """The checkpoint's full model state dict (CPU), with a tied ``lm_head.weight`` re-added."""
    from safetensors.torch import load_file

    state = load_file(str(checkpoint_dir / "model.safetensors"))
    if tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def _check_kind(ckpt: Path, *, saved_adapter: bool, model: Any) -> None:
    """A LoRA checkpoint resumes a LoRA learner and a full one a full one (``ValueError``)."""
    if saved_adapter and not lora.is_lora(model):
        raise ValueError(
            f"{ckpt} holds a LoRA adapter, but this learner trains every weight: resume with "
            "the run's learner.lora_rank (and lora_target_modules)"
        )
    if not saved_adapter and lora.is_lora(model):
        raise ValueError(
            f"{ckpt} holds full weights, but this learner trains a LoRA adapter: resume with "
            "learner.lora_rank = 0 (or start a new LoRA run from a `tether export` of it)"
        )


def load_checkpoint(
    run_dir: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    checkpoint_dir: str | Path | None = None,
) -> dict[str, Any] | None:
    """Restore model, optimizer, scheduler and this rank's RNG from the latest checkpoint.

    Every rank must call it. Returns the saved ``extra_state`` plus ``"checkpoint_step"``, or
    ``None`` when ``run_dir`` has no checkpoint (fresh start). ``checkpoint_dir`` picks one.
    """
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    ckpt = Path(checkpoint_dir) if checkpoint_dir else latest_checkpoint(run_dir)
    if ckpt is None:
        return None
    if not (ckpt / "meta.json").exists():
        raise ValueError(f"{ckpt} is not a complete Tether checkpoint (no meta.json)")
    meta = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{ckpt}: checkpoint format {meta.get('format_version')} is not {FORMAT_VERSION}"
        )
    options = StateDictOptions(full_state_dict=True)
    _check_kind(ckpt, saved_adapter=bool(meta.get("adapter")), model=model)
    if meta.get("adapter"):
        lora.load_adapter_state(model, load_file(str(ckpt / ADAPTER_FILE)))
    else:
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        state = read_model_state(ckpt, tie_word_embeddings=tied)
        set_model_state_dict(model, state, options=options)
    optim_meta = json.loads((ckpt / "optimizer.json").read_text(encoding="utf-8"))
    osd = _join_optimizer_state(load_file(str(ckpt / "optimizer.safetensors")), optim_meta)
    set_optimizer_state_dict(model, optimizer, osd, options=options)
    scheduler.load_state_dict(json.loads((ckpt / "scheduler.json").read_text(encoding="utf-8")))
    rank, world = rank_world()
    rng_file = ckpt / f"rng-rank{rank}.json"
    if rng_file.exists():
        _set_rng_state(json.loads(rng_file.read_text(encoding="utf-8")))
    else:
        logger.warning(
            "%s has no RNG state for rank %d (saved with %d ranks)", ckpt, rank, meta["world_size"]
        )
    extra = json.loads((ckpt / "extra_state.json").read_text(encoding="utf-8"))
    extra["checkpoint_step"] = meta["step"]
    logger.info("resumed from %s (step %d)", ckpt, meta["step"])
    return extra
