"""Routed experts on the wire (``common.protocol.routing``, schema v3): they round-trip in the
smallest type that holds the ids, a message without them is the v2 it was, and a wrong shape,
type, token count or expert id is refused with its reason (the dead-letter stream's)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest

from common.protocol import wire
from common.protocol.routing import RoutingShape
from common.protocol.wire import ScoredGroup, WireError, decode, encode
from services.generator.trajectories import single_turn_trajectories, split_routing, to_group
from tests.unit.test_wire import make_group

SHAPE = RoutingShape(layers=3, top_k=2, experts=8)


def _routing(n: int, shape: RoutingShape = SHAPE, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, shape.experts, (n, shape.layers, shape.top_k))


def routed_group(shape: RoutingShape = SHAPE) -> wire.TrajectoryGroup:
    g = make_group()
    g.routing_shape = shape
    g.prompt_routed_experts = shape.encode(_routing(len(g.prompt_token_ids), shape))
    for i, s in enumerate(g.samples):
        ids = _routing(len(s.response_token_ids), shape, seed=i + 1)
        ids[3:5] = -1  # the tool turn: not run by the engine in this episode
        s.routed_experts = shape.encode(ids)
    return g


def _reason(d: dict) -> str:
    with pytest.raises(WireError) as info:
        decode(msgpack.packb(d, use_bin_type=True))
    return info.value.reason


def test_routing_round_trips_as_v3_in_one_byte_per_id():
    g = routed_group()
    raw = msgpack.unpackb(encode(g), raw=False)
    assert raw["v"] == 3 and raw["routing_shape"] == [3, 2, 8]
    arr = raw["samples"][0]["routed_experts"]
    assert arr["dtype"] == "|u1" and arr["shape"] == [9, 3, 2] and len(arr["data"]) == 9 * 3 * 2
    back = decode(encode(g))
    assert back.routing_shape == SHAPE
    np.testing.assert_array_equal(back.prompt_routed_experts, g.prompt_routed_experts)
    for a, b in zip(g.samples, back.samples, strict=True):
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
    replay = SHAPE.replay(back.samples[0].routed_experts)
    assert replay.dtype == np.int64 and (replay[3:5] == -1).all() and (replay[:3] >= 0).all()
    scored = ScoredGroup(group=g, rewards=[1.0, 0.0], components=[{}, {}], reasons=["", ""],
                         scorer_id="s", score_seconds=0.1)  # fmt: skip
    assert msgpack.unpackb(encode(scored), raw=False)["v"] == 3
    np.testing.assert_array_equal(decode(encode(scored)).group.samples[1].routed_experts,
                                  g.samples[1].routed_experts)  # fmt: skip


def test_many_experts_take_two_bytes_and_no_routing_stays_v2():
    big = RoutingShape(layers=2, top_k=8, experts=512)
    g = routed_group(big)
    arr = msgpack.unpackb(encode(g), raw=False)["samples"][0]["routed_experts"]
    assert arr["dtype"] == "<u2" and len(arr["data"]) == 9 * 2 * 8 * 2
    assert big.replay(decode(encode(g)).samples[0].routed_experts).max() < 512
    plain = make_group()
    raw = msgpack.unpackb(encode(plain), raw=False)
    assert raw["v"] == 2 and "routing_shape" not in raw
    assert "routed_experts" not in raw["samples"][0]


def test_bad_routing_is_refused_with_its_reason():
    good = routed_group().to_wire()

    def mutated(fn) -> dict:
        d = msgpack.unpackb(msgpack.packb(good, use_bin_type=True), raw=False)
        fn(d)
        return d

    def sample_routing(arr: np.ndarray):
        return lambda d: d["samples"][0].__setitem__("routed_experts", wire.pack_array(arr))

    r = SHAPE.encode(_routing(9))
    assert _reason(mutated(sample_routing(r[:8]))) == "bad_value"  # a token short
    assert _reason(mutated(sample_routing(r[:, :2]))) == "bad_value"  # a layer short
    assert _reason(mutated(sample_routing(r.astype("<u2")))) == "bad_schema"  # the wrong type
    assert _reason(mutated(sample_routing(r[:, :, 0]))) == "bad_schema"  # 2-D
    out_of_range = r.copy()
    out_of_range[4, 1, 0] = 8  # expert 8 of 8
    assert _reason(mutated(sample_routing(out_of_range))) == "bad_value"
    assert _reason(mutated(lambda d: d.__setitem__("routing_shape", [3, 9, 8]))) == "bad_value"
    assert _reason(mutated(lambda d: d.__setitem__("routing_shape", "3x2x8"))) == "bad_schema"
    # routing in a v2 message, or a sample's routing without the group's shape
    assert _reason(mutated(lambda d: d.__setitem__("v", 2))) == "bad_schema"
    assert _reason(mutated(lambda d: d.pop("routing_shape"))) == "bad_schema"
    # a sample's own-prompt routing without its own prompt
    own = SHAPE.encode(_routing(4))
    assert _reason(mutated(lambda d: d["samples"][0].__setitem__(
        "prompt_routed_experts", wire.pack_array(own)))) == "bad_schema"  # fmt: skip


def test_a_segments_own_prompt_carries_its_routing():
    g = routed_group()
    s = g.samples[1]
    g.samples[1] = dataclasses.replace(
        s, segment=1, prompt_token_ids=np.arange(5, dtype=np.uint32),
        prompt_routed_experts=SHAPE.encode(_routing(5, seed=9)),
    )  # fmt: skip
    back = decode(encode(g)).samples[1]
    np.testing.assert_array_equal(back.prompt_routed_experts, g.samples[1].prompt_routed_experts)


def test_encoding_refuses_routing_that_does_not_fit_the_shape():
    with pytest.raises(ValueError, match="expected"):
        SHAPE.encode(np.zeros((4, 2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="expert 8 of 8"):
        SHAPE.encode(np.full((4, 3, 2), 8))


def test_the_generator_splits_the_engines_routing_into_prompt_and_response():
    engine = _routing(4 + 5)  # a prompt of 4 ids, a response of 6: the last one never ran
    prompt, resp = split_routing(SHAPE, engine, 4, 6)
    np.testing.assert_array_equal(prompt, engine[:4])
    np.testing.assert_array_equal(resp[:5], engine[4:])
    assert (resp[5] == SHAPE.not_recorded).all()
    assert split_routing(None, engine, 4, 6) == (None, None)
    assert split_routing(SHAPE, None, 4, 6) == (None, None)
    msg = wire.PromptMsg(prompt_id="p0", cycle=0, index=0, split="train", text="q",
                         ground_truth="1", metadata={}, created_at=0.0)  # fmt: skip
    sample = SimpleNamespace(token_ids=[1, 2, 3, 4, 5, 6], logprobs=[-0.1] * 6, weight_versions=[],
                             finish_reason="stop", text="a", seconds=0.1, routed_experts=engine)  # fmt: skip
    trajs = single_turn_trajectories(msg, [sample], started=0.0, version=0, prompt_len=4,
                                     routing=SHAPE)  # fmt: skip
    g = to_group(msg, [7, 8, 9, 10], trajs, generator_id="g", routing=SHAPE, prompt_routing=prompt)
    back = decode(encode(g))
    np.testing.assert_array_equal(SHAPE.replay(back.prompt_routed_experts), engine[:4])
    np.testing.assert_array_equal(SHAPE.replay(back.samples[0].routed_experts)[:5], engine[4:])
