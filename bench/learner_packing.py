"""The packing row of `tether bench learner`: training steps with ``learner.pack_sequences`` on
and off, side by side in one process, on one batch whose sequence lengths spread uniformly over
10–100 % of the maximum (prompt and response scaled together), as real RL responses do.

Both paths run the same functions as the learner (``objective.rank_micro_batches``,
``make_loss_fn``, ``train_step``) on the same model weights and samples, A-B-B-A, each after an
untimed warm-up step. Reported: train tokens/s (real prompt + response tokens, no padding) of
each and the ratio packed ÷ padded (target ≥ 1.5), and the token slots each pushed through the
model.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from services.learner import objective, optim
from services.learner.cycle import Sample, assign_advantages
from services.learner.main import training_settings
from services.learner.model import load_policy, setup_distributed
from services.learner.train_step import train_step


def _samples(cfg: Any, *, n: int, max_tokens: int, prompt_share: float, seed: int) -> list[Any]:
    rng = np.random.default_rng(seed)
    out = []
    per = cfg.run.responses_per_prompt
    for k in range(n):
        total = int(rng.integers(max(2, round(0.1 * max_tokens)), max_tokens + 1))
        n_p = max(1, min(total - 1, round(total * prompt_share)))
        out.append(
            Sample(
                sample_id=f"{k // per}/{k % per}", group=k // per,
                prompt_ids=rng.integers(3, 250, n_p).tolist(),
                response_ids=rng.integers(3, 250, total - n_p).tolist(),
                behaviour_logp=(-rng.random(total - n_p)).tolist(),
                reward=float(rng.integers(0, 2)), policy_version=0,
            )
        )  # fmt: skip
    assign_advantages(out, cfg.learner)
    return out


def _steps(cfg: Any, model_dir: str, samples: list[Any], steps: int) -> tuple[float, int]:
    """Seconds of ``steps`` timed optimizer steps (after one warm-up) and the token slots of one."""
    import torch

    _, _, device = setup_distributed()
    ln = cfg.learner
    model = load_policy(model_dir, device=device, pack_sequences=ln.pack_sequences)
    opt = optim.build_optimizer(model, lr=ln.lr)
    sched = optim.build_scheduler(opt, optim.build_schedule(total_steps=steps + 1))
    idx = list(range(len(samples)))
    slots = 0
    t0 = time.perf_counter()
    for step in range(steps + 1):
        if step == 1:
            t0 = time.perf_counter()
        mbs = objective.rank_micro_batches(cfg.learner, samples, idx, pad_id=0, device=device)
        key = "packed_input_ids" if ln.pack_sequences else "input_ids"
        slots = sum(int(mb[key].numel()) for mb in mbs)
        loss_fn = objective.make_loss_fn(
            training_settings(cfg),
            denominator=objective.step_denominator(cfg.learner, samples, idx),
            stats_out=[],
        )
        train_step(model, opt, sched, mbs, loss_fn, grad_clip=ln.grad_clip or None)
    seconds = time.perf_counter() - t0
    del model, opt, torch
    return seconds, slots


def run_packing(
    cfg: Any, model_dir: str, *, max_tokens: int, prompt_share: float, steps: int = 3,
    repeats: int = 2, seed: int = 0, token_budget: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Packed vs padded train tokens/s on one batch of ``cfg.run.train_batch_size`` samples.

    ``token_budget``: cut micro-batches by tokens (``learner.max_tokens_per_micro_batch``, the
    peers' dynamic batch size, which is how packing is usually run) instead of by the config's
    count."""
    n = cfg.run.prompts_per_cycle * cfg.run.responses_per_prompt
    configs = {}
    for pack in (True, False):
        c = cfg.model_copy(deep=True)
        c.learner.pack_sequences = pack
        if token_budget is not None:
            c.learner.micro_batch_size = None
            c.learner.max_tokens_per_micro_batch = token_budget
        configs[pack] = c
    samples = _samples(
        configs[True], n=n, max_tokens=max_tokens, prompt_share=prompt_share, seed=seed
    )
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    slots: dict[bool, int] = {}
    for i, order in enumerate([(True, False), (False, True)][: max(1, min(repeats, 2))]):
        for pack in order:
            s, slots[pack] = _steps(configs[pack], model_dir, samples, steps)
            seconds[pack].append(s)
        del i
    per_s = {p: steps * len(seconds[p]) * tokens / sum(seconds[p]) for p in (True, False)}
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    return {
        "samples": n,
        "max_tokens": max_tokens,
        "lengths": {"min": min(lengths), "mean": tokens / n, "max": max(lengths)},
        "distribution": "sequence length uniform over 10-100 % of max_tokens; prompt "
        f"{prompt_share:.0%} of each",
        "micro_batching": {
            "micro_batch_size": configs[True].learner.micro_batch_size,
            "max_tokens_per_micro_batch": configs[True].learner.max_tokens_per_micro_batch,
        },
        "timed_steps_each": steps,
        "real_tokens_per_step": tokens,
        "packed_token_slots_per_step": slots[True],
        "padded_token_slots_per_step": slots[False],
        "packed_seconds_each": seconds[True],
        "padded_seconds_each": seconds[False],
        "packed_train_tokens_per_s": per_s[True],
        "padded_train_tokens_per_s": per_s[False],
        "ratio_packed_over_padded": per_s[True] / per_s[False],
        "load_average": os.getloadavg(),
    }


def _cut(r: dict[str, Any]) -> str:
    mb = r.get("micro_batching") or {}
    if mb.get("max_tokens_per_micro_batch"):
        return f"micro-batches of ≤ {mb['max_tokens_per_micro_batch']} tokens"
    return f"micro-batches of {mb.get('micro_batch_size')} samples"


def format_packing(r: dict[str, Any]) -> str:
    return (
        f"learner packing ({_cut(r)}): packed {r['packed_train_tokens_per_s']:.0f} train tokens/s, padded "
        f"{r['padded_train_tokens_per_s']:.0f}, ratio {r['ratio_packed_over_padded']:.2f} "
        f"(target ≥ 1.5; slots/step {r['packed_token_slots_per_step']} vs "
        f"{r['padded_token_slots_per_step']} for {r['real_tokens_per_step']} tokens; "
        f"load {r['load_average'][0]:.1f})"
    )


def row_packing(r: dict[str, Any]) -> list[str]:
    """The bench README row of a learner result's packing section (none without one)."""
    if r.get("benchmark") != "learner":
        return []
    settings = r["settings"]
    return [
        f"| learner packing | {settings['params'] / 1e6:.1f} M, {p['max_tokens']} tok max, "
        f"{_cut(p)} | "
        f"packed {p['packed_train_tokens_per_s']:.0f} train tokens/s, padded "
        f"{p['padded_train_tokens_per_s']:.0f} | **{p['ratio_packed_over_padded']:.2f}** "
        f"(packed/padded) | lengths uniform over 10–100 % of the max (mean {p['lengths']['mean']:.0f}); "
        f"token slots per step {p['packed_token_slots_per_step']} packed vs "
        f"{p['padded_token_slots_per_step']} padded for {p['real_tokens_per_step']} tokens | "
        f"{p['load_average'][0]:.1f} | `tether bench learner` |"
        for p in (r.get("packing"), r.get("packing_token_budget"))
        if p
    ]
