"""Export the policy as a Hugging Face directory (safetensors shards + index, config, tokenizer).

``tether export CHECKPOINT OUT`` calls ``export_hf`` on a checkpoint directory (or a run directory,
meaning its latest checkpoint); the learner can also call it on the live (FSDP-sharded) model,
which is a collective: every rank calls it and rank 0 writes. The output loads with
``transformers.AutoModelForCausalLM.from_pretrained`` and with vLLM.

Streamed: tensors are read (from a checkpoint's shards) or gathered (from the live model) one
at a time, in name order, converted back to the checkpoint layout transformers saves
(``revert_weight_conversion``, one decoder layer at a time: fused MoE experts become one tensor
per expert again), and written into safetensors files of at most ``shard_bytes`` as they fill.
So the writer holds one decoder layer plus the file being filled, never the model.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.learner import checkpoint_state, checkpoint_v1, gather, lora
from services.learner.checkpoint import STATE_DIR, latest_checkpoint
from services.learner.checkpoint_v1 import ADAPTER_FILE
from services.learner.dist import rank_world
from services.learner.model import attention_kwargs
from services.learner.shard_loading import build_meta_from_config

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json")
SHARD_BYTES = 2 << 30  # HF-style files of at most 2 GiB
_LAYER = re.compile(r"^(.*\.layers\.\d+)\.")


def _resolve_checkpoint(path: Path) -> Path:
    if (path / "meta.json").exists():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ValueError(
            f"{path} is neither a checkpoint directory (step-<N>/ with meta.json) nor a run "
            "directory with checkpoints/: pass `<run_dir>/checkpoints/step-<N>` or the run dir"
        )
    return latest


def _tokenizer_home(ckpt: Path) -> Path | None:
    """The checkpoint dir if it holds a tokenizer, else the model directory the run started from."""
    if any((ckpt / m).exists() for m in _TOKENIZER_MARKERS):
        return ckpt
    source = json.loads((ckpt / "meta.json").read_text(encoding="utf-8")).get("source_model_dir")
    return Path(source) if source else None


def _checked_tokenizer(tok_dir: Path | None) -> Path:
    if tok_dir is None:
        raise ValueError(
            "the checkpoint does not record the model directory it started from, so there is no "
            "tokenizer to copy: pass the tokenizer directory (tether export … --tokenizer DIR)"
        )
    if not any((tok_dir / m).exists() for m in _TOKENIZER_MARKERS):
        raise ValueError(
            f"no tokenizer found in {tok_dir}: pass tokenizer_dir (the original model directory "
            "the run started from) so the export is loadable on its own"
        )
    return tok_dir


def _checkpoint_tensors(ckpt: Path) -> Iterator[tuple[str, torch.Tensor]]:
    if checkpoint_v1.is_v1(ckpt):  # format 1 holds the whole model in one file anyway
        yield from sorted(checkpoint_v1.read_model_state(ckpt, tie_word_embeddings=False).items())
        return
    yield from checkpoint_state.full_tensors(ckpt / STATE_DIR)


class ShardWriter:
    """Safetensors files of at most ``shard_bytes`` (a tensor larger than that gets a file of
    its own), written as they fill; ``close()`` names them as ``save_pretrained`` does
    (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + the index)."""

    def __init__(self, out: Path, shard_bytes: int) -> None:
        self.out, self.shard_bytes = out, shard_bytes
        self.files: list[tuple[Path, list[str]]] = []
        self._pending: dict[str, Any] = {}
        self._bytes = self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._bytes + nbytes > self.shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous()
        self._bytes += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out / f"part-{len(self.files) + 1:05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self._pending)))
        self._pending, self._bytes = {}, 0

    def close(self) -> None:
        if self._pending or not self.files:
            self._flush()
        n = len(self.files)
        if n == 1:
            self.files[0][0].rename(self.out / "model.safetensors")
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.files, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            path.rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _by_layer(named: Iterable[tuple[str, Any]]) -> Iterator[dict[str, Any]]:
    """Consecutive tensors of one decoder layer together (names in sorted order), others alone."""
    group: dict[str, Any] = {}
    key = None
    for name, tensor in named:
        match = _LAYER.match(name)
        k = match.group(1) if match else name
        if group and k != key:
            yield group
            group = {}
        group[name], key = tensor, k
    if group:
        yield group


def _write_weights(named: Iterable[tuple[str, Any]], *, meta_model: Any, out: Path,
                   shard_bytes: int) -> None:  # fmt: skip
    """The tensors in the layout transformers saves (``revert_weight_conversion`` of each
    layer), a tied ``lm_head.weight`` left out, into shard files as they fill."""
    from transformers.core_model_loading import revert_weight_conversion

    tied = bool(getattr(meta_model.config, "tie_word_embeddings", False))
    writer = ShardWriter(out, shard_bytes)
    for group in _by_layer(named):
        for name, tensor in revert_weight_conversion(meta_model, group).items():
            if not (tied and name == "lm_head.weight"):
                writer.add(name, tensor)
        del group
    writer.close()


def _finish(config: Any, tmp: Path, out: Path, tok_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    config = copy.deepcopy(config)
    config.use_cache = True  # the learner turns the KV cache off for training; inference wants it
    config.dtype = torch.float32  # the fp32 master weights are what is written
    config.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(str(tok_dir)).save_pretrained(str(tmp))
    generation_config = tok_dir / "generation_config.json"
    if generation_config.exists():
        shutil.copyfile(generation_config, tmp / "generation_config.json")
    if out.exists():
        out.rmdir()  # checked empty by the caller
    tmp.rename(out)


def _adapter_from_checkpoint(ckpt: Path) -> tuple[str, dict, dict]:
    """(base model dir, adapter tensors, adapter config) of a LoRA checkpoint."""
    from safetensors.torch import load_file

    meta = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))
    base = meta.get("source_model_dir")
    if not base or not (Path(base) / "config.json").exists():
        raise ValueError(
            f"{ckpt} is a LoRA checkpoint whose base model directory {base!r} is not here: the "
            "adapter is exported merged into that base, so it must be readable where you export"
        )
    config = json.loads((ckpt / "adapter_config.json").read_text(encoding="utf-8"))
    return str(base), load_file(str(ckpt / ADAPTER_FILE)), config


def _write_lora(
    base_dir: str, state: dict, config: dict, *, out: Path, tokenizer_dir: Path
) -> None:
    """``OUT/adapter/`` (PEFT) and ``OUT/merged/`` (the base with the adapter merged in)."""
    import torch
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    adapter_dir, merged_dir = tmp / "adapter", tmp / "merged"
    adapter_dir.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(adapter_dir / ADAPTER_FILE))
    doc = {**config, "base_model_name_or_path": str(Path(base_dir).resolve())}
    (adapter_dir / "adapter_config.json").write_text(json.dumps(doc, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.save_pretrained(str(adapter_dir))
    base = AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, **attention_kwargs(base_dir)
    )
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.config.use_cache = True
    merged.save_pretrained(str(merged_dir))
    tokenizer.save_pretrained(str(merged_dir))
    generation_config = tokenizer_dir / "generation_config.json"
    if generation_config.exists():
        shutil.copyfile(generation_config, merged_dir / "generation_config.json")
    if out.exists():
        out.rmdir()  # checked empty by the caller
    tmp.rename(out)


def export_hf(
    source: str | Path | torch.nn.Module,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    *,
    shard_bytes: int = SHARD_BYTES,
) -> Path | None:
    """Write a HF model directory to ``out_dir`` from a checkpoint, a run dir, or a live model.

    ``tokenizer_dir``: where the tokenizer (and ``generation_config.json``) come from, usually the
    original model directory. For a checkpoint it defaults to the model directory the run started
    from (recorded in ``meta.json``); a live model needs it. ``shard_bytes``: the largest weight
    file (and so about the writer's memory beyond one decoder layer).
    Returns ``out_dir`` (``None`` on ranks other than 0 for a live sharded model).
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"export output {out} already exists and is not empty: pick a new path")
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be > 0, got {shard_bytes}")
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tok_dir: Path | None
    if isinstance(source, str | Path):
        from transformers import AutoConfig

        ckpt = _resolve_checkpoint(Path(source))
        tok_dir = _checked_tokenizer(
            Path(tokenizer_dir) if tokenizer_dir else _tokenizer_home(ckpt)
        )
        if (ckpt / ADAPTER_FILE).exists():  # LoRA: the adapter, and the base merged with it
            out.parent.mkdir(parents=True, exist_ok=True)
            _write_lora(*_adapter_from_checkpoint(ckpt), out=out, tokenizer_dir=tok_dir)
            return out
        config = AutoConfig.from_pretrained(str(ckpt))
        meta_model = build_meta_from_config(config)
        named: Iterable[tuple[str, Any]] = _checkpoint_tensors(ckpt)
        rank0 = True
    elif lora.is_lora(source):  # a LoRA adapter is small: gathered whole (a collective)
        state = lora.adapter_state(source)
        if not state:
            return None
        base = str(source.tether_source_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        config_doc = lora.adapter_config(source, base_model=base)
        tok = _checked_tokenizer(Path(tokenizer_dir) if tokenizer_dir else None)
        _write_lora(base, state, config_doc, out=out, tokenizer_dir=tok)
        return out
    else:
        config, meta_model = source.config, source
        named = gather.whole_tensors(source)  # a collective under FSDP: every rank iterates
        rank0 = rank_world()[0] == 0
        tok_dir = Path(tokenizer_dir) if tokenizer_dir else None
    named = iter(named)  # one pass: drained below on every path
    if not rank0:
        for _ in named:  # take part in every gather
            pass
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_weights(named, meta_model=meta_model, out=tmp, shard_bytes=shard_bytes)
        _finish(config, tmp, out, _checked_tokenizer(tok_dir))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for _ in named:  # the other ranks still gather: take part until the end
            pass
        raise
    logger.info("exported %s to %s", source if not hasattr(source, "config") else "model", out)
    return out
