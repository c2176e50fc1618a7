"""The cycle's sample filters: over-long masking (which responses, what is counted) and the
truncation flag's trip through the learner's rank-to-rank encoding."""

from __future__ import annotations

import pytest

from common.config.load import load_config
from services.learner.cycle import (
    Sample,
    assign_advantages,
    decode_samples,
    encode_samples,
    mask_overlong,
)


def _samples() -> list[Sample]:
    # Two groups of two: group 0 rewards 1, 0 (informative); group 1 rewards 1, 1 (equal).
    return [
        Sample(sample_id=f"s{i}", group=i // 2, prompt_ids=[1, 2], response_ids=[3, 4, 5],
               behaviour_logp=[-0.5] * 3, reward=float(i != 1), policy_version=0,
               truncated=i in (0, 3))
        for i in range(4)
    ]  # fmt: skip


def _cfg(*sets: str):
    flags = {"run.prompts_per_cycle": 2, "run.responses_per_prompt": 2}
    return load_config(flags=flags, overrides=list(sets), env={}).config


def test_overlong_filter_masks_cut_off_responses_and_counts_each_once():
    samples = _samples()
    cfg = _cfg("learner.overlong_filter=true", "learner.filter_equal_reward_groups=true")
    assert assign_advantages(samples, cfg.learner) == 2  # group 1 (2 samples) is filtered first
    # s0 is cut off and informative: masked. s3 is cut off but already filtered: not recounted.
    assert mask_overlong(samples, cfg.learner) == 1
    assert [s.weight for s in samples] == [0.0, 1.0, 0.0, 0.0]
    # its reward still counts in its group's advantage: s1 = (0 - 0.5) / (0.5 + 1e-6) ≈ -1
    assert samples[1].advantages == [pytest.approx(-1.0, abs=1e-5)] * 3
    assert mask_overlong(samples, _cfg().learner) == 0  # the filter is off by default


def test_the_truncation_flag_survives_the_broadcast_encoding():
    decoded = decode_samples(encode_samples(_samples()))
    assert [s.truncated for s in decoded] == [True, False, False, True]
