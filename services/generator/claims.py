"""Whether a generator keeps claiming the prompts it holds (``GeneratorLoop._keep_claims``).

A live generator keeps its prompts however long they take (the staleness gate, long responses):
it resets their idle time every third of ``bus.claim_idle_s``, so only a dead generator's are
taken over by its peers. One exception: a generator that has stayed behind the version the
learner published for a whole period is cut off from the weights (its link to the learner's
weight store is down, or it was dropped and cannot rejoin). Its prompts may need that version,
which it cannot get, so it lets their claims lapse: a peer that has the weights takes them over
after ``bus.claim_idle_s``, instead of the cycle waiting for the partition to heal. Meanwhile it
takes no prompts and claims none (``GeneratorLoop._keep_claims``); the first version it loads
ends the lapse. What it finishes later of the prompts it held is published once (the commit's
dedupe)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ClaimKeeper:
    period_s: float  # how often the claims are refreshed
    behind_since: float | None = None  # since when behind the learner with no version loaded
    loaded: int | None = None  # the version it had then

    def keep(self, now: float, own: int | None, learner: int | None) -> bool:
        """Refresh the claims now? ``own``: this generator's version (None: none loaded, its
        engine paused until a whole one loads); ``learner``: the version the learner last
        published (None: none yet). A generator that loads a newer version while still behind
        (catching up, or slower than the learner publishes) gets weights: the clock starts over."""
        if learner is None or (own is not None and own >= learner):
            self.behind_since = None
            return True
        advanced = own is not None and (self.loaded is None or own > self.loaded)
        if self.behind_since is None or advanced:
            self.behind_since, self.loaded = now, own
        return now - self.behind_since < self.period_s
