"""The step record's fingerprints of what a step trained on (``services.learner.step_log``): the
reproducibility test compares two runs with them, sample by sample, so each must change when one
sample's response ids or reward does, and not when only the order of the batch does."""

from __future__ import annotations

from types import SimpleNamespace

from services.learner.cycle import Sample
from services.learner.step_log import batch_digest, samples_digests, step_record


def _batch() -> list[Sample]:
    return [
        Sample(sample_id=f"c0/{g}/p{g}/{i}", group=g, prompt_ids=[1, 2], response_ids=[5 + i, 9, 2],
               behaviour_logp=[-0.1] * 3, reward=float(i % 2), policy_version=0)
        for g in range(2) for i in range(3)
    ]  # fmt: skip


def test_the_digests_follow_every_sample_s_response_ids_and_reward_not_the_batch_order():
    batch = _batch()
    whole, per_sample = samples_digests(batch)
    assert len(whole) == 16 and len(per_sample) == len(batch)
    assert all(len(d) == 8 for d in per_sample)
    assert samples_digests(batch[::-1]) == (whole, per_sample)

    ordered = sorted(range(len(batch)), key=lambda i: batch[i].sample_id)
    for change in ({"response_ids": [5, 9, 3]}, {"response_ids": [5, 9]}, {"reward": 0.5}):
        changed = list(batch)
        changed[2] = Sample(**{**vars(batch[2]), **change})
        got_whole, got = samples_digests(changed)
        assert got_whole != whole, change
        # exactly that sample's own digest differs, at its place among the sorted ids
        assert [k for k in range(len(batch)) if got[k] != per_sample[k]] == [ordered.index(2)]
    # the ids are in the step digest too: the same responses under other ids differ
    renamed = [Sample(**{**vars(s), "sample_id": s.sample_id + "x"}) for s in batch]
    assert samples_digests(renamed)[0] != whole and samples_digests(renamed)[1] == per_sample


def test_the_step_record_carries_them():
    batch = _batch()
    step = SimpleNamespace(loss=0.5, grad_norm=1.0, lr=1e-4)
    rec = step_record(version=1, cycle=0, samples=batch, idx=[0, 2, 4], step=step, stats=[],
                      dropped=0, trained=3, seconds=0.1)  # fmt: skip
    picked = [batch[i] for i in (0, 2, 4)]
    assert (rec["samples_digest"], rec["sample_digests"]) == samples_digests(picked)
    assert rec["batch_digest"] == batch_digest(s.sample_id for s in picked)
