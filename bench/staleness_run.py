"""One run of the staleness study (``bench.staleness_design``): one arm, one seed, in process.

What runs is the learner's own code — the config schema and its rules, ``load_policy``,
``optim.for_run``, ``assign_advantages``, ``recompute_logprobs``, ``steps_of_cycle``,
``objective.rank_micro_batches`` / ``make_loss_fn`` (the policy loss, the off-policy weight,
its cap) and ``train_step`` — in the order ``LearnerService.train_cycle`` runs them. What is
simulated is the pipeline around it: responses are sampled in this process from a copy of the
policy as it was η cycles ago (``bench.staleness_sampler``), rewarded by the demo task's exact
check (math-verify's verdict on these integer answers), with no Redis, vLLM or weight
broadcast. The lag is therefore exact and the same in every run, which the real pipeline cannot
promise (its staleness depends on timing); that plumbing is tested elsewhere (tests/e2e).

Deterministic: one thread, ``torch.use_deterministic_algorithms``, seeded data order (the
dispatcher's), sampling streams per response (``services.generator.seeds``) and micro-batch
order: a run gives the same numbers on an idle or a loaded machine.

Per optimizer step it records the reward, KL(behaviour ‖ learner) (the learner's own k3
estimate over the step's tokens, ``mismatch_kl_k3_mean``), the KL between the policies before and
after the step (exact over the vocabulary, on a fixed probe batch), and the behaviour importance
weights π_prox / π_behav of the sampled tokens (mean, max, fraction above 2 and 5, effective
sample size; over ``DIAGNOSED`` of the step's responses where the learner itself recomputes
no proximal log-probs); greedy held-out accuracy every ``eval_every`` steps (after any step: the
simulation evaluates the policy itself, not the weights a generator holds).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch  # noqa: TID253 - a training arm's worker: it lives on torch

from bench.staleness_design import Arm, Study
from bench.staleness_sampler import generate
from common.config.load import load_config
from common.service.settings import prompt_sets_for
from services.generator.seeds import request_seed
from services.learner import logprobs, objective, optim
from services.learner.batching import collate
from services.learner.cycle import Sample, assign_advantages, steps_of_cycle
from services.learner.losses import merge_stats
from services.learner.main import training_settings
from services.learner.model import load_policy
from services.learner.train_step import train_step
from tether.demo.run import DEMO_CONFIG
from tether.demo.tasks import is_correct, read_jsonl

REPLICATE_STRIDE = 1_000_003  # sampling-stream seed of a replicate: seed + replicate × this
# Where the learner recomputes no proximal log-probs (uncorrected PPO; one step per cycle), the
# behaviour-weight statistics cover this many of each step's responses (a quarter of 64): the
# recompute pass they need would otherwise be a fifth of the run's time.
DIAGNOSED = 16


def arm_config(arm: Arm, study: Study, *, seed: int, model_dir: Path, train_path: Path) -> Any:
    """The demo's config with this arm's cycle shape, lag bound, correction and seed."""
    s = arm.steps_per_cycle
    sets = {
        "run.model": json.dumps(str(model_dir)),
        "data.train_path": json.dumps(str(train_path)),
        "data.eval_path": '""',
        "run.prompts_per_cycle": str(study.prompts_per_step * s),
        "run.responses_per_prompt": str(study.responses_per_prompt),
        "run.train_steps_per_cycle": str(s),
        "run.num_cycles": str(study.steps // s),
        "run.max_staleness": str((arm.eta + 1) * s - 1),
        "run.seed": str(seed),
        "learner.lr": repr(study.lr),
        "learner.off_policy": json.dumps(arm.off_policy),
        "learner.micro_batch_size": str(study.prompts_per_step * study.responses_per_prompt),
        # padded micro-batches: the same loss and gradients as packed ones (tested to 1e-5),
        # and ~6 % faster at these lengths (45 tokens, one micro-batch per step)
        "learner.pack_sequences": "false",
        "learner.trackers": "[]",
    }
    return load_config(
        config_file=DEMO_CONFIG, overrides=[f"{k}={v}" for k, v in sets.items()], env={}
    ).config


class _Policies:
    """The trained policy, and a second model holding the behaviour policy of the cycle (the
    policy's weights at the start of cycle c − η)."""

    def __init__(self, cfg: Any, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        ln = cfg.learner
        self.policy = load_policy(
            model_dir, device=torch.device("cpu"), fsdp=False, pack_sequences=ln.pack_sequences
        )
        self.optimizer, self.scheduler = optim.for_run(cfg.learner, cfg.run, self.policy)
        self.behaviour = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.behaviour.eval()
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.probe: dict[str, torch.Tensor] | None = None
        self.probe_dists: torch.Tensor | None = None

    def set_probe(self, cfg: Any, samples: list, *, pad_id: int) -> None:
        fields = [{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids} for s in samples]
        self.probe = collate(fields, list(range(len(fields))), pad_id=pad_id)
        self.probe_dists = _log_dists(self.policy, cfg, self.probe)

    def start_cycle(self, cycle: int, *, eta: int) -> int:
        """Keep the policy's weights at the start of ``cycle``; load the behaviour policy of the
        cycle (``eta`` cycles back, or the policy itself in the synchronous prefix); forget the
        weights no later cycle needs. Returns the behaviour's cycle."""
        behaviour_cycle = cycle - eta if cycle >= eta else cycle
        self.snapshots[cycle] = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
        self.behaviour.load_state_dict(self.snapshots[behaviour_cycle])
        for old in [c for c in self.snapshots if c <= cycle - eta]:  # later cycles need > c − η
            del self.snapshots[old]
        return behaviour_cycle


def _log_dists(model: Any, cfg: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log softmax(logits / T) [tokens, vocab] at the response tokens of a collated batch."""
    b = batch
    was = model.training
    model.eval()
    with torch.no_grad():
        logits = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"],
            position_ids=b["position_ids"], use_cache=False,
        ).logits[:, :-1]  # fmt: skip
    model.train(was)
    pred = b["loss_mask"][:, 1:].bool()
    return torch.log_softmax(logits[pred].float() / cfg.behaviour_temperature, dim=-1)


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    """Mean over rows of KL(p ‖ q), exact over the vocabulary."""
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


def _weight_stats(samples: list, idx: list[int], prox: dict[int, list[float]]) -> dict[str, float]:
    """π_prox / π_behav of the sampled tokens of the step's responses in ``prox`` (no cap)."""
    w = (
        torch.tensor(
            [
                p - b
                for i in idx
                if i in prox
                for p, b in zip(prox[i], samples[i].behaviour_logp, strict=True)
            ],
            dtype=torch.float64,
        )
        .clamp(max=20.0)
        .exp()
    )
    return {
        "is_weight_mean": float(w.mean()),
        "is_weight_max": float(w.max()),
        "is_over_2_frac": float((w > 2.0).double().mean()),
        "is_over_5_frac": float((w > 5.0).double().mean()),
        "ess_frac": float(w.sum() ** 2 / (w.numel() * (w * w).sum())),
    }


def _cycle_samples(cfg, records, responses, *, tokenizer, cycle: int, version: int) -> list:
    n = cfg.run.responses_per_prompt
    out = []
    for j, resp in enumerate(responses):
        prompt_ids, answer = records[j // n]
        text = tokenizer.decode(resp.token_ids, skip_special_tokens=True)
        out.append(
            Sample(
                sample_id=f"{cycle}/{j}", group=j // n, prompt_ids=prompt_ids,
                response_ids=resp.token_ids, behaviour_logp=resp.logprobs,
                reward=1.0 if is_correct(text, answer) else 0.0, policy_version=version,
                truncated=resp.truncated,
            )
        )  # fmt: skip
    return out


def _accuracy(model: Any, held_out: list[tuple[list[int], str]], *, tokenizer, cfg) -> float:
    was = model.training
    model.eval()
    right = 0
    for start in range(0, len(held_out), 400):
        chunk = held_out[start : start + 400]
        got = generate(
            model, [p for p, _ in chunk], seeds=None, temperature=0.0,
            max_tokens=cfg.run.max_response_tokens, eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
        )  # fmt: skip
        right += sum(
            is_correct(tokenizer.decode(r.token_ids, skip_special_tokens=True), a)
            for r, (_, a) in zip(got, chunk, strict=True)
        )
    model.train(was)
    return right / len(held_out)


def held_out_accuracy(assets: dict[str, Any], study: Study) -> float:
    """Greedy held-out accuracy of the model in ``assets`` (the warm-up model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model_dir = str(assets["model_dir"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    arm = next(iter(study.arms))
    cfg = arm_config(
        arm, study, seed=0, model_dir=Path(model_dir), train_path=Path(assets["train_path"])
    )
    rows = read_jsonl(assets["held_out_path"])[: study.held_out]
    held_out = [(list(r["prompt_token_ids"]), r["answer"]) for r in rows]
    return _accuracy(model, held_out, tokenizer=tokenizer, cfg=cfg)


def run_arm(arm: Arm, study: Study, *, seed: int, assets: dict[str, Any]) -> dict[str, Any]:
    """Train ``study.steps`` optimizer steps of ``arm`` from the warmed-up demo model; returns
    the held-out curve and the per-step records. ``assets``: model_dir, train_path,
    held_out_path, and optionally initial_accuracy (the model's, measured once)."""
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    started, cpu = time.monotonic(), time.process_time()
    model_dir, train_path = Path(assets["model_dir"]), Path(assets["train_path"])
    cfg = arm_config(arm, study, seed=seed, model_dir=model_dir, train_path=train_path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    train, _ = prompt_sets_for(cfg, tokenizer)
    held_out = [
        (list(r["prompt_token_ids"]), r["answer"]) for r in read_jsonl(assets["held_out_path"])
    ][: study.held_out]
    models = _Policies(cfg, model_dir)
    stream = seed + arm.replicate * REPLICATE_STRIDE
    s, p = arm.steps_per_cycle, cfg.run.prompts_per_cycle
    # step 0 is the warm-up model in every run: the driver measures it once
    first = assets.get("initial_accuracy")
    evals = [[0, _accuracy(models.policy, held_out, tokenizer=tokenizer, cfg=cfg)
              if first is None else float(first)]]  # fmt: skip

    def evaluate(step: int) -> None:
        """After optimizer step ``step`` (1-based over the run)."""
        if step % study.eval_every == 0:
            evals.append([step, _accuracy(models.policy, held_out, tokenizer=tokenizer, cfg=cfg)])

    steps: list[dict[str, Any]] = []
    for cycle in range(study.steps // s):
        behaviour_cycle = models.start_cycle(cycle, eta=arm.eta)
        positions = [cycle * p + k for k in range(p)]  # the dispatcher's sampler positions
        orders = {e: train.order(seed, e) for e in {g // len(train) for g in positions}}
        records = [train[orders[g // len(train)][g % len(train)]] for g in positions]
        rows = [(r.prompt_token_ids, r.ground_truth) for r in records]
        n = cfg.run.responses_per_prompt
        seeds = [
            request_seed(run_seed=stream, split="train", cycle=cycle, index=g) + i
            for g in positions for i in range(n)
        ]  # fmt: skip
        responses = generate(
            models.behaviour, [r[0] for r in rows for _ in range(n)], seeds=seeds,
            temperature=cfg.generator.temperature, max_tokens=cfg.run.max_response_tokens,
            eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
        )  # fmt: skip
        samples = _cycle_samples(
            cfg, rows, responses, tokenizer=tokenizer, cycle=cycle, version=behaviour_cycle * s
        )
        if models.probe is None:  # a fixed batch to measure how far each step moves the policy
            models.set_probe(
                cfg, samples[: study.responses_per_prompt * 2], pad_id=tokenizer.pad_token_id
            )

        steps += _train_cycle(
            models, cfg, samples, cycle=cycle, pad_id=tokenizer.pad_token_id, on_step=evaluate
        )
    return {
        "arm": arm.name, "label": arm.label, "correction": arm.correction, "eta": arm.eta,
        "steps_per_cycle": s, "replicate": arm.replicate, "seed": seed,
        "evals": evals, "steps": steps, "seconds": time.monotonic() - started,
        "cpu_seconds": time.process_time() - cpu,  # what the run costs whatever else runs
    }  # fmt: skip


def _train_cycle(
    models: _Policies, cfg: Any, samples: list, *, cycle: int, pad_id: int,
    on_step: Callable[[int], None],
) -> list:  # fmt: skip
    """``LearnerService.train_cycle`` without the service: the proximal log-probs, the
    advantages, then each optimizer step; with the study's diagnostics around each step and
    ``on_step(n)`` after it, n the run's optimizer steps so far."""
    run, ln, ts = cfg.run, cfg.learner, training_settings(cfg)
    device = torch.device("cpu")
    policy = models.policy
    steps = steps_of_cycle(
        len(samples), steps=run.train_steps_per_cycle, passes=run.passes_per_cycle,
        seed=run.seed, cycle=cycle,
    )  # fmt: skip
    if ln.off_policy != "none" and not logprobs.proximal_is_current(ts):  # as _prepare
        lps = logprobs.recompute_logprobs(policy, ts, samples, pad_id=pad_id, device=device)
        for smp, lp in zip(samples, lps, strict=True):
            smp.old_logp = lp
        prox = dict(enumerate(lps))
    else:  # the learner needs none: for the diagnostics, DIAGNOSED responses of each step
        some = sorted({i for idx in steps for i in idx[:DIAGNOSED]})
        lps = logprobs.recompute_logprobs(
            policy, ts, [samples[i] for i in some], pad_id=pad_id, device=device
        )
        prox = dict(zip(some, lps, strict=True))
    assign_advantages(samples, cfg.learner)
    records = []
    for idx in steps:
        stats: list[dict[str, float]] = []
        mbs = objective.rank_micro_batches(ln, samples, idx, pad_id=pad_id, device=device)
        loss_fn = objective.make_loss_fn(
            training_settings(cfg),
            denominator=objective.step_denominator(cfg.learner, samples, idx),
            stats_out=stats,
        )
        st = train_step(policy, models.optimizer, models.scheduler, mbs, loss_fn,
                        grad_clip=ln.grad_clip or None)  # fmt: skip
        assert models.probe is not None and models.probe_dists is not None, "set before cycle 0"
        after = _log_dists(policy, cfg, models.probe)
        merged = merge_stats(stats)
        records.append(
            {
                "reward_mean": sum(samples[i].reward for i in idx) / len(idx),
                "kl_behaviour_learner": merged["mismatch_kl_k3_mean"],
                "kl_step": _kl(models.probe_dists, after),
                **_weight_stats(samples, idx, prox),
                "clip_frac": merged.get("clip_frac_low", 0.0) + merged.get("clip_frac_high", 0.0),
                "masked_or_capped_frac": merged.get("is_over_cap_frac", 0.0),
                "grad_norm": st.grad_norm,
            }
        )
        models.probe_dists = after
        on_step(cycle * run.train_steps_per_cycle + len(records))
    return records
