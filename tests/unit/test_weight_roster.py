"""The roster's slow-link rule (``Roster.chain_round``, ``chain_order``, ``measured``), on the
times a chain round reports: which member is behind a slow link, the chain's order after, and
when a slow member comes back."""

from __future__ import annotations

from common.weights.roster import MEASURE_MIN_BYTES, Roster
from common.weights.rounds import Member

BIG = MEASURE_MIN_BYTES


def _roster(*ids: str, fraction: float = 0.25) -> tuple[Roster, dict[str, Member]]:
    r = Roster(slow_fraction=fraction)
    members = {i: Member(i, 1, None, None) for i in ids}
    for m in members.values():
        r.add(m)
    return r, members


def _order(r: Roster, members: dict[str, Member]) -> list[str]:
    return [m.member_id for m in r.chain_order(list(members.values()))]


def test_a_member_far_later_than_the_one_above_it_is_slow_and_the_ones_below_are_not():
    r, ms = _roster("a", "b", "c", "d")
    # b's link is slow: c and d, below it, have the update just after it
    r.chain_round(["a", "b", "c", "d"], [2.0, 20.0, 20.1, 20.2], BIG)
    assert r.slow_ids() == ["b"] and r.is_slow(ms["b"]) and not r.is_slow(ms["c"])
    # c and d were shown fine (b's time is over them); a, the first, was not: it goes after them
    assert _order(r, {k: v for k, v in ms.items() if k != "b"}) == ["c", "d", "a"]


def test_the_first_member_is_moved_down_and_found_the_next_round():
    r, ms = _roster("a", "b", "c")
    r.chain_round(["a", "b", "c"], [20.0, 20.1, 20.2], BIG)  # a slow: everyone has it late
    assert r.slow_ids() == []
    order = _order(r, ms)
    assert order == ["b", "c", "a"]
    r.chain_round(order, [2.0, 2.1, 20.0], BIG)
    assert r.slow_ids() == ["a"]
    # once every link was shown, the order stays as it is (a new order is a new chain epoch)
    r.chain_round(["b", "c"], [2.0, 2.1], BIG)
    assert _order(r, {k: v for k, v in ms.items() if k != "a"}) == ["b", "c"]


def test_times_within_the_fraction_small_updates_and_the_rule_off_find_nothing():
    r, ms = _roster("a", "b")
    r.chain_round(["a", "b"], [2.0, 7.9], BIG)  # under 4 times: not slow
    r.chain_round(["a", "b"], [2.0, 20.0], BIG - 1)  # too small to tell
    assert r.slow_ids() == []
    off, _ = _roster("a", "b", fraction=0.0)
    off.chain_round(["a", "b"], [2.0, 20.0], BIG)
    assert off.slow_ids() == []


def test_a_slow_member_comes_back_when_its_link_keeps_up_with_the_chain():
    r, ms = _roster("a", "b", "c")
    r.chain_round(["a", "b", "c"], [2.0, 2.1, 30.0], BIG)  # the chain: BIG bytes in ~2 s
    assert r.slow_ids() == ["c"]
    r.measured("c", BIG, 20.0)  # its background send: 10 times slower than the chain
    assert r.slow_ids() == ["c"]
    r.measured("c", BIG - 1, 1.0)  # too small to tell
    assert r.slow_ids() == ["c"]
    r.measured("c", BIG, 4.0)  # half the chain's rate: over the fraction
    assert r.slow_ids() == []


def test_a_rejoined_member_keeps_its_judgement():
    r, ms = _roster("a", "b")
    r.chain_round(["a", "b"], [2.0, 30.0], BIG)
    again = Member("b", 2, None, None)  # b restarted and joined again
    r.add(again)
    assert r.is_slow(again)


def test_a_first_member_whose_link_turns_slow_is_moved_down_and_found():
    r, ms = _roster("a", "b", "c")
    r.chain_round(["a", "b", "c"], [2.0, 2.1, 2.2], BIG)  # b and c shown; a first, not shown
    order = _order(r, ms)
    assert order == ["b", "c", "a"]
    r.chain_round(order, [2.0, 2.1, 2.2], BIG)  # a shown too: the order stays
    assert _order(r, ms) == ["b", "c", "a"]
    r.chain_round(["b", "c", "a"], [20.0, 20.1, 20.2], BIG)  # b's link turned slow
    assert r.slow_ids() == []  # nothing above it to judge it against: it goes down
    order = _order(r, ms)
    assert order == ["c", "a", "b"]
    r.chain_round(order, [2.0, 2.1, 20.0], BIG)
    assert r.slow_ids() == ["b"]


def test_a_learner_link_that_turns_slow_moves_one_member_down_once():
    r, ms = _roster("a", "b", "c")
    r.chain_round(["a", "b", "c"], [2.0, 2.1, 2.2], BIG)
    r.chain_round(["b", "c", "a"], [2.0, 2.1, 2.2], BIG)
    r.chain_round(["b", "c", "a"], [20.0, 20.1, 20.2], BIG)  # everyone late: the learner's link
    order = _order(r, ms)
    assert order == ["c", "a", "b"]
    r.chain_round(order, [20.0, 20.1, 20.2], BIG)  # b is fine below a; the rate is now 20 s
    assert r.slow_ids() == [] and _order(r, ms) == ["c", "a", "b"]
    r.chain_round(["c", "a", "b"], [20.0, 20.1, 20.2], BIG)
    assert _order(r, ms) == ["c", "a", "b"]  # no more moves
