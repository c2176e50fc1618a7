"""The learner's update moves the policy the right way: after a few optimizer steps through the
real learner path (advantages → proximal log-probs → micro-batches → clipped loss →
train_step), rewarded responses are more likely and unrewarded ones less likely."""

from __future__ import annotations

import pytest

from common.config_load import load_config
from services.learner import algorithm, optim
from services.learner.cycle import Sample, steps_of_cycle
from services.learner.train_step import train_step


@pytest.mark.parametrize("off_policy", ["decoupled", "tis", "none"])
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp"])
def test_rewarded_responses_become_more_likely(tmp_path, off_policy, estimator):
    import torch

    from common.tiny_model import build_tiny_model
    from services.learner.model import load_policy

    torch.manual_seed(0)
    model_dir = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2)
    model = load_policy(model_dir, device=torch.device("cpu"), fsdp=False)
    cfg = load_config(
        flags={
            "run.prompts_per_cycle": 2,
            "run.responses_per_prompt": 4,
            "run.train_steps_per_cycle": 2,
        },
        overrides=[
            f'learner.off_policy="{off_policy}"',
            f'learner.advantage_estimator="{estimator}"',
            "learner.lr=3e-3",
            "generator.temperature=0.7",
        ],
        env={},
    ).config
    g = torch.Generator().manual_seed(1)
    samples = []
    for group in range(2):
        prompt = torch.randint(3, 250, (6,), generator=g).tolist()
        for i in range(4):
            response = torch.randint(3, 250, (5,), generator=g).tolist()
            samples.append(
                Sample(
                    sample_id=f"{group}/{i}",
                    group=group,
                    prompt_ids=prompt,
                    response_ids=response,
                    behaviour_logp=[0.0] * 5,
                    reward=float(i % 2),
                    policy_version=0,
                )
            )

    def seq_logp() -> list[float]:
        lps = algorithm.recompute_logprobs(
            model, cfg, samples, pad_id=0, device=torch.device("cpu")
        )
        return [sum(lp) for lp in lps]

    before = seq_logp()
    for s, lp in zip(
        samples,
        algorithm.recompute_logprobs(model, cfg, samples, pad_id=0, device=torch.device("cpu")),
        strict=True,
    ):
        s.behaviour_logp = lp  # as if the generator sampled them with these weights
    opt = optim.build_optimizer(model, lr=cfg.learner.lr)
    sched = optim.build_scheduler(opt, optim.build_schedule())
    for cycle in range(3):
        algorithm.assign_advantages(samples, cfg)
        for s, lp in zip(
            samples,
            algorithm.recompute_logprobs(model, cfg, samples, pad_id=0, device=torch.device("cpu")),
            strict=True,
        ):
            s.old_logp = lp
        for idx in steps_of_cycle(
            len(samples), batch=cfg.run.train_batch_size, passes=1, seed=0, cycle=cycle
        ):
            mbs = algorithm.rank_micro_batches(
                cfg, samples, idx, pad_id=0, device=torch.device("cpu")
            )
            loss_fn = algorithm.make_loss_fn(
                cfg,
                denominator=algorithm.step_denominator(cfg, samples, idx, torch.device("cpu")),
                stats_out=[],
            )
            train_step(model, opt, sched, mbs, loss_fn, grad_clip=1.0)
    after = seq_logp()
    delta = [a - b for a, b in zip(after, before, strict=True)]
    up = [d for d, s in zip(delta, samples, strict=True) if s.reward > 0]
    down = [d for d, s in zip(delta, samples, strict=True) if s.reward == 0]
    assert min(up) > 0 and max(down) < 0, (up, down)
