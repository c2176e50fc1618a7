"""``tether config explain``: one cycle in plain English, and ``resolved_toml`` for ``--dry-run``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from common.config import toml
from common.config.schema import SECTIONS, TetherConfig


def resolved_toml(cfg: TetherConfig) -> str:
    derived = cfg.derived
    comments = {d: "derived" for d in derived}
    return toml.dumps(
        cfg.to_dict(),
        header="Tether config, fully resolved (tether config show)",
        comments=comments,
    )


def _tag(cfg: TetherConfig, dotted: str, sources: Mapping[str, str]) -> str:
    if dotted in cfg.derived:
        return f"{dotted}, derived"
    src = sources.get(dotted)
    return f"{dotted}, from {src}" if src else f"{dotted}, default"


def oddities(cfg: TetherConfig) -> list[str]:
    """Settings that are valid but probably not what the user wants."""
    run, ln = cfg.run, cfg.learner
    out: list[str] = []
    if run.responses_per_prompt == 1 and ln.advantage_estimator in (
        "grpo",
        "drgrpo",
        "rloo",
        "reinforce_pp_baseline",
    ):
        out.append(
            f"responses_per_prompt = 1 with advantage_estimator = {ln.advantage_estimator}: a group of one "
            "has no baseline, every advantage is 0 and nothing is learned. Use ≥ 2 responses per prompt or reinforce_pp."
        )
    if run.train_batch_size % run.responses_per_prompt:
        out.append(
            f"train_batch_size = {run.train_batch_size} is not a multiple of responses_per_prompt = "
            f"{run.responses_per_prompt}: groups are split across optimizer steps (advantages are still "
            "computed over whole groups first)."
        )
    if run.passes_per_cycle > 1 and ln.off_policy == "none":
        out.append(
            "passes_per_cycle > 1 with off_policy = none: later passes are off-policy w.r.t. the behaviour "
            "log-probs; decoupled PPO (the default) anchors the clip correctly."
        )
    if run.max_staleness > 4 * run.train_steps_per_cycle:
        out.append(
            f"max_staleness = {run.max_staleness} allows trajectories more than 4 cycles old; AReaL saw naive "
            "PPO collapse at staleness 4 — keep off_policy = decoupled or lower the bound."
        )
    if ln.kl_coef > 0:
        out.append(
            "kl_coef > 0 loads a frozen reference model beside the policy on every learner rank (memory)."
        )
    return out


def explain(
    cfg: TetherConfig, *, sources: Mapping[str, str] | None = None, warnings: Iterable[str] = ()
) -> str:
    sources = sources or {}
    run, ln = cfg.run, cfg.learner
    p, r, e = run.prompts_per_cycle, run.responses_per_prompt, run.passes_per_cycle
    b, s, st = run.train_batch_size, run.train_steps_per_cycle, run.max_staleness
    world = cfg.dp_world_size
    per_rank = b // world
    t = lambda d: _tag(cfg, d, sources)  # noqa: E731
    lines = [f"One cycle of run '{run.name}' ({run.num_cycles} cycles in all):", ""]
    lines.append(
        f"1. Prompts: the learner dispatches {p} prompts [{t('run.prompts_per_cycle')}] to the generators."
    )
    lines.append(
        f"2. Responses: {cfg.generator.replicas} generator(s) sample {r} responses per prompt "
        f"[{t('run.responses_per_prompt')}] = {p * r} responses of up to {run.max_response_tokens} tokens, "
        "each with its per-token behaviour log-probs and policy version."
    )
    lines.append(
        f"3. Rewards: {cfg.scorer.replicas} scorer(s) grade them (mode {cfg.scorer.mode}); advantages "
        f"({ln.advantage_estimator}) are computed within each group of {r}."
    )
    lines.append(
        f"4. Training: {p * r} responses × {e} pass(es) [{t('run.passes_per_cycle')}] = {p * r * e} responses "
        f"consumed as {s} optimizer step(s) [{t('run.train_steps_per_cycle')}] of {b} responses "
        f"[{t('run.train_batch_size')}]."
    )
    if ln.max_tokens_per_micro_batch is not None:
        micro = (
            f"micro-batches cut by a budget of {ln.max_tokens_per_micro_batch} tokens "
            "[learner.max_tokens_per_micro_batch]; gradient accumulation follows from the lengths"
        )
    else:
        micro = (
            f"micro-batches of {ln.micro_batch_size} [{t('learner.micro_batch_size')}] → gradient accumulation "
            f"over {cfg.grad_accumulation_steps} micro-batches per step (derived)"
        )
    lines.append(
        f"5. Per rank: {world} learner rank(s) → {per_rank} responses per rank per step; {micro}."
    )
    pub = cfg.learner.publish_every_steps
    lines.append(
        f"6. Weights: published to the generators every {pub} optimizer step(s); the policy version counts "
        f"optimizer steps, so it advances by {s} per cycle."
    )
    lines.append(
        f"7. Staleness: max_staleness = {st} [{t('run.max_staleness')}]. A trajectory from version v may be "
        f"used in the step that turns version t into t+1 only while t − v ≤ {st}. A cycle's {s} steps alone "
        f"need {s - 1}; {'so generation never overlaps training (synchronous).' if st == s - 1 else f'the other {st - (s - 1)} step(s) let generators work on the next cycle while the learner trains (asynchronous, up to {(st - (s - 1)) / s:.2g} cycle(s) of overlap).'}"
    )
    lines += [
        "",
        f"Whole run: {run.num_cycles * p} prompts, {run.num_cycles * p * r} responses generated, "
        f"{run.num_cycles * s} optimizer steps.",
    ]
    notes = list(warnings) + oddities(cfg)
    if notes:
        lines += ["", "Warnings:"] + [f"  - {n}" for n in notes]
    return "\n".join(lines)


__all__ = ["explain", "oddities", "resolved_toml", "SECTIONS"]
