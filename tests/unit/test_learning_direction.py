"""The learner's update moves the policy the right way: after a few optimizer steps through the
real learner path (advantages → proximal log-probs → micro-batches → clipped loss →
train_step), rewarded responses are more likely and unrewarded ones less likely."""

from __future__ import annotations

import pytest

from common.config.load import load_config
from services.learner import logprobs, losses, objective, optim
from services.learner.cycle import Sample, assign_advantages, steps_of_cycle
from services.learner.loop import LearnerService
from services.learner.main import training_settings
from services.learner.model import load_policy, load_reference
from services.learner.train_step import train_step
from tests.learner_support import learner_settings_without_model
from tether.demo.tiny_model import build_tiny_model


@pytest.mark.parametrize("off_policy", ["decoupled", "tis", "none"])
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp"])
def test_rewarded_responses_become_more_likely(tmp_path, off_policy, estimator):
    samples, delta, _ = train_three_cycles(
        tmp_path, f'learner.off_policy="{off_policy}"', f'learner.advantage_estimator="{estimator}"'
    )
    up = [d for d, s in zip(delta, samples, strict=True) if s.reward > 0]
    down = [d for d, s in zip(delta, samples, strict=True) if s.reward == 0]
    assert min(up) > 0 and max(down) < 0, (up, down)


