"""Checkpoints: exact resume (sync and async saves), atomicity under SIGKILL (real subprocess),
keep-last, format-1 checkpoints still resuming, HF export. Sharded (FSDP, several ranks)
checkpoints and resuming on another number of ranks: tests/services/test_checkpoint_ranks.py."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from services.learner.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    read_model_state,
    save_checkpoint,
    start_checkpoint,
)
from services.learner.checkpoint_disk import DiskFull
from services.learner.export import export_hf
from services.learner.model import load_policy, token_logprobs_and_entropy
from services.learner.optim import build_optimizer, build_schedule, build_scheduler
from services.learner.train_step import train_step
from tests.fs_faults import resize, small_tmpfs, used_kb
from tests.paths import REPO
from tether.demo.tiny_model import build_tiny_model

WRITER = REPO / "tests" / "procs" / "checkpoint_writer.py"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=64, num_layers=2)


def _training(model_dir: Path):
    import torch

    model = load_policy(model_dir, device=torch.device("cpu"), fsdp=False)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    schedule = build_schedule(warmup_steps=2, total_steps=6, decay="cosine", min_lr_ratio=0.1)
    return model, optimizer, build_scheduler(optimizer, schedule)


def _step(model, optimizer, scheduler):
    """One step on a batch drawn from the torch, numpy and python RNGs (so resume must restore
    all three for the next batch to be the uninterrupted run's)."""
    import torch

    rows = 2 + random.randrange(2)
    seq_len = 10 + int(np.random.randint(0, 4))
    ids = torch.randint(0, 250, (rows, seq_len))
    response = torch.zeros_like(ids)
    response[:, 4:] = 1

    def loss_fn(m, mb):
        logp, _ = token_logprobs_and_entropy(m, mb["ids"], torch.ones_like(mb["ids"]), mb["resp"])
        return -(logp * mb["resp"]).sum() / response.sum()

    mbs = [{"ids": ids[i : i + 1], "resp": response[i : i + 1]} for i in range(rows)]
    return train_step(model, optimizer, scheduler, mbs, loss_fn, grad_clip=1.0)


def _seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def test_resume_equals_uninterrupted_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    _seed(7)
    model, optimizer, scheduler = _training(tiny_model_dir)
    straight = [_step(model, optimizer, scheduler) for _ in range(4)]
    straight_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}

    _seed(7)
    model, optimizer, scheduler = _training(tiny_model_dir)
    for step in (1, 2):
        _step(model, optimizer, scheduler)
        extra = {"policy_version": step, "stream_id": f"17-{step}", "consumed": ["a", "b"]}
        save_checkpoint(tmp_path, step, model=model, optimizer=optimizer, scheduler=scheduler,
                        extra_state=extra, keep_last=1)  # fmt: skip
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-2"]  # pruned to keep_last
    assert (ckpts / "latest").read_text().strip() == "step-2"

    _seed(999)  # a restarted process: different RNG, fresh objects
    model, optimizer, scheduler = _training(tiny_model_dir)
    extra = load_checkpoint(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler)
    assert extra == {
        "policy_version": 2,
        "stream_id": "17-2",
        "consumed": ["a", "b"],
        "checkpoint_step": 2,
    }
    resumed = [_step(model, optimizer, scheduler) for _ in range(2)]
    for got, want in zip(resumed, straight[2:], strict=True):
        print(
            f"resumed loss {got.loss:.9f} lr {got.lr:.3e}; uninterrupted {want.loss:.9f} lr {want.lr:.3e}"
        )
        assert got.lr == want.lr
        assert got.loss == pytest.approx(want.loss, abs=1e-6)
    max_diff = max(
        float((v - straight_weights[k]).abs().max()) for k, v in model.state_dict().items()
    )
    print(f"resume vs uninterrupted: max |weight diff| after 4 steps = {max_diff:.3e}")
    assert max_diff <= 1e-6


