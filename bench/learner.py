"""`tether bench learner`: the learner service fed from the bus vs a bare training loop.

Both train the same model on the same scored groups with the same algorithm settings, in the same
process, one after the other:

- **service**: scored groups are pre-published to ``<run>:scored`` on a real Redis-protocol server;
  ``LearnerService`` collects each cycle from the stream, recomputes proximal log-probs, trains,
  publishes weights (to no generator) and dispatches prompts — everything but generation;
- **bare**: a plain loop over the same cycles calling the same functions (advantages, proximal
  log-probs, micro-batches, ``train_step``) with no bus, no dispatch, no weight publishing.

Reported: responses/s of each and the ratio service ÷ bare (target ≥ 0.9), plus the weight
publish of the same state dict to one receiver vs a bare gloo broadcast (``bench/weights.py``).
Then ``packing``: packed vs padded train tokens/s on lengths spread over 10–100 % of the maximum
(``bench/learner_packing.py``; target ≥ 1.5).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.learner_packing import format_packing, run_packing
from bench.provenance import device_name
from bench.workload import count_params
from common.bus.client import Bus
from common.bus.server import EmbeddedRedis
from common.config.load import load_config
from common.protocol import wire
from common.protocol.streams import SCORED
from common.service import process_exit
from common.service.settings import bus_settings_for, policy_prompt_sets
from services.learner import logprobs, objective, optim
from services.learner.bus_side import BusSide
from services.learner.cycle import assign_advantages, samples_from_groups, steps_of_cycle
from services.learner.loop import LearnerService
from services.learner.main import learner_settings, training_settings
from services.learner.model import load_policy, setup_distributed
from services.learner.train_step import train_step
from tether.demo.tiny_model import build_tiny_model

log = logging.getLogger(__name__)


def _groups(
    cfg, *, cycles: int, prompt_tokens: int, response_tokens: int, vocab: int, seed: int
) -> list[Any]:
    rng = np.random.default_rng(seed)
    out = []
    r = cfg.run.responses_per_prompt
    for c in range(cycles):
        for p in range(cfg.run.prompts_per_cycle):
            samples = [
                wire.Trajectory.single_turn(
                    sample_id=f"c{c}/p{p}/{i}", sample_index=i,
                    token_ids=rng.integers(3, vocab, response_tokens).astype(np.uint32),
                    logprobs=-rng.random(response_tokens).astype(np.float32),
                    version_spans=[(0, 0)], finish_reason="length",
                )
                for i in range(r)
            ]  # fmt: skip
            g = wire.TrajectoryGroup(
                # index = the sampler position c·P + p the learner collects the cycle by
                group_id=f"c{c}/p{p}", prompt_id=f"c{c}/p{p}", cycle=c, index=c * cfg.run.prompts_per_cycle + p, split="train",
                prompt_token_ids=rng.integers(3, vocab, prompt_tokens).astype(np.uint32), prompt_text="",
                ground_truth="1", metadata={}, generator_id="bench", samples=samples,
            )  # fmt: skip
            rewards = [float(x) for x in rng.integers(0, 2, r)]
            out.append(
                wire.ScoredGroup(
                    group=g,
                    rewards=rewards,
                    components=[{"correct": x} for x in rewards],
                    reasons=[""] * r,
                    scorer_id="bench",
                    score_seconds=0.0,
                )
            )
    return out


def _bare(cfg, groups: list[Any], model_dir: str, cycles: int) -> float:
    """Train every cycle with the same functions and no service around them; returns seconds."""
    import torch

    _, _, device = setup_distributed()
    ln, ts = cfg.learner, training_settings(cfg)
    model = load_policy(  # as LearnerService.setup loads it
        model_dir,
        device=device,
        param_dtype=None if ln.dtype == "auto" else getattr(torch, ln.dtype),
        gradient_checkpointing=ln.gradient_checkpointing,
    )
    opt = optim.build_optimizer(model, lr=cfg.learner.lr)
    sched = optim.build_scheduler(
        opt, optim.build_schedule(total_steps=cycles * cfg.run.train_steps_per_cycle)
    )
    per_cycle = cfg.run.prompts_per_cycle
    t0 = time.perf_counter()
    for c in range(cycles):
        if c == 1:
            t0 = time.perf_counter()  # cycle 0 warms the allocator and kernels: not timed
        samples = samples_from_groups(groups[c * per_cycle : (c + 1) * per_cycle])
        assign_advantages(samples, cfg.learner)
        if cfg.learner.off_policy != "none" and not logprobs.proximal_is_current(ts):
            # as LearnerService._prepare
            for s, lp in zip(
                samples,
                logprobs.recompute_logprobs(model, ts, samples, pad_id=0, device=device),
                strict=True,
            ):
                s.old_logp = lp
        for idx in steps_of_cycle(
            len(samples),
            steps=cfg.run.train_steps_per_cycle,
            passes=cfg.run.passes_per_cycle,
            seed=cfg.run.seed,
            cycle=c,
        ):
            mbs = objective.rank_micro_batches(ln, samples, idx, pad_id=0, device=device)
            loss_fn = objective.make_loss_fn(
                ts, denominator=objective.step_denominator(ln, samples, idx), stats_out=[]
            )
            train_step(model, opt, sched, mbs, loss_fn, grad_clip=cfg.learner.grad_clip or None)
    del torch
    return time.perf_counter() - t0


def _service(
    cfg, groups: list[Any], run_dir: Path, phases_out: dict[str, float] | None = None
) -> float:
    """Pre-publish the groups, run LearnerService; seconds from the first collect to the end of
    training (start-up, the initial publish and the final checkpoint excluded)."""
    bus = Bus(bus_settings_for(cfg), service="bench")
    for g in groups:
        bus.publish(SCORED, g)
    svc = LearnerService(learner_settings(cfg), run_dir=run_dir, datasets=policy_prompt_sets(cfg))
    svc.setup_io_first()
    svc.setup()
    svc.publish()
    marks: list[float] = []
    original = svc.train_cycle

    phases: list[dict[str, float]] = []

    def timed(cycle, samples):
        original(cycle, samples)
        marks.append(time.perf_counter())
        phases.append(svc.timer.snapshot())

    svc.train_cycle = timed  # type: ignore[method-assign]
    while svc.next_cycle < cfg.run.num_cycles:
        cycle = svc.next_cycle

        assert isinstance(svc.bus_side, BusSide)
        collected = svc.bus_side.collect(cycle, stop=lambda: False)
        assert collected is not None
        svc.train_cycle(cycle, samples_from_groups(collected))
        svc.next_cycle += 1
    elapsed = marks[-1] - marks[0]  # cycle 0 warms the allocator and kernels: not timed
    svc.publishing.close()
    svc.bus_side.close()
    if phases_out is not None:  # where the timed cycles' time went (working, syncing_weights, ...)
        for k, v in phases[-1].items():
            phases_out[k] = phases_out.get(k, 0.0) + v - phases[0].get(k, 0.0)
    return elapsed


def _release_memory() -> None:
    """Free the finished path's model before the next loads (one GPU holds one at a time)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_learner_bench(
    *,
    cycles: int = 4,
    prompts: int = 30,
    per_prompt: int = 4,
    prompt_tokens: int = 64,
    response_tokens: int = 128,
    hidden: int = 256,
    layers: int = 4,
    heads: int | None = None,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    vocab: int | None = None,
    overrides: Sequence[str] = (),
    repeats: int = 2,
    packing: bool = True,
    service_vs_bare: bool = True,
    out_path: str | Path | None = None,
    work_dir: str | Path | None = None,
) -> dict:
    """Service vs bare loop on the same cycles; ``repeats`` = 2 runs them A-B-B-A (1: A-B).
    ``packing``: then packed vs padded training steps on lengths that spread
    (``bench/learner_packing.py``), under ``"packing"`` in the result (micro-batches cut by
    count) and ``"packing_token_budget"`` (cut by a token budget of eight longest sequences);
    ``service_vs_bare=False`` runs only that part.

    The model is a randomly initialised Qwen2 of the given shape (``vocab`` pads the embedding to a
    real tokenizer's size); ``overrides`` are extra ``key=value`` config settings for both paths,
    e.g. ``learner.micro_batch_size=1`` or ``learner.gradient_checkpointing=true`` for a large
    model on one GPU. On a CUDA machine both paths run the GPU path (NCCL group, FSDP2, bf16).
    Its model, data and Redis live in a scratch folder under ``work_dir`` (default: the system's
    temporary folder), removed at the end, also when the bench is interrupted.
    """
    if cycles < 2:
        raise ValueError("cycles must be >= 2: the first cycle of each path is a warm-up")
    if work_dir is not None:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="tether-bench-learner-", dir=work_dir))
    try:
        return _measure(
            tmp,
            cycles=cycles,
            prompts=prompts,
            per_prompt=per_prompt,
            prompt_tokens=prompt_tokens,
            response_tokens=response_tokens,
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            intermediate=intermediate,
            vocab=vocab,
            overrides=overrides,
            repeats=repeats,
            packing=packing,
            service_vs_bare=service_vs_bare,
            out_path=out_path,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _measure(
    tmp: Path, *, cycles: int, prompts: int, per_prompt: int, prompt_tokens: int,
    response_tokens: int, hidden: int, layers: int, heads: int | None, kv_heads: int | None,
    intermediate: int | None, vocab: int | None, overrides: Sequence[str], repeats: int,
    packing: bool, service_vs_bare: bool, out_path: str | Path | None,
) -> dict:  # fmt: skip

    model_dir = str(
        build_tiny_model(
            tmp / "model",
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads or max(4, hidden // 64),
            num_kv_heads=kv_heads,
            intermediate_size=intermediate,
            vocab_size=vocab,
            max_position_embeddings=prompt_tokens + response_tokens + 8,
        )
    )
    data = tmp / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+0?", "answer": "1"}) + "\n")
    with EmbeddedRedis(tmp / "redis") as server:
        cfg = load_config(
            flags={
                "run.prompts_per_cycle": prompts,
                "run.responses_per_prompt": per_prompt,
                "run.num_cycles": cycles,
                "run.name": "bench-learner",
            },
            overrides=[
                f'run.model="{model_dir}"',
                f'data.train_path="{data}"',
                f'run.redis_url="{server.url}"',
                f"run.max_prompt_tokens={prompt_tokens}",
                f"run.max_response_tokens={response_tokens}",
                "learner.lr=1e-5",
                *overrides,
            ],
            env={},
        ).config
        groups = _groups(
            cfg,
            cycles=cycles,
            prompt_tokens=prompt_tokens,
            response_tokens=response_tokens,
            vocab=256,
            seed=0,
        )
        # A-B-B-A order, so neither path always runs first (on a cold allocator) or last
        services: list[float] = []
        bares: list[float] = []
        service_phases: dict[str, float] = {}

        def service(i: int) -> None:
            run_cfg = cfg.model_copy(deep=True)
            run_cfg.run.name = f"bench-learner-{i}"  # fresh streams per repeat
            services.append(_service(run_cfg, groups, tmp / f"run{i}", service_phases))
            _release_memory()

        def bare(i: int) -> None:
            bares.append(_bare(cfg, groups, model_dir, cycles))
            _release_memory()

        for i, order in enumerate([(service, bare), (bare, service)][: max(1, min(repeats, 2))]):
            for path in order if service_vs_bare else ():
                path(i)
    packed = budgeted = None
    if packing:
        # twice: micro-batches cut by the config's count, then by a token budget of eight
        # longest sequences (the peers' dynamic batch size, how packing is usually run)
        longest = prompt_tokens + response_tokens
        share = prompt_tokens / longest
        packed = run_packing(
            cfg, model_dir, max_tokens=longest, prompt_share=share, repeats=repeats
        )
        if cfg.learner.max_tokens_per_micro_batch is None:
            budgeted = run_packing(
                cfg, model_dir, max_tokens=longest, prompt_share=share, repeats=repeats,
                token_budget=8 * longest,
            )  # fmt: skip
    responses = (cycles - 1) * prompts * per_prompt * len(services)  # timed cycles only
    tokens = responses * (prompt_tokens + response_tokens)
    result: dict[str, Any] = {
        "benchmark": "learner",
        "settings": {
            "cycles": cycles,
            "prompts": prompts,
            "per_prompt": per_prompt,
            "prompt_tokens": prompt_tokens,
            "response_tokens": response_tokens,
            "hidden": hidden,
            "layers": layers,
            "heads": heads or max(4, hidden // 64),
            "kv_heads": kv_heads,
            "intermediate": intermediate or 4 * hidden,
            "vocab": vocab,
            "params": count_params(Path(model_dir)),
            "overrides": list(overrides),
            "device": device_name(),
            "repeats": max(1, min(repeats, 2)),
            "timed": "cycles 1.. of each path (cycle 0 is a warm-up)",
        },
        "load_average": os.getloadavg(),
        **({"packing": packed} if packed else {}),
        **({"packing_token_budget": budgeted} if budgeted else {}),
    }
    if service_vs_bare:
        result.update(_service_fields(services, bares, service_phases, responses, tokens))
        print(
            f"learner: service {result['service_responses_per_s']:.2f} responses/s, bare loop "
            f"{result['bare_responses_per_s']:.2f} responses/s, ratio "
            f"{result['ratio_service_over_bare']:.2f} (target ≥ 0.9; load "
            f"{result['load_average'][0]:.1f})"
        )
    for p in (packed, budgeted):
        if p:
            print(format_packing(p))
    if out_path:
        Path(out_path).write_text(json.dumps(result, indent=2))
    return result


def _service_fields(
    services: list[float], bares: list[float], service_phases: dict[str, float],
    responses: int, tokens: int,
) -> dict[str, Any]:  # fmt: skip
    service_s, bare_s = sum(services), sum(bares)
    return {
        "service_seconds": service_s,
        "bare_seconds": bare_s,
        "service_seconds_each": services,
        "service_phase_seconds": service_phases,
        "bare_seconds_each": bares,
        "service_responses_per_s": responses / service_s,
        "bare_responses_per_s": responses / bare_s,
        # prompt + response tokens through the step: `tether plan`'s train_tokens_per_s
        "service_train_tokens_per_s": tokens / service_s,
        "bare_train_tokens_per_s": tokens / bare_s,
        "ratio_service_over_bare": bare_s / service_s,
    }


if __name__ == "__main__":
    process_exit.skip_finalization("gloo process groups")  # see process_exit's docstring
    logging.basicConfig(level=logging.WARNING)
    run_learner_bench()
    process_exit.end(0)
