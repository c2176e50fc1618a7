"""A generator's check that versions never go backwards within an episode (a learner restarted
from an older checkpoint): on the engine's spans of a one-turn response, and across the turns of
an episode. The prompt is then generated again (``services/generator/loop.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from common.protocol import wire
from services.generator.trajectories import (
    RolledBack,
    check_episodes_order,
    check_samples_order,
)


def _sample(*spans: tuple[str, int, int]) -> SimpleNamespace:
    return SimpleNamespace(weight_versions=list(spans))


def test_a_response_whose_spans_go_down_is_rolled_back():
    check_samples_order([_sample(("1", 0, 3), ("2", 3, 8)), _sample(("2", 0, 8))])
    with pytest.raises(RolledBack) as err:
        check_samples_order([_sample(("1", 0, 8)), _sample(("294", 0, 3), ("292", 3, 8))])
    assert err.value.versions == [294, 292] and str(err.value) == "v294 -> v292"


def test_an_episode_whose_later_turn_went_down_is_rolled_back():
    def episode(versions: list[int], mask: list[int]) -> wire.Trajectory:
        t = wire.Trajectory.single_turn(
            sample_id="p/0", sample_index=0, token_ids=list(range(len(versions))),
            logprobs=[-0.1] * len(versions), version_spans=[(0, 0)], finish_reason="stop",
        )  # fmt: skip
        t.token_versions = np.asarray(versions, dtype="<i4")
        t.loss_mask = np.asarray(mask, dtype=np.uint8)
        return t

    check_episodes_order([episode([3, 3, -1, -1, 4, 4], [1, 1, 0, 0, 1, 1])])  # tool ids: -1
    with pytest.raises(RolledBack) as err:
        check_episodes_order([episode([5, 5, -1, 3, 3], [1, 1, 0, 1, 1])])
    assert err.value.versions == [5, 3]
