"""Atomic, resumable, sharded learner checkpoints (no pickle in any file: safetensors + JSON).

Layout under ``<run_dir>/checkpoints/``::

    step-<N>/state/*.safetensors     model and optimizer shards, every rank its own files
                                     (``checkpoint_state``: DCP, resharded on load); for a
                                     LoRA learner (``learner.lora_rank``; meta "adapter": true)
                                     the optimizer's only, and instead of the model:
    step-<N>/adapter_model.safetensors   the fp32 adapter, PEFT's names (the base is run.model)
    step-<N>/adapter_config.json         its PEFT config (rank, alpha, target modules)
    step-<N>/optimizer.json          param groups (lr, betas, ...) and non-tensor state
    step-<N>/scheduler.json          LambdaLR state (its schedule object is plain JSON)
    step-<N>/extra_state.json        caller's state: policy version, stream/data position, ...
    step-<N>/rng-rank<R>.json        torch / numpy / python (and CUDA) RNG states of rank R
    step-<N>/config.json             the model's HF config (for ``tether export``)
    step-<N>/meta.json               written last: step, world size, format version
    latest                           "step-<N>": replaced by write-temp + fsync + rename

A save writes everything into ``tmp-<N>-<pid>/`` (every rank its own shards, fsynced), then rank
0 writes ``meta.json``, fsyncs the directory, renames it to ``step-<N>/``, fsyncs
``checkpoints/``, then replaces ``latest``. A SIGKILL at any point leaves the previous ``latest``
intact; a half-written ``tmp-*`` is ignored, and removed when the learner starts
(``remove_leftovers``) and after the next save.

A save that fails for lack of space (``ENOSPC``, ``EDQUOT``) on any rank removes its half-written
directory and raises ``DiskFull`` on every rank, with the path, the bytes it needed and those
free: the learner stops (exit 2: retrying would retrain the same steps into the same full disk)
and ``tether train --resume`` continues from the last good checkpoint once there is room. With
``async_save`` the failure surfaces where the save is finished (``PendingCheckpoint``).

No rank ever holds more than its own shards (plus the file being written): a checkpoint of a
model that does not fit one rank's memory is written and read as it is trained. Resuming on a
different number of ranks works (each reads the slices its new shards overlap). With
``async_save`` (``learner.async_checkpoint``) the shards are copied in memory and written by a
thread while training goes on; the rename, ``latest`` and the acknowledgement of the trained
entries wait until every rank's files are on disk (``PendingCheckpoint``). Checkpoints of format
1 (the whole state, written by rank 0 alone) still resume (``checkpoint_v1``). Multi-node runs
need ``run_dir`` on a filesystem every rank sees (each rank writes its shards and RNG file and
reads the checkpoint itself).
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

import numpy as np

from common.protocol.run_dir import RunDir
from services.learner import checkpoint_state, checkpoint_v1, lora
from services.learner.checkpoint_disk import disk_full, no_room, remove_leftovers
from services.learner.dist import any_rank, broadcast_int, rank_world

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
STATE_DIR = "state"
ADAPTER_FILE = checkpoint_v1.ADAPTER_FILE  # PEFT's name, so the directory reads as an adapter
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


def _rng_state() -> dict[str, Any]:
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


def _write_small_files(tmp: Path, *, model: Any, optim_meta: dict, scheduler: Any,
                       extra: str, adapter: dict | None) -> None:  # fmt: skip
    """Rank 0: everything but the shards and ``meta.json`` (``adapter``: a LoRA learner's)."""
    if adapter is not None:  # LoRA: the trained adapter only; the frozen base is the model dir
        _save_tensors(tmp / ADAPTER_FILE, adapter)
        base = getattr(model, "tether_source_dir", None) or ""
        _write_json(tmp / "adapter_config.json", lora.adapter_config(model, base_model=base))
    _write_json(tmp / "optimizer.json", optim_meta)
    _write_json(tmp / "scheduler.json", scheduler.state_dict())
    with open(tmp / "extra_state.json", "w", encoding="utf-8") as f:
        f.write(extra)
        f.flush()
        os.fsync(f.fileno())
    _write_json(tmp / "config.json", json.loads(model.config.to_json_string()))


def _save_tensors(path: Path, tensors: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path))
    _fsync_file(path)


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
    remove_leftovers(root)  # this save's own tmp dir is already renamed


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