def test_async_save_holds_the_state_it_was_started_at(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Training goes on while an async save is written: the checkpoint is the state at its
    start, and resuming from it retraces the uninterrupted run."""
    _seed(7)
    model, optimizer, scheduler = _training(tiny_model_dir)
    straight = [_step(model, optimizer, scheduler) for _ in range(3)]

    _seed(7)
    model, optimizer, scheduler = _training(tiny_model_dir)
    _step(model, optimizer, scheduler)
    pending = start_checkpoint(tmp_path, 1, model=model, optimizer=optimizer,
                               scheduler=scheduler, extra_state={"v": 1}, async_save=True)  # fmt: skip
    _step(model, optimizer, scheduler)  # changes the weights in place while the save runs
    assert pending.wait() == tmp_path / "checkpoints" / "step-1"
    assert pending.poll() == latest_checkpoint(tmp_path)

    _seed(999)
    model, optimizer, scheduler = _training(tiny_model_dir)
    assert load_checkpoint(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler) == {
        "v": 1,
        "checkpoint_step": 1,
    }
    resumed = [_step(model, optimizer, scheduler) for _ in range(2)]
    for got, want in zip(resumed, straight[1:], strict=True):
        assert got.loss == pytest.approx(want.loss, abs=1e-6)


def _write_format1(model, optimizer, scheduler, ckpt: Path, *, step: int) -> None:
    """A checkpoint as Tether wrote them before sharded checkpoints (format 1)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    ckpt.mkdir(parents=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(ckpt / "model.safetensors"))
    osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    tensors, scalars = {}, {}
    for fqn, param_state in osd["state"].items():
        for name, value in param_state.items():
            tensors[f"{fqn}/{name}"] = value.detach().clone()
    save_file(tensors, str(ckpt / "optimizer.safetensors"))
    files = {
        "optimizer.json": {"param_groups": osd["param_groups"], "scalars": scalars},
        "scheduler.json": scheduler.state_dict(),
        "extra_state.json": {"policy_version": step},
        "config.json": json.loads(model.config.to_json_string()),
        "meta.json": {"format_version": 1, "step": step, "world_size": 1},
    }
    for name, data in files.items():
        (ckpt / name).write_text(json.dumps(data))
    (ckpt.parent / "latest").write_text(ckpt.name + "\n")


def test_format1_checkpoint_resumes(tiny_model_dir: Path, tmp_path: Path) -> None:
    _seed(7)
    model, optimizer, scheduler = _training(tiny_model_dir)
    straight = [_step(model, optimizer, scheduler) for _ in range(3)]

    _seed(7)
    model, optimizer, scheduler = _training(tiny_model_dir)
    _step(model, optimizer, scheduler)
    _write_format1(model, optimizer, scheduler, tmp_path / "checkpoints" / "step-1", step=1)
    model, optimizer, scheduler = _training(tiny_model_dir)
    extra = load_checkpoint(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler)
    assert extra == {"policy_version": 1, "checkpoint_step": 1}
    resumed = [_step(model, optimizer, scheduler) for _ in range(2)]
    for got, want in zip(resumed, straight[1:], strict=True):
        assert got.loss == pytest.approx(want.loss, abs=1e-6)
    # the next save is sharded; an unknown format is refused with the reason
    path = save_checkpoint(tmp_path, 3, model=model, optimizer=optimizer, scheduler=scheduler,
                           extra_state={})  # fmt: skip
    assert json.loads((path / "meta.json").read_text())["format_version"] == 2
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "format_version": 9}))
    with pytest.raises(ValueError, match="checkpoint format 9 is not one this Tether reads"):
        load_checkpoint(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler)


def test_load_without_checkpoint_returns_none(tiny_model_dir: Path, tmp_path: Path) -> None:
    model, optimizer, scheduler = _training(tiny_model_dir)
    assert load_checkpoint(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler) is None


def test_extra_state_must_be_json(tiny_model_dir: Path, tmp_path: Path) -> None:
    model, optimizer, scheduler = _training(tiny_model_dir)
    with pytest.raises(ValueError, match="JSON"):
        save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, scheduler=scheduler,
                        extra_state={"ids": {1, 2}})  # fmt: skip
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True])
def test_sigkill_during_save_keeps_previous_checkpoint(
    tiny_model_dir: Path, tmp_path: Path, async_save: bool
) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(WRITER), "--model", str(tiny_model_dir), "--run-dir", str(run_dir)]
    cmd += ["--async"] if async_save else []
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    ckpts = run_dir / "checkpoints"
    deadline = time.monotonic() + 120
    try:
        # Wait until save 2 has written its shards (its meta.json comes after the hook's sleep).
        while not list(ckpts.glob("tmp-2-*/state/*.safetensors")):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "checkpoint writer never reached the save-2 hook"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # still writing shards, or in the hook: mid-save
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert (ckpts / "latest").read_text().strip() == "step-1"
    assert not (ckpts / "step-2").exists()
    assert list(ckpts.glob("tmp-2-*"))  # the interrupted save really was in progress

    model, optimizer, scheduler = _training(tiny_model_dir)
    extra = load_checkpoint(run_dir, model=model, optimizer=optimizer, scheduler=scheduler)
    assert extra == {"policy_version": 1, "checkpoint_step": 1}
    saved = read_model_state(ckpts / "step-1", tie_word_embeddings=True)
    assert set(saved) == set(model.state_dict())
    assert all(bool((model.state_dict()[k] == v).all()) for k, v in saved.items())
    assert scheduler.last_epoch == 1
    # The next save cleans the debris of the killed one.
    save_checkpoint(run_dir, 2, model=model, optimizer=optimizer, scheduler=scheduler,
                    extra_state={"policy_version": 2})  # fmt: skip
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-1", "step-2"]
    assert json.loads((ckpts / "step-2" / "meta.json").read_text())["step"] == 2


