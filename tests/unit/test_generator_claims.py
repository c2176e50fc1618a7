"""``services.generator.claims.ClaimKeeper``: a generator keeps its prompts while it has the
learner's version or falls behind it only for a moment (a publish in flight); behind for a
whole period, it is cut off from the weights and lets the claims lapse until it catches up."""

from services.generator.claims import ClaimKeeper


def test_claims_are_kept_while_the_generator_has_the_learners_version():
    k = ClaimKeeper(period_s=10.0)
    assert all(k.keep(t, own=5, learner=5) for t in (0.0, 10.0, 20.0, 30.0))
    assert k.keep(40.0, own=6, learner=5)  # ahead: the learner's key is written after a publish
    assert k.keep(50.0, own=None, learner=None)  # nothing published yet


def test_behind_for_a_whole_period_lets_the_claims_lapse_until_caught_up():
    k = ClaimKeeper(period_s=10.0)
    assert k.keep(0.0, own=5, learner=6)  # a publish in flight: kept
    assert k.keep(9.0, own=5, learner=6)
    assert not k.keep(10.0, own=5, learner=7)  # behind since 0.0 for a whole period: cut off
    assert not k.keep(20.0, own=None, learner=7)  # paused until a whole version loads
    assert k.keep(30.0, own=7, learner=7)  # caught up: kept again, the clock starts over
    assert k.keep(35.0, own=7, learner=8) and k.keep(44.0, own=7, learner=8)
    assert not k.keep(45.0, own=7, learner=8)


def test_a_generator_that_loads_versions_while_behind_is_not_cut_off():
    """Slower than the learner publishes, or catching up version by version: it gets weights,
    so its claims are kept; only a whole period with nothing loaded lets them lapse."""
    k = ClaimKeeper(period_s=10.0)
    assert all(k.keep(t, own=v, learner=v + 2) for t, v in ((0.0, 5), (8.0, 6), (16.0, 7)))
    assert k.keep(24.0, own=7, learner=9)
    assert not k.keep(26.0, own=7, learner=9)  # nothing loaded since 16.0