class PendingCheckpoint:
    """A save whose shards may still be being written (``async_save``); ``wait()`` (every rank,
    at the same point) or ``poll()`` (rank 0 between steps) finish it: rank 0 writes
    ``meta.json``, renames the directory and moves ``latest``."""

    def __init__(self, *, root: Path, tmp: Path, step: int, future: Any, meta: dict,
                 keep_last: int, t0: float, states: tuple[dict[str, Any], ...]) -> None:  # fmt: skip
        self.root, self.tmp, self.step, self.future = root, tmp, step, future
        self.meta, self.keep_last, self.t0 = meta, keep_last, t0
        self.states = states  # what the save writes: the size ``DiskFull`` names
        self.path: Path | None = None  # the published step-<N> (rank 0), once finished

    def poll(self) -> Path | None:
        """Rank 0: the checkpoint's directory once it is complete and published, else ``None``
        (without waiting). Other ranks: always ``None`` (their part ends in ``wait``)."""
        if self.path is not None or rank_world()[0] != 0:
            return self.path
        if self.future is not None and not self.future.done():
            return None
        try:
            return self._finish()
        except BaseException as exc:  # rank 0 alone here: no collective to tell the others
            room = no_room(exc)
            if room is None:
                raise
            raise self._give_up(room) from exc

    def wait(self) -> Path:
        """Every rank: block until this rank's shards are written; rank 0 then publishes the
        checkpoint; every rank returns its directory once it is published."""
        failure: OSError | None = None
        try:
            if self.future is not None:
                self.future.result()  # raises what the writer thread raised
                self.future = None
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if (failure := no_room(exc)) is None:
                raise
        device = _device_of(self.states)
        if not any_rank(failure is not None, device) and rank_world()[0] == 0:
            try:
                self._finish()
            except BaseException as exc:
                if (failure := no_room(exc)) is None:
                    raise
        if any_rank(failure is not None, device):  # every rank leaves here together
            raise self._give_up(failure)
        return self.root / f"step-{self.step}"

    def _give_up(self, failure: OSError | None) -> Exception:
        """No room: remove the half-written directory (rank 0); the error every rank raises."""
        if rank_world()[0] == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return disk_full(self.root, self.step, failure, states=self.states)

    def _finish(self) -> Path:
        if self.path is None:
            if self.future is not None:
                self.future.result()
            hook_sleep = float(os.environ.get(TEST_HOOK_SLEEP_ENV, "0") or 0)
            if hook_sleep > 0:
                logger.warning(
                    "test hook %s: sleeping %.1f s before rename", TEST_HOOK_SLEEP_ENV, hook_sleep
                )
                time.sleep(hook_sleep)
            _write_json(self.tmp / "meta.json", self.meta)  # last: marks a complete directory
            _fsync_dir(self.tmp)
            self.path = _publish(self.root, self.tmp, self.step)
            _prune(self.root, keep_last=self.keep_last, keep=self.path)
            logger.info("checkpoint %s saved in %.2f s", self.path, time.perf_counter() - self.t0)
        return self.path


def _device_of(states: tuple[dict[str, Any], ...]) -> Any:
    """The device of the save's tensors: where ``any_rank``'s collective runs."""
    import torch

    for state in states:
        for value in state.values():
            if isinstance(value, torch.Tensor):
                return value.device
    return torch.device("cpu")


def _group() -> Any:
    """The process group of checkpoint collectives: one of its own (gloo), so that an async
    save's writer thread never interleaves its collectives with training's on the default
    group. Built once, by every rank, at the first save."""
    import torch.distributed as dist

    global _CHECKPOINT_GROUP
    if not dist.is_initialized():
        return None
    if _CHECKPOINT_GROUP is None:
        _CHECKPOINT_GROUP = dist.new_group(backend="gloo")
    return _CHECKPOINT_GROUP


_CHECKPOINT_GROUP: Any = None