def test_a_full_disk_fails_the_save_cleanly_and_the_run_can_go_on(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # A real full filesystem: a tmpfs with room for one checkpoint and a half.

    ckpts = tmp_path / "run" / "checkpoints"
    model, optimizer, scheduler = _training(tiny_model_dir)
    with small_tmpfs(ckpts, 64 * 1024):
        _step(model, optimizer, scheduler)
        save_checkpoint(tmp_path / "run", 1, model=model, optimizer=optimizer,
                        scheduler=scheduler, extra_state={"v": 1})  # fmt: skip
        one = used_kb(ckpts)
        resize(ckpts, one * 3 // 2)
        _step(model, optimizer, scheduler)
        with pytest.raises(DiskFull) as err:
            save_checkpoint(tmp_path / "run", 2, model=model, optimizer=optimizer,
                            scheduler=scheduler, extra_state={"v": 2})  # fmt: skip
        text = str(err.value)
        for needle in (
            f"checkpoint step-2 could not be written to {ckpts}",
            "No space left",
            "MiB free",
            "it needs about",
            "run.run_dir",
            "tether train --resume",
        ):
            assert needle in text, text
        assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-1"]  # no tmp-* left
        fresh = _training(tiny_model_dir)
        extra = load_checkpoint(tmp_path / "run", model=fresh[0], optimizer=fresh[1],
                                scheduler=fresh[2])  # fmt: skip
        assert extra == {"v": 1, "checkpoint_step": 1}  # the previous one stands
        resize(ckpts, one * 4)  # space freed
        save_checkpoint(tmp_path / "run", 2, model=model, optimizer=optimizer,
                        scheduler=scheduler, extra_state={"v": 2})  # fmt: skip
        assert (ckpts / "latest").read_text().strip() == "step-2"


def test_leftovers_of_killed_saves_are_removed_at_start(tiny_model_dir: Path, tmp_path: Path):
    model, optimizer, scheduler = _training(tiny_model_dir)
    save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, scheduler=scheduler,
                    extra_state={})  # fmt: skip
    ckpts = tmp_path / "checkpoints"
    for name in ("tmp-2-111", "tmp-2-222", "trash-1-333"):
        (ckpts / name).mkdir()
        (ckpts / name / "model.safetensors").write_bytes(b"half")
    (ckpts / "latest.tmp-444").write_text("step-2")
    assert load_checkpoint(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler)
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-1"]


def test_broken_latest_pointer_falls_back_to_newest_complete(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model, optimizer, scheduler = _training(tiny_model_dir)
    for step in (3, 5):
        save_checkpoint(tmp_path, step, model=model, optimizer=optimizer, scheduler=scheduler,
                        extra_state={})  # fmt: skip
    (tmp_path / "checkpoints" / "step-7").mkdir()  # incomplete: no meta.json
    (tmp_path / "checkpoints" / "latest").write_text("step-9\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-5"


def test_export_loads_with_transformers_and_gives_identical_logits(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _seed(3)
    model, optimizer, scheduler = _training(tiny_model_dir)
    _step(model, optimizer, scheduler)  # weights differ from the initial ones
    save_checkpoint(tmp_path / "run", 1, model=model, optimizer=optimizer, scheduler=scheduler,
                    extra_state={})  # fmt: skip
    # No tokenizer_dir: found through the source model dir recorded in the checkpoint.
    from_ckpt = export_hf(tmp_path / "run", tmp_path / "from_ckpt")
    live = export_hf(model, tmp_path / "live", tiny_model_dir)
    ids = torch.randint(0, 250, (2, 16))
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        for out in (from_ckpt, live):
            assert (out / "config.json").exists()
            loaded = AutoModelForCausalLM.from_pretrained(str(out))
            got = loaded(input_ids=ids).logits
            diff = float((got - want).abs().max())
            print(f"export {out.name}: max |logit diff| = {diff:.3e}")
            assert diff <= 1e-6
            tok = AutoTokenizer.from_pretrained(str(out))
            assert tok.eos_token == "<|im_end|>"
    with pytest.raises(ValueError, match="not empty"):
        export_hf(tmp_path / "run", tmp_path / "live", tiny_model_dir)
