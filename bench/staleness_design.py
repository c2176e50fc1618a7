"""The staleness study's design, fixed before any run (``tether bench staleness``): the arms,
the lag grid, the sizes, and the tests with their margins. ``bench/staleness.py`` runs it,
``bench/staleness_stats.py`` applies the tests, ``bench/staleness_report.py`` writes it up.

**Lag.** In arm (correction, η, S) every optimizer step of cycle ``c ≥ η`` trains on responses
sampled by the policy as it was at the start of cycle ``c − η``; the first η cycles are
synchronous (their own policy). η counts cycles, AReaL's unit (its ``max_head_offpolicyness``
counts generation batches); in optimizer steps the staleness of step ``j`` of a cycle is
``η·S + j``, so ``η·S`` to ``η·S + S − 1`` (``Arm.staleness_steps``).

**Corrections.** ``sync``: η = 0 (every correction computes the same update there);
``none``: PPO's ratio and clip anchored to the behaviour policy; ``decoupled``: AReaL's
decoupled PPO (clip anchored to the proximal policy, behaviour weight, tokens above its cap of 5
dropped); ``tis``: the same anchor, the weight truncated at 2. The A/A control runs decoupled at
η = 4, S = 4 a second time under another label with an independent sampling stream (same data
order): any difference between the two is noise. (One A/A arm, as the issue asks; its interval
is the resolution of the study's paired comparisons, whose noise it shares or exceeds: the
tested pairs also share their sampling random numbers.)

**Pre-registered tests** (``PREREGISTERED``), on the area under the held-out accuracy curve
(AUC: mean accuracy over steps 0…N, trapezoids), paired by seed:
1. non-inferiority of decoupled at η = 4 against synchronous, at S = 1 and at S = 4: the 95 %
   confidence interval of mean(AUC_decoupled − AUC_sync) ÷ mean(AUC_sync) lies above −5 %
   (one-sided α = 2.5 % per S);
2. decoupled against uncorrected at η = 4, at each S: the interval of the mean paired
   difference, and an exact sign-flip permutation p-value;
3. the A/A pair: its interval must contain 0, else the study says it cannot resolve anything.
A "holds" verdict needs the interval above −5 %; "fails" needs it wholly below; anything else
is "open" (cannot be resolved at this scale).
Everything else (other η, TIS, final accuracy) is reported as exploratory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

CORRECTIONS = ("sync", "none", "decoupled", "tis")
ETAS = (1, 2, 4)  # cycles of lag, beside η = 0 (sync)
STEPS_PER_CYCLE = (1, 4)
AA_LABEL = "decoupled-replicate"

PREREGISTERED: dict[str, Any] = {
    "measure": "AUC of held-out accuracy over optimizer steps 0..steps (trapezoids, ÷ steps)",
    "pairing": "by seed (data order, sampling streams and micro-batch order shared across arms)",
    "non_inferiority": {
        "arm": "decoupled",
        "eta": 4,
        "against": "sync",
        "steps_per_cycle": list(STEPS_PER_CYCLE),
        "margin": 0.05,
        "rule": "lower end of the 95 % CI of mean(AUC_arm − AUC_sync) / mean(AUC_sync) > −margin",
    },
    "comparison": {"arm": "decoupled", "against": "none", "eta": 4, "interval": 0.95},
    "aa_control": {
        "arm": "decoupled",
        "eta": 4,
        "steps_per_cycle": max(STEPS_PER_CYCLE),
        "labels": ["decoupled", AA_LABEL],
        "rule": "the 95 % CI of the paired AUC difference contains 0, else: cannot resolve",
    },
}


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One configuration: a correction at a lag of ``eta`` cycles with S optimizer steps per
    cycle. ``replicate`` > 0 draws an independent sampling stream (the A/A control)."""

    correction: str
    eta: int
    steps_per_cycle: int
    replicate: int = 0
    label: str = ""

    def __post_init__(self) -> None:
        if self.correction not in CORRECTIONS:
            raise ValueError(f"correction {self.correction!r}: one of {', '.join(CORRECTIONS)}")
        if (self.correction == "sync") != (self.eta == 0):
            raise ValueError("η = 0 is the synchronous arm, and the synchronous arm has η = 0")
        if not self.label:
            object.__setattr__(self, "label", self.correction)

    @property
    def name(self) -> str:
        return f"S{self.steps_per_cycle}-eta{self.eta}-{self.label}"

    @property
    def off_policy(self) -> str:
        """``learner.off_policy`` (the synchronous arm runs the default, decoupled)."""
        return "decoupled" if self.correction == "sync" else self.correction

    @property
    def staleness_steps(self) -> tuple[int, int]:
        """Least and greatest staleness in optimizer steps of the steps trained after the
        synchronous prefix."""
        return (
            self.eta * self.steps_per_cycle,
            self.eta * self.steps_per_cycle + self.steps_per_cycle - 1,
        )


