"""``common.protocol.books``: the run's books are read whole, in their version, or refused."""

from __future__ import annotations

import pytest

from common.protocol.books import BOOKS_VERSION, BooksError, LearnerBooks, RunBooks


def test_the_books_go_through_a_dict_unchanged() -> None:
    lb = LearnerBooks()
    lb.add(trained_samples=96, dropped_stale_samples=4, episode_tool_calls=7)
    lb.add(trained_samples=32)
    assert LearnerBooks.from_dict(lb.to_dict()) == lb and lb.trained_samples == 128
    run = RunBooks(groups_generated=40, eval_groups_generated=8, dead_letters=2,
                   dead_letter_groups=1, learner=lb)  # fmt: skip
    doc = run.to_dict()
    assert doc["version"] == BOOKS_VERSION and doc["dropped_stale_samples"] == 4  # flat
    assert RunBooks.from_dict(doc) == run


def test_a_renamed_missing_or_older_count_is_refused() -> None:
    doc = LearnerBooks(dropped_stale_samples=1).to_dict()
    old = {k if k != "dropped_stale_samples" else "dropped_stale": v for k, v in doc.items()}
    with pytest.raises(BooksError, match=r"missing counts \['dropped_stale_samples'\], unknown "
                       r"counts \['dropped_stale'\]"):  # fmt: skip
        LearnerBooks.from_dict(old)
    with pytest.raises(BooksError, match="version None"):
        LearnerBooks.from_dict({k: v for k, v in doc.items() if k != "version"})
    with pytest.raises(BooksError, match="no count 'dropped_stale'"):
        LearnerBooks().add(dropped_stale=1)