def train_three_cycles(tmp_path, *sets: str, edit=None):
    """Three cycles of two optimizer steps on two groups of four made-up responses (reward
    1 for odd ones), through the real learner path. ``edit(samples)`` may change the samples
    after the behaviour log-probs are set. Returns (samples, change of each response's log-prob,
    the steps' merged stats)."""
    import torch

    torch.manual_seed(0)
    model_dir = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2)
    model = load_policy(model_dir, device=torch.device("cpu"), fsdp=False)
    cfg = load_config(
        flags={
            "run.prompts_per_cycle": 2,
            "run.responses_per_prompt": 4,
            "run.train_steps_per_cycle": 2,
        },
        overrides=["learner.lr=3e-3", "generator.temperature=0.7", *sets],
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
        lps = logprobs.recompute_logprobs(
            model, training_settings(cfg), samples, pad_id=0, device=torch.device("cpu")
        )
        return [sum(lp) for lp in lps]

    before = seq_logp()
    for s, lp in zip(
        samples,
        logprobs.recompute_logprobs(
            model, training_settings(cfg), samples, pad_id=0, device=torch.device("cpu")
        ),
        strict=True,
    ):
        s.behaviour_logp = lp  # as if the generator sampled them with these weights
    if edit is not None:
        edit(samples)
    opt = optim.build_optimizer(model, lr=cfg.learner.lr)
    stats: list[dict[str, float]] = []
    sched = optim.build_scheduler(opt, optim.build_schedule())
    for cycle in range(3):
        assign_advantages(samples, cfg.learner)
        for s, lp in zip(
            samples,
            logprobs.recompute_logprobs(
                model, training_settings(cfg), samples, pad_id=0, device=torch.device("cpu")
            ),
            strict=True,
        ):
            s.old_logp = lp
        for idx in steps_of_cycle(
            len(samples), steps=cfg.run.train_steps_per_cycle, passes=1, seed=0, cycle=cycle
        ):
            mbs = objective.rank_micro_batches(
                cfg.learner, samples, idx, pad_id=0, device=torch.device("cpu")
            )
            loss_fn = objective.make_loss_fn(
                training_settings(cfg),
                denominator=objective.step_denominator(cfg.learner, samples, idx),
                stats_out=stats,
            )
            train_step(model, opt, sched, mbs, loss_fn, grad_clip=1.0)
    after = seq_logp()
    return samples, [a - b for a, b in zip(after, before, strict=True)], losses.merge_stats(stats)


def test_one_step_cycles_take_the_proximal_log_probs_from_the_training_forward(tmp_path):
    """One optimizer step per cycle and one pass: the proximal policy is the policy being
    trained, so the recompute pass is skipped and the step's own detached log-probs anchor the
    ratio. Same loss and gradient as with the recomputed proximal log-probs."""
    import torch

    def config(*sets: str):
        return load_config(
            flags={"run.prompts_per_cycle": 2, "run.responses_per_prompt": 4},
            overrides=["generator.temperature=0.7", *sets],
            env={},
        ).config

    cfg = config("run.train_steps_per_cycle=1")
    assert logprobs.proximal_is_current(training_settings(cfg))
    assert not logprobs.proximal_is_current(
        training_settings(config("run.train_steps_per_cycle=2"))
    )
    assert not logprobs.proximal_is_current(
        training_settings(config("run.passes_per_cycle=2", "run.train_batch_size=8"))
    )
    assert not logprobs.proximal_is_current(training_settings(config('learner.off_policy="none"')))

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
    assign_advantages(samples, cfg.learner)
    for s, lp in zip(
        samples,
        logprobs.recompute_logprobs(model, training_settings(cfg), samples, pad_id=0, device=cpu),
        strict=True,
    ):
        s.old_logp = lp
    idx = list(range(len(samples)))
    mbs = objective.rank_micro_batches(cfg.learner, samples, idx, pad_id=0, device=cpu)
    denominator = objective.step_denominator(cfg.learner, samples, idx)

    # the skipped pass's field holds garbage: a loss that still read it would change
    garbage = [{**mb, "old_logp": torch.full_like(mb["old_logp"], -5.0)} for mb in mbs]

    def loss_and_grads(from_forward: bool, batches):
        model.zero_grad(set_to_none=True)
        loss_fn = objective.make_loss_fn(
            training_settings(cfg),
            denominator=denominator,
            stats_out=[],
            proximal_from_forward=from_forward,
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


def _full_kl(model, ref, samples) -> float:
    """Mean over response positions of KL(policy ‖ reference) over the whole vocabulary."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            n_p = len(s.prompt_ids)
            # logits at position t predict token t + 1: these predict the response tokens
            lp = torch.log_softmax(model(ids).logits[0, n_p - 1 : -1].double(), dim=-1)
            lq = torch.log_softmax(ref(ids).logits[0, n_p - 1 : -1].double(), dim=-1)
            total += float((lp.exp() * (lp - lq)).sum())
            count += len(s.response_ids)
    return total / count


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_pp"])
def test_kl_in_the_reward_keeps_the_policy_closer_to_the_reference(tmp_path, estimator):
    """Two runs on the same data from the same weights: no KL term, and KL in the reward. Each
    cycle an on-policy generator's log-probs come in, the learner prepares the cycle as the
    service does (reference and proximal log-probs, then advantages) and takes real optimizer
    steps. With the KL reward the policy ends measurably closer to the reference."""
    import torch

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model_dir = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2)

    def run(*sets: str) -> tuple[float, list[dict[str, float]]]:
        cfg = load_config(
            flags={"run.prompts_per_cycle": 2, "run.responses_per_prompt": 4},
            overrides=[
                "run.train_steps_per_cycle=2",
                f'learner.advantage_estimator="{estimator}"',
                "learner.lr=3e-3",
                "generator.temperature=0.7",
                *sets,
            ],
            env={},
        ).config
        svc = LearnerService(learner_settings_without_model(cfg), run_dir=tmp_path / "run",
                             datasets=None)  # fmt: skip
        svc.pad_id, svc.device = 0, cpu
        svc.model = load_policy(model_dir, device=cpu, fsdp=False)
        svc.ref_model = load_reference(model_dir, device=cpu, fsdp=False)
        g = torch.Generator().manual_seed(1)
        samples = []
        for group in range(2):
            prompt = torch.randint(3, 250, (6,), generator=g).tolist()
            samples += [
                Sample(sample_id=f"{group}/{i}", group=group, prompt_ids=prompt,
                       response_ids=torch.randint(3, 250, (5,), generator=g).tolist(),
                       behaviour_logp=[0.0] * 5, reward=float(i % 2), policy_version=0)
                for i in range(4)
            ]  # fmt: skip
        opt = optim.build_optimizer(svc.model, lr=cfg.learner.lr)
        sched = optim.build_scheduler(opt, optim.build_schedule())
        stats: list[dict[str, float]] = []
        for cycle in range(6):
            for s, lp in zip(
                samples,
                logprobs.recompute_logprobs(
                    svc.model, training_settings(cfg), samples, pad_id=0, device=cpu
                ),
                strict=True,
            ):
                s.behaviour_logp = lp  # sampled by the current weights
            svc._prepare(samples)
            for idx in steps_of_cycle(
                len(samples), steps=len(samples) // 4, passes=1, seed=0, cycle=cycle
            ):
                mbs = objective.rank_micro_batches(cfg.learner, samples, idx, pad_id=0, device=cpu)
                loss_fn = objective.make_loss_fn(
                    training_settings(cfg),
                    denominator=objective.step_denominator(cfg.learner, samples, idx),
                    stats_out=stats,
                )
                train_step(svc.model, opt, sched, mbs, loss_fn, grad_clip=1.0)
        return _full_kl(svc.model, svc.ref_model, samples), stats

    free, _ = run()
    held, stats = run("learner.kl_coef=1.0", "learner.kl_in_reward=true", 'learner.kl_type="k1"')
    # measured: free 0.039; held 0.011 (grpo), 0.015 (reinforce_pp)
    assert free > 0.02, free  # the unpenalised run has moved away from the reference
    assert held < 0.6 * free, (held, free)
    assert all("kl_ref_mean" in s for s in stats)  # the penalty's KL is reported


def test_kl_clamp_bounds_the_kl_loss_term(tmp_path):
    """learner.kl_clamp reaches the loss: reference log-probs far below the policy's make every
    token's k1 estimate large; clamped, each is exactly kl_clamp and adds no gradient."""
    import torch

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model_dir = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2)
    model = load_policy(model_dir, device=cpu, fsdp=False)
    samples = [
        Sample(sample_id=str(i), group=0, prompt_ids=[3, 4, 5], response_ids=[6 + i, 7, 8],
               behaviour_logp=[-5.0] * 3, reward=float(i), policy_version=0,
               ref_logp=[-60.0] * 3)
        for i in range(2)
    ]  # fmt: skip

    def loss_and_grads(*sets):
        cfg = load_config(
            flags={"run.prompts_per_cycle": 1, "run.responses_per_prompt": 2},
            overrides=['learner.off_policy="none"', 'learner.kl_type="k1"', *sets],
            env={},
        ).config
        assign_advantages(samples, cfg.learner)
        mbs = objective.rank_micro_batches(cfg.learner, samples, [0, 1], pad_id=0, device=cpu)
        stats: list[dict[str, float]] = []
        loss_fn = objective.make_loss_fn(training_settings(cfg), denominator=6.0, stats_out=stats)
        model.zero_grad(set_to_none=True)
        loss = sum(loss_fn(model, mb) for mb in mbs)
        loss.backward()
        return float(loss.detach()), [p.grad.clone() for p in model.parameters()], stats

    base, base_grads, _ = loss_and_grads()
    clamped, grads, stats = loss_and_grads("learner.kl_coef=0.5", "learner.kl_clamp=0.1")
    assert [s["kl_ref_mean"] for s in stats] == [pytest.approx(0.1)] * len(stats)
    assert clamped == pytest.approx(base + 0.5 * 0.1, rel=1e-6)
    for a, b in zip(grads, base_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-7)
    unclamped, _, stats = loss_and_grads("learner.kl_coef=0.5")
    assert stats[0]["kl_ref_mean"] > 40 and unclamped > base + 20