def grid(
    *, steps_per_cycle: tuple[int, ...] = STEPS_PER_CYCLE, etas: tuple[int, ...] = ETAS
) -> list[Arm]:
    """Per S: synchronous, then each η with none, decoupled and tis; then one A/A replicate,
    decoupled at the largest η and S. Ordered so a study cut short has the tested arms first."""
    arms: list[Arm] = []
    for s in steps_per_cycle:
        arms.append(Arm(correction="sync", eta=0, steps_per_cycle=s))
        for eta in sorted(etas, reverse=True):
            arms += [
                Arm(correction=c, eta=eta, steps_per_cycle=s) for c in ("decoupled", "none", "tis")
            ]
    top_s, top_eta = max(steps_per_cycle), max(etas)
    arms.append(
        Arm(correction="decoupled", eta=top_eta, steps_per_cycle=top_s, replicate=1, label=AA_LABEL)
    )
    return arms


@dataclass(frozen=True, kw_only=True)
class Study:
    """Sizes of the study (``full``: the pre-registered one; ``smoke``: a minute's check that it
    runs end to end)."""

    arms: tuple[Arm, ...]
    seeds: tuple[int, ...] = tuple(range(8))
    steps: int = 100  # optimizer steps per run, a multiple of every S
    prompts_per_step: int = 8  # × 8 responses = 64 responses per optimizer step
    responses_per_prompt: int = 8
    # The demo's learning rate (tether/demo/demo.toml), the one a user of the demo runs. The
    # first study of this design ran at 5e-6, picked with single-seed probes on seed 0 (one of
    # the reported seeds) so that the synchronous curve was still rising at step 100; at that
    # rate the behaviour policy barely moved (KL(behaviour ‖ learner) ≤ ~4e-4, no weight above
    # 5), which made the S = 1 test close to vacuous. Its result is
    # bench/results/staleness_lr5e-06.json; `--lr` runs the design at any other rate.
    lr: float = 5e-5
    # optimizer steps between held-out evaluations (step 0 included): 6 points of the curve;
    # one evaluation of 1,000 problems costs as much as ~12 optimizer steps (bench/README.md)
    eval_every: int = 20
    held_out: int = 1000  # held-out problems, greedy (never trained on, never in the warm-up)
    workers: int = 2  # runs in parallel, one thread each
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [a.name for a in self.arms if self.steps % a.steps_per_cycle]
        if bad:
            raise ValueError(f"steps = {self.steps} must be a multiple of S: {', '.join(bad)}")
        if self.eval_every < 1 or self.steps % self.eval_every:
            raise ValueError(f"eval_every = {self.eval_every} must divide steps = {self.steps}")

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        d["arms"] = [a.name for a in self.arms]
        return d


def _slice() -> Study:
    """Full length, two seeds, the arms of the S = 4 tests (sync, decoupled and uncorrected at
    η = 4, the A/A replicate): what one seed costs, to project the full study's time."""
    keep = {"S4-eta0-sync", "S4-eta4-decoupled", "S4-eta4-none", f"S4-eta4-{AA_LABEL}"}
    return Study(arms=tuple(a for a in grid() if a.name in keep), seeds=(0, 1))


def _tests() -> Study:
    """The pre-registered tests alone, at full length and 8 seeds: at S = 1 and S = 4 the
    synchronous arm and decoupled and uncorrected at η = 4, plus the A/A replicate (7 of the 21
    arms; the exploratory ones, other η and TIS, left out). Its runs are the full study's: a
    later ``full`` run reuses them."""
    keep = {f"S{s}-eta{e}-{c}" for s in STEPS_PER_CYCLE
            for e, c in ((0, "sync"), (4, "decoupled"), (4, "none"))}  # fmt: skip
    keep.add(f"S{max(STEPS_PER_CYCLE)}-eta{max(ETAS)}-{AA_LABEL}")
    return Study(arms=tuple(a for a in grid() if a.name in keep))


def _s4() -> Study:
    """The pre-registered tests' 7 arms plus every other S = 4 arm (η = 1 and 2 with each
    correction, TIS at η = 4): 14 of the 21 arms. The S = 1 exploratory arms are left out: at
    S = 1 a lag of 4 steps already leaves the behaviour policy indistinguishable from the
    learner's (every correction computes the same step there), and η = 1, 2 are fresher still.
    Its runs are the full study's."""
    tests = {a.name for a in _tests().arms}
    s = max(STEPS_PER_CYCLE)
    return Study(arms=tuple(a for a in grid() if a.name in tests or a.steps_per_cycle == s))


# the sizes whose result is the study of record, bench/results/staleness.json (its JSON and
# report say which arms ran); the others write staleness_<size>.json
OF_RECORD = ("full", "tests", "s4")

SIZES = {
    "full": lambda: Study(arms=tuple(grid())),
    "tests": _tests,
    "s4": _s4,
    "slice": _slice,
    # every code path once, in a few minutes: both S, a lagged cycle at S = 4, every arm kind
    "smoke": lambda: Study(
        arms=tuple(grid(etas=(1,))),
        seeds=(0,),
        steps=12,
        prompts_per_step=4,
        eval_every=4,
        held_out=64,
    ),
}
