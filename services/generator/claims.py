"""Whether a generator keeps claiming the prompts it holds (``GeneratorLoop._keep_claims``).

A live generator keeps its prompts however long they take (the staleness gate, long responses):
it resets their idle time every third of ``bus.claim_idle_s``, so only a dead generator's are
taken over by its peers. One exception: a generator that has stayed behind the version the
learner published for a whole period is cut off from the weights (its link to the learner's
weight store is down, or it was dropped and cannot rejoin). Its prompts may need that version,
which it cannot get, so it lets their claims lapse: a peer that has the weights takes them over
after ``bus.claim_idle_s``, instead of the cycle waiting for the partition to heal. What it
finishes of them later is published once (the commit's dedupe)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ClaimKeeper:
    period_s: float  # how often the claims are refreshed
    behind_since: float | None = None  # when this generator fell behind the learner's version

    def keep(self, now: float, own: int | None, learner: int | None) -> bool:
        """Refresh the claims now? ``own``: this generator's version (None: none loaded, its
        engine paused until a whole one loads); ``learner``: the version the learner last
        published (None: none yet)."""
        if learner is None or (own is not None and own >= learner):
            self.behind_since = None
            return True
        if self.behind_since is None:
            self.behind_since = now
        return now - self.behind_since < self.period_s
