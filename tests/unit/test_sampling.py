"""Dynamic sampling's rules (``services.learner.sampling``) against hand-computed values."""

from __future__ import annotations

from types import SimpleNamespace

from services.learner import sampling


def _group(index: int, *rewards: float):
    return SimpleNamespace(group=SimpleNamespace(index=index), rewards=list(rewards))


def test_informative_means_the_rewards_differ():
    assert sampling.informative([1.0, 0.0])
    assert not sampling.informative([0.5, 0.5]) and not sampling.informative([1.0])


def test_extra_prompts_cover_the_expected_shortfall_within_the_cap():
    assert sampling.extra_prompts(8, 0.0, cap=16) == 0
    assert sampling.extra_prompts(8, 0.5, cap=16) == 8  # 8 · 0.5 / 0.5
    assert sampling.extra_prompts(4, 0.375, cap=16) == 3  # ⌈4 · 0.375 / 0.625⌉ = ⌈2.4⌉
    assert sampling.extra_prompts(8, 0.9, cap=16) == 16  # 72 capped
    assert sampling.extra_prompts(8, 1.0, cap=16) == 16  # keep rate floored at 0.05


def test_top_up_size_and_the_smoothed_rate():
    assert sampling.top_up_size(2, 0.5, cap_left=8) == 4  # ⌈2 / 0.5⌉
    assert sampling.top_up_size(2, 0.0, cap_left=8) == 2  # at least the missing groups
    assert sampling.top_up_size(3, 0.5, cap_left=4) == 4  # 6 capped
    assert sampling.top_up_size(3, 0.5, cap_left=0) == 0
    assert sampling.next_filter_rate(None, filtered=3, examined=8) == 0.375
    assert sampling.next_filter_rate(0.375, filtered=1, examined=8) == 0.25  # (0.375 + 0.125) / 2
    assert sampling.next_filter_rate(0.25, filtered=0, examined=0) == 0.25


def test_select_takes_the_first_informative_groups_in_position_order():
    groups = [_group(10, 1, 0), _group(3, 1, 0), _group(0, 1, 0), _group(1, 1, 1),
              _group(8, 0, 1), _group(2, 0, 0), _group(9, 1, 1), _group(11, 0, 1)]  # fmt: skip
    sel = sampling.select(groups, 4, fill=False)
    assert [g.group.index for g in sel.chosen] == [0, 3, 8, 10]
    assert [g.group.index for g in sel.filtered] == [1, 2, 9]
    assert [g.group.index for g in sel.surplus] == [11]
    # too few informative groups: equal-reward ones fill the batch (they train at weight 0)
    short = sampling.select(groups[:4], 4, fill=True)
    assert [g.group.index for g in short.chosen] == [0, 1, 3, 10]
    assert short.informative == 3 and short.filtered == [] and short.surplus == []
