"""Dynamic sampling (DAPO), owned by the learner's rank 0: keep every optimizer step full of
groups that carry signal.

A group whose rewards are all equal (max − min ≤ 0, the rule of
``advantages.equal_reward_group_mask``) has zero group-relative advantages: it teaches nothing.
With ``learner.dynamic_sampling`` a cycle is trained on exactly ``prompts_per_cycle``
informative groups, so ``train_batch_size`` informative responses make every step:

- **Over-sampling.** Each new cycle is dispatched with ``P + extra`` prompts, where
  ``extra = ⌈P · f / (1 − f)⌉`` for the observed filter rate ``f`` (the expected shortfall),
  capped by ``learner.max_extra_prompts_per_cycle``.
- **Top-up.** When every dispatched group of the cycle is in and fewer than ``P`` are
  informative, another round of ``⌈missing / (1 − f)⌉`` prompts is dispatched, as long as the
  cycle's cap allows; with the cap spent, the cycle is trained with what it has (the equal-
  reward groups fill the batch at weight 0, as the plain filter does).
- **Selection.** Groups are taken in sampler-position order: the first ``P`` informative ones
  are trained; the equal-reward groups before and after them are *filtered*; informative groups
  beyond the first ``P`` are *surplus*. Both are counted (``filtered_samples``,
  ``surplus_samples``), so generated = trained + dropped stale + filtered + masked over-long +
  surplus + dead-lettered + in flight keeps holding.
- **Filter rate.** After each cycle ``f ← (f + f_cycle) / 2`` (the first cycle sets it), over
  every group the cycle examined.

Determinism and resume: sampler positions come from a cursor that advances by each round's
size, and the cursor, every untrained cycle's rounds and ``f`` are saved in the checkpoint
(``Dispatcher.state``). The decisions depend only on that state and on the rewards of the
groups at the dispatched positions, so a restarted learner re-dispatches the same positions
(the generators de-duplicate the prompt ids) and selects the same groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# The shortfall estimate never assumes fewer than 1 informative group in 20.
_MIN_KEEP_RATE = 0.05


def informative(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ (its group-relative advantages are not all 0)."""
    return len(rewards) > 0 and max(rewards) - min(rewards) > 0


def extra_prompts(prompts: int, filter_rate: float, cap: int) -> int:
    """Extra prompts dispatched with a new cycle: ⌈P · f / (1 − f)⌉, at most ``cap``."""
    if filter_rate <= 0:
        return 0
    keep = max(1.0 - filter_rate, _MIN_KEEP_RATE)
    return min(cap, math.ceil(prompts * (1.0 - keep) / keep - 1e-9))


def top_up_size(missing: int, filter_rate: float, cap_left: int) -> int:
    """Prompts of a top-up round for ``missing`` informative groups: ⌈missing / (1 − f)⌉,
    at least ``missing``, at most ``cap_left``."""
    keep = max(1.0 - filter_rate, _MIN_KEEP_RATE)
    return max(0, min(cap_left, max(missing, math.ceil(missing / keep - 1e-9))))


def next_filter_rate(rate: float | None, *, filtered: int, examined: int) -> float | None:
    """The smoothed filter rate after a cycle that filtered ``filtered`` of ``examined`` groups."""
    if examined == 0:
        return rate
    observed = filtered / examined
    return observed if rate is None else (rate + observed) / 2


@dataclass
class Selection:
    """The outcome of one cycle: the groups to train (position order) and what was left out."""

    chosen: list[Any]
    filtered: list[Any] = field(default_factory=list)  # equal rewards, not trained
    surplus: list[Any] = field(default_factory=list)  # informative, beyond prompts_per_cycle

    @property
    def informative(self) -> int:
        return sum(1 for g in self.chosen if informative(g.rewards))


def select(groups: Sequence[Any], need: int, *, fill: bool) -> Selection:
    """Groups (``.group.index`` and ``.rewards``), taken in position order: the first ``need``
    informative ones. With ``fill`` and too few informative groups, equal-reward groups (in
    position order) make up the number, to be zero-weighted by the equal-reward filter."""
    ordered = sorted(groups, key=lambda g: g.group.index)
    sel = Selection(chosen=[])
    for g in ordered:
        if not informative(g.rewards):
            sel.filtered.append(g)
        elif len(sel.chosen) < need:
            sel.chosen.append(g)
        else:
            sel.surplus.append(g)
    if fill and len(sel.chosen) < need:
        fillers = sel.filtered[: need - len(sel.chosen)]
        sel.filtered = sel.filtered[len(fillers) :]
        sel.chosen = sorted(sel.chosen + fillers, key=lambda g: g.group.index)
    return sel
