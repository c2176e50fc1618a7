"""The run's books: what becomes of every generated response, as one versioned record.

Written by the learner (rank 0): ``LearnerBooks`` is its count of the responses it received, in
its heartbeat (``books``) and in its checkpoints, so the count goes on across restarts. Read by
``tether status``, which adds the generators' run-long counts and the dead letters
(``RunBooks``, its ``accounting``), and by the report, which balances them (``generated =
trained + dropped + filtered + ... + in flight``). One set of names from the learner to the
report: a reader takes the record whole or refuses it (``BooksError``), never a renamed or
older key.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

BOOKS_VERSION = 1


class BooksError(ValueError):
    """A books record of another version, or with missing or unknown counts."""


@dataclass
class LearnerBooks:
    """The learner's counts, in responses (samples) unless named otherwise."""

    trained_samples: int = 0  # once per pass over a cycle's data
    dropped_stale_samples: int = 0  # older than max_staleness when their step came
    filtered_samples: int = 0  # groups of equal rewards (no learning signal)
    overlong_masked_samples: int = 0  # cut off at max_response_tokens (learner.overlong_filter)
    refused_template_samples: int = 0  # re-render mismatches refused (template_check = strict)
    surplus_samples: int = 0  # dynamic sampling: informative groups beyond prompts_per_cycle
    segment_samples: int = 0  # agents' episodes: segments beyond an episode's first
    agent_failed_samples: int = 0  # episodes whose agent code failed or timed out
    episode_tool_calls: int = 0  # tool calls in the episodes received (each counted once)

    def add(self, **counts: int) -> None:
        """Add ``counts`` (names of this record's fields)."""
        for name, n in counts.items():
            if name not in _LEARNER_FIELDS:
                raise BooksError(f"the learner's books have no count {name!r}")
            setattr(self, name, getattr(self, name) + int(n))

    def to_dict(self) -> dict[str, int]:
        return {"version": BOOKS_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> LearnerBooks:
        return cls(**_checked(doc, _LEARNER_FIELDS, "the learner's books"))


_LEARNER_FIELDS = tuple(f.name for f in fields(LearnerBooks))


@dataclass
class RunBooks:
    """A run's books as ``tether status`` reads them: the learner's counts, the generators'
    run-long counts of groups (from Redis, so they survive a generator's restart; held-out
    groups counted apart), and the dead letters (those that are generated groups apart)."""

    groups_generated: int = 0
    eval_groups_generated: int = 0
    dead_letters: int = 0
    dead_letter_groups: int = 0
    learner: LearnerBooks = field(default_factory=LearnerBooks)

    def to_dict(self) -> dict[str, int]:
        """Flat: the run's counts and the learner's under their own names."""
        own = {k: v for k, v in asdict(self).items() if k != "learner"}
        return {"version": BOOKS_VERSION, **own, **asdict(self.learner)}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RunBooks:
        counts = _checked(doc, _RUN_FIELDS + _LEARNER_FIELDS, "the run's books")
        learner = LearnerBooks(**{k: counts.pop(k) for k in _LEARNER_FIELDS})
        return cls(**counts, learner=learner)


_RUN_FIELDS = tuple(f.name for f in fields(RunBooks) if f.name != "learner")


def _checked(doc: dict[str, Any], names: tuple[str, ...], what: str) -> dict[str, int]:
    if doc.get("version") != BOOKS_VERSION:
        raise BooksError(
            f"{what}: version {doc.get('version')!r}, this Tether reads version {BOOKS_VERSION}; "
            "read the run with the Tether that wrote it"
        )
    counts = {k: v for k, v in doc.items() if k != "version"}
    missing, unknown = sorted(set(names) - set(counts)), sorted(set(counts) - set(names))
    if missing or unknown:
        raise BooksError(f"{what}: missing counts {missing}, unknown counts {unknown}")
    return {k: int(v) for k, v in counts.items()}
