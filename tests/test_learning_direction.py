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


def test_one_step_cycles_take_the_proximal_log_probs_from_the_training_forward(tmp_path):
    """One optimizer step per cycle and one pass: the proximal policy is the policy being
    trained, so the recompute pass is skipped and the step's own detached log-probs anchor the
    ratio. Same loss and gradient as with the recomputed proximal log-probs."""
    import torch

    from common.tiny_model import build_tiny_model
    from services.learner.model import load_policy

    def config(*sets: str):
        return load_config(
            flags={"run.prompts_per_cycle": 2, "run.responses_per_prompt": 4},
            overrides=["generator.temperature=0.7", *sets],
            env={},
        ).config

    cfg = config("run.train_steps_per_cycle=1")
    assert algorithm.proximal_is_current(cfg)
    assert not algorithm.proximal_is_current(config("run.train_steps_per_cycle=2"))
    assert not algorithm.proximal_is_current(
        config("run.passes_per_cycle=2", "run.train_batch_size=8")
    )
    assert not algorithm.proximal_is_current(config('learner.off_policy="none"'))

    torch.manual_seed(0)
    model_dir = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2)
    model = load_policy(model_dir, device=torch.device("cpu"), fsdp=False)
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(2)
    samples = [
        Sample(sample_id=f"{k // 4}/{k % 4}", group=k // 4,
               prompt_ids=torch.randint(3, 250, (6,), generator=g).tolist(),
               response_ids=torch.randint(3, 250, (5 + k % 3,), generator=g).tolist(),
               behaviour_logp=(-torch.rand(5 + k % 3, generator=g)).tolist(),
               reward=float(k % 2), policy_version=0)
        for k in range(8)
    ]  # fmt: skip
    algorithm.assign_advantages(samples, cfg)
    for s, lp in zip(
        samples,
        algorithm.recompute_logprobs(model, cfg, samples, pad_id=0, device=cpu),
        strict=True,
    ):
        s.old_logp = lp
    idx = list(range(len(samples)))
    mbs = algorithm.rank_micro_batches(cfg, samples, idx, pad_id=0, device=cpu)
    denominator = algorithm.step_denominator(cfg, samples, idx, cpu)

    # the skipped pass's field holds garbage: a loss that still read it would change
    garbage = [{**mb, "old_logp": torch.full_like(mb["old_logp"], -5.0)} for mb in mbs]

    def loss_and_grads(from_forward: bool, batches):
        model.zero_grad(set_to_none=True)
        loss_fn = algorithm.make_loss_fn(
            cfg, denominator=denominator, stats_out=[], proximal_from_forward=from_forward
        )
        total = sum(loss_fn(model, mb) for mb in batches)
        total.backward()
        return float(total.detach()), [p.grad.clone() for p in model.parameters()]

    loss_recomputed, grads_recomputed = loss_and_grads(False, mbs)
    loss_forward, grads_forward = loss_and_grads(True, garbage)
    assert loss_forward == pytest.approx(loss_recomputed, rel=1e-5, abs=1e-7)
    assert loss_and_grads(False, garbage)[0] != pytest.approx(loss_recomputed, rel=1e-3)
    assert any(float(g.abs().max()) > 0 for g in grads_forward)
    for a, b in zip(grads_forward, grads_recomputed, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
