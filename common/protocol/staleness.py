"""The staleness bound, the one rule that lets training run off-policy by a known amount.

Versions count optimizer steps: the learner's weights after ``t`` steps are version ``t``. A
trajectory sampled by policy version ``v`` may be used in the optimizer step that turns ``t``
into ``t + 1`` only while ``t − v ≤ max_staleness``; so step ``t`` can use versions from
``oldest_usable(t) = max(0, t − max_staleness)`` on. Three places apply it, all through
``usable``:

- the learner's dispatcher: cycle ``c`` is trained by steps ``c·S … c·S + S − 1`` (S =
  train_steps_per_cycle), so its prompts carry ``min_policy_version(c) = oldest_usable(c·S +
  S − 1)`` and are dispatched once the learner's own version is usable for them;
- the generator's gate: a prompt waits until the engine runs weights usable for it;
- the learner: a trajectory that is not usable for the step at hand gets zero weight and is
  counted as dropped (the gate above makes that rare by construction).
"""

from __future__ import annotations


def oldest_usable(step: int, *, max_staleness: int) -> int:
    """The oldest policy version whose trajectories optimizer step ``step`` may train on."""
    return max(0, step - max_staleness)


def usable(policy_version: int | None, *, oldest: int) -> bool:
    """Whether ``policy_version`` (None: no weights yet) is at least ``oldest``."""
    return policy_version is not None and policy_version >= oldest


def min_policy_version(cycle: int, *, steps_per_cycle: int, max_staleness: int) -> int:
    """The oldest weights a trajectory of ``cycle`` may come from: what its last step can use."""
    last_step = cycle * steps_per_cycle + steps_per_cycle - 1
    return oldest_usable(last_step, max_staleness=max_staleness)
