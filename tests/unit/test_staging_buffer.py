"""``StagingBuffer``: the buffers a weight receiver stages units in (``common.weights.transfer``).

A receiver that only loads stages every unit in one buffer; a chain member that relays stages in
two, so the next unit arrives in one while the relay still sends the previous one from the
other (a relay's views are what holds a buffer here, as the queued tensors of ``Forwarder`` do).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from common.weights.transfer import StagingBuffer  # noqa: E402

MB = 1 << 20


def test_a_loading_receiver_stages_every_unit_in_one_buffer():
    staging = StagingBuffer("cpu")
    for _ in range(16):
        unit = staging.take(MB, reserve=2 * MB)
        unit.fill_(1)
        del unit  # the loader let go of the unit before the next
    assert staging.allocations == 1


def test_a_relay_stages_in_two_buffers_and_never_waits_on_the_unit_it_still_sends():
    staging = StagingBuffer("cpu")
    relayed = None  # the views the relay still sends: the previous unit's
    buffers = set()
    for k in range(16):
        unit = staging.take(MB, reserve=MB, slots=2)
        assert relayed is None or unit.data_ptr() != relayed.data_ptr()
        unit.fill_(k)
        buffers.add(unit.data_ptr())
        relayed = unit[: MB // 2]  # passed on while the next unit arrives
        del unit
    assert staging.allocations == 2 and len(buffers) == 2


def test_with_every_slot_held_a_unit_goes_to_a_buffer_of_its_own():
    staging = StagingBuffer("cpu")
    kept = [staging.take(MB)]  # an update collected whole keeps its units
    kept.append(staging.take(MB))
    assert kept[0].data_ptr() != kept[1].data_ptr() and staging.allocations == 2
    first = kept[0].data_ptr()
    kept.clear()
    assert staging.take(MB).data_ptr() == first and staging.allocations == 2  # reused


def test_a_relay_round_then_a_loading_round_lets_go_of_the_second_buffer():
    staging = StagingBuffer("cpu")
    first = staging.take(MB, slots=2)
    second = staging.take(MB, slots=2)
    del first, second
    assert len(staging._bufs) == 2
    staging.take(MB)
    assert len(staging._bufs) == 1
