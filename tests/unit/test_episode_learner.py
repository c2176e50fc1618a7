"""The learner on episodes: only the ids the policy sampled carry loss.

An episode's tool and environment ids are context: they shape the log-probs of the ids after
them, but no advantage, loss, KL, entropy, mismatch statistic or loss denominator counts them.
Checked by putting garbage in every per-token field at their positions: nothing moves.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch  # noqa: TID253 - tests of torch code

from common.config.load import load_config
from common.protocol import wire
from services.learner import batching, objective
from services.learner.cycle import (
    Sample,
    as_batch_fields,
    decode_samples,
    encode_samples,
    mask_overlong,
    mask_refused,
    reward_kl,
    samples_from_groups,
)
from services.learner.main import training_settings
from services.learner.model import load_policy
from tether.demo.tiny_model import build_tiny_model

CPU = torch.device("cpu")
# prompt 5 ids; response: assistant 3 | tool 4 | assistant 2
MASK = [1, 1, 1, 0, 0, 0, 0, 1, 1]


def _cfg(*sets: str):
    return load_config(
        flags={"run.prompts_per_cycle": 1, "run.responses_per_prompt": 2,
               "run.train_steps_per_cycle": 1},
        overrides=["generator.temperature=1.0", *sets], env={},
    ).config  # fmt: skip


def _episodes(garbage: bool) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(2):
        prompt = torch.randint(3, 250, (5,), generator=g).tolist()
        response = torch.randint(3, 250, (len(MASK),), generator=g).tolist()
        lp = (-torch.rand(len(MASK), generator=g)).tolist()
        adv = [1.0 if i == 0 else -1.0] * len(MASK)
        ref = (-torch.rand(len(MASK), generator=g)).tolist()
        if garbage:  # whatever sits on the tool ids must not matter
            for k, m in enumerate(MASK):
                if not m:
                    lp[k], adv[k], ref[k] = -40.0, 1e4, -35.0
        else:
            lp = [x * m for x, m in zip(lp, MASK, strict=True)]
        s = Sample(sample_id=f"e/{i}", group=0, prompt_ids=prompt, response_ids=response,
                   behaviour_logp=lp, reward=float(i == 0), policy_version=0,
                   loss_mask=list(MASK))  # fmt: skip
        s.advantages, s.ref_logp, s.old_logp = adv, ref, [x - 0.01 for x in lp]
        out.append(s)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m"), hidden_size=32, num_layers=1,
                            num_heads=2)  # fmt: skip


def _loss_and_grads(model_dir, cfg, samples):
    torch.manual_seed(0)
    model = load_policy(model_dir, device=CPU, fsdp=False)
    stats: list[dict[str, float]] = []
    idx = list(range(len(samples)))
    mbs = objective.rank_micro_batches(cfg.learner, samples, idx, pad_id=0, device=CPU)
    loss_fn = objective.make_loss_fn(training_settings(cfg), denominator=objective.step_denominator(cfg.learner, samples, idx),
                                     stats_out=stats, proximal_from_forward=False)  # fmt: skip
    total = sum(loss_fn(model, mb) for mb in mbs)
    total.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return float(total.detach()), grads, stats


@pytest.mark.parametrize("pack", ["true", "false"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_tool_ids_carry_no_loss_gradient_kl_entropy_or_mismatch(model_dir, pack, agg):
    cfg = _cfg("learner.kl_coef=0.1", "learner.entropy_coef=0.01", f'learner.loss_agg="{agg}"',
               f"learner.pack_sequences={pack}", 'learner.mismatch_mask_token=[0.5, 2.0]')  # fmt: skip
    clean_loss, clean_grads, clean_stats = _loss_and_grads(model_dir, cfg, _episodes(False))
    loss, grads, stats = _loss_and_grads(model_dir, cfg, _episodes(True))
    assert loss == pytest.approx(clean_loss, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(grads, clean_grads, rtol=1e-5, atol=1e-7)
    for key in ("kl_ref_mean", "entropy_mean", "mismatch_kl", "mismatch_masked_tokens"):
        keys = [k for k in clean_stats[0] if k.startswith(key)]
        assert keys, (key, sorted(clean_stats[0]))
        for k in keys:
            assert stats[0][k] == pytest.approx(clean_stats[0][k], rel=1e-5, abs=1e-7), k


def test_the_loss_denominator_counts_sampled_ids_only():
    samples = _episodes(garbage=False)
    assert objective.step_denominator(_cfg().learner, samples, [0, 1]) == 2 * sum(MASK)
    assert objective.step_denominator(_cfg('learner.loss_agg="seq-mean-token-sum"').learner,
                                      samples, [0, 1]) == 2  # fmt: skip


def test_collate_puts_the_mask_on_the_response_positions():
    samples = _episodes(garbage=False)
    batch = batching.collate([as_batch_fields(s) for s in samples], [0, 1], pad_id=0,
                             mask_field="response_mask")  # fmt: skip
    assert batch["loss_mask"][0].tolist() == [0.0] * 5 + [float(m) for m in MASK]
    with pytest.raises(ValueError, match="'response_mask' has 3 values for 9"):
        bad = [{**as_batch_fields(samples[0]), "response_mask": [1, 1, 1]}]
        batching.collate(bad, [0], pad_id=0, mask_field="response_mask")


def test_the_kl_penalty_in_the_reward_skips_tool_ids():
    samples = _episodes(garbage=True)
    kl, mask = reward_kl(samples, _cfg("learner.kl_coef=0.1", "learner.kl_in_reward=true").learner)
    assert mask[0].tolist() == [float(m) for m in MASK]
    assert (kl[:, 3:7] == 0).all() and (kl[:, :3] != 0).any()


def _group(finish: str = "stop") -> wire.TrajectoryGroup:
    n = len(MASK)
    mask = np.asarray(MASK, dtype=np.uint8)
    versions = np.where(mask == 1, [3, 3, 3, 0, 0, 0, 0, 5, 5], -1).astype(np.int32)
    traj = wire.Trajectory(
        sample_id="p/0", sample_index=0, response_token_ids=np.arange(n, dtype=np.uint32),
        behaviour_logprobs=-0.5 * mask.astype(np.float32), loss_mask=mask,
        token_versions=versions, policy_version=3, finish_reason=finish,
        turns=[("assistant", 0, 3), ("tool", 3, 7), ("assistant", 7, 9)],
    )  # fmt: skip
    return wire.TrajectoryGroup(
        group_id="p", prompt_id="p", cycle=0, index=0, split="train",
        prompt_token_ids=np.arange(5, dtype=np.uint32), prompt_text="q", ground_truth="1",
        metadata={}, generator_id="g", samples=[traj],
    )  # fmt: skip


def _scored(finish: str = "stop") -> wire.ScoredGroup:
    msg = wire.decode(wire.encode(wire.ScoredGroup(_group(finish), [1.0], [{}], [""], "s", 0.0)))
    assert isinstance(msg, wire.ScoredGroup)
    return msg


def test_an_episode_from_the_wire_keeps_its_mask_and_its_oldest_version():
    (s,) = samples_from_groups([_scored()])
    assert s.loss_mask == MASK and s.policy_version == 3  # staleness counts from the oldest
    (back,) = decode_samples(encode_samples([s]))  # as the other ranks receive it
    assert back.loss_mask == MASK and not back.refused


def test_cut_short_and_refused_episodes_carry_no_loss():
    cfg = _cfg("learner.overlong_filter=true")
    samples = [
        *samples_from_groups([_scored("max_turns")]),
        *samples_from_groups([_scored("length")]),
        *samples_from_groups([_scored("template_mismatch")]),
        *samples_from_groups([_scored("stop")]),
    ]
    assert [s.truncated for s in samples] == [True, True, False, False]
    assert mask_overlong(samples, cfg.learner) == 2 and mask_refused(samples) == 1
    assert [s.weight for s in samples] == [0.0, 0.0, 0.0, 1.0]