def start_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    extra_state: dict[str, Any],
    keep_last: int = 3,
    async_save: bool = False,
) -> PendingCheckpoint:
    """Start saving a complete checkpoint for optimizer step ``step``; every rank must call it.
    Returns once this rank's shards are written (or, with ``async_save``, copied for the writer
    thread); finish it with ``wait()`` or ``poll()``.

    ``extra_state`` must be JSON-serialisable (policy version, data-dispatch position, consumed
    trajectory ids, stream position, ...).
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
    group = _group()
    adapter = lora.adapter_state(model) if lora.is_lora(model) else None  # rank 0: whole
    model_sd = {} if adapter is not None else checkpoint_state.model_state(model)
    optim_tensors, optim_meta = checkpoint_state.optimizer_state(model, optimizer)
    root = RunDir(Path(run_dir)).checkpoints
    device = next(model.parameters()).device
    tmp = root / f"tmp-{step}-{broadcast_int(os.getpid(), device)}"
    states = (adapter or {}, model_sd, optim_tensors)
    failure: OSError | None = None
    future = None
    try:  # each rank's part; a lack of space on any rank fails the save on every rank
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            _write_small_files(tmp, model=model, optim_meta=optim_meta, scheduler=scheduler,
                               extra=extra, adapter=adapter)  # fmt: skip
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if (failure := no_room(exc)) is None:
            raise
    if not any_rank(failure is not None, device):
        try:  # DCP's save is a collective: a rank that fails to write fails it on every rank
            _write_json(tmp / f"rng-rank{rank}.json", _rng_state())
            future = checkpoint_state.save(
                tmp / STATE_DIR, {**model_sd, **optim_tensors}, group=group, async_save=async_save
            )
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if (failure := no_room(exc)) is None:
                raise
    meta = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": world,
        "source_model_dir": getattr(model, "tether_source_dir", None),  # tokenizer for export
        "adapter": lora.is_lora(model),  # LoRA: adapter files instead of model weights
    }
    pending = PendingCheckpoint(root=root, tmp=tmp, step=step, future=future, meta=meta,
                                keep_last=keep_last, t0=t0, states=states)  # fmt: skip
    if any_rank(failure is not None, device):  # every rank leaves here together
        raise pending._give_up(failure)
    return pending


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
    """Save a complete checkpoint for optimizer step ``step`` and return its ``step-<N>``
    directory once it is published; every rank must call it."""
    return start_checkpoint(
        run_dir, step, model=model, optimizer=optimizer, scheduler=scheduler,
        extra_state=extra_state, keep_last=keep_last,
    ).wait()  # fmt: skip


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
    """The checkpoint's whole model state dict (CPU), with a tied ``lm_head.weight`` re-added.
    Holds the whole model: for tests and small models (``tether export`` streams instead)."""
    if checkpoint_v1.is_v1(checkpoint_dir):
        return checkpoint_v1.read_model_state(
            checkpoint_dir, tie_word_embeddings=tie_word_embeddings
        )
    state = dict(checkpoint_state.full_tensors(checkpoint_dir / STATE_DIR))
    if tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def check_kind(ckpt: Path, *, saved_adapter: bool, model: Any) -> None:
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


def _load_sharded(ckpt: Path, *, model: Any, optimizer: Any, adapter: bool) -> None:
    """Every rank reads the slices of the model and optimizer state its shards overlap (a
    LoRA learner: the whole adapter file, then the optimizer's slices)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    saved = checkpoint_state.saved_keys(ckpt / STATE_DIR)
    if adapter:
        lora.load_adapter_state(model, load_file(str(ckpt / ADAPTER_FILE)))
    model_sd = {} if adapter else checkpoint_state.model_state(model)
    absent = sorted(k for k in model_sd if k not in saved)
    wrong = sorted(k for k in model_sd if k in saved and saved[k][0] != list(model_sd[k].shape))
    if absent or wrong:
        raise ValueError(
            f"{ckpt} was not saved from this model: {len(absent)} weight(s) missing "
            f"({absent[:3]}), {len(wrong)} of another shape ({wrong[:3]}). Resume with the "
            "model the run started from, or start a new run directory"
        )
    optim = checkpoint_state.optimizer_template(model, saved)
    checkpoint_state.load(ckpt / STATE_DIR, {**model_sd, **optim}, group=_group())
    meta = json.loads((ckpt / "optimizer.json").read_text(encoding="utf-8"))
    osd = checkpoint_state.joined_optimizer_state(optim, meta)
    set_optimizer_state_dict(model, optimizer, osd)


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
    rank = rank_world()[0]
    root = RunDir(Path(run_dir)).checkpoints
    if rank == 0 and (n := remove_leftovers(root)):  # at start: what killed saves left
        logger.info("removed %d half-written checkpoint leftover(s) from %s", n, root)
    ckpt = Path(checkpoint_dir) if checkpoint_dir else latest_checkpoint(run_dir)
    if ckpt is None:
        return None
    if not (ckpt / "meta.json").exists():
        raise ValueError(f"{ckpt} is not a complete Tether checkpoint (no meta.json)")
    meta = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))
    version = meta.get("format_version")
    if version in (FORMAT_VERSION, checkpoint_v1.FORMAT_VERSION):
        check_kind(ckpt, saved_adapter=bool(meta.get("adapter")), model=model)
    if version == FORMAT_VERSION:
        _load_sharded(ckpt, model=model, optimizer=optimizer, adapter=bool(meta.get("adapter")))
    elif version == checkpoint_v1.FORMAT_VERSION:
        checkpoint_v1.load_state(ckpt, model=model, optimizer=optimizer)
    else:
        raise ValueError(
            f"{ckpt}: checkpoint format {version!r} is not one this Tether reads "
            f"({checkpoint_v1.FORMAT_VERSION} or {FORMAT_VERSION}): resume it with the Tether "
            "that wrote it, or start a new run directory"
        )
    scheduler.load_state_dict(json.loads((ckpt / "scheduler.json").read_text(encoding="utf-8")))
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
