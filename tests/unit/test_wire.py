"""Wire schema: round-trips, every rejection reason, and a hypothesis fuzz of the decoder."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.protocol import wire
from common.protocol.wire import (
    PromptMsg,
    ScoredGroup,
    Trajectory,
    TrajectoryGroup,
    WeightVersion,
    WireError,
    decode,
    encode,
)


def make_group(n_samples: int = 2, n_tokens: int = 6, group_id: str = "g0") -> TrajectoryGroup:
    rng = np.random.default_rng(0)
    samples = [
        Trajectory(
            sample_id=f"{group_id}/{i}",
            sample_index=i,
            response_token_ids=rng.integers(0, 50_000, n_tokens).astype(np.uint32),
            behaviour_logprobs=-rng.random(n_tokens).astype(np.float32),
            policy_version=3,
            version_spans=[(0, 3), (n_tokens // 2, 4)],
            finish_reason="stop",
            response_text="the answer is \\boxed{2}",
            timings={"generate_s": 0.5},
        )
        for i in range(n_samples)
    ]
    return TrajectoryGroup(
        group_id=group_id, prompt_id="p0", cycle=1, index=7, split="train",
        prompt_token_ids=np.arange(10, dtype=np.uint32), prompt_text="1+1?", ground_truth="2",
        metadata={"source": "gsm8k", "level": 3, "hard": False, "w": 0.5, "none": None},
        generator_id="gen-0", samples=samples, created_at=123.5,
    )  # fmt: skip


def assert_groups_equal(a: TrajectoryGroup, b: TrajectoryGroup) -> None:
    np.testing.assert_array_equal(a.prompt_token_ids, b.prompt_token_ids)
    assert b.prompt_token_ids.dtype == np.uint32
    for sa, sb in zip(a.samples, b.samples, strict=True):
        np.testing.assert_array_equal(sa.response_token_ids, sb.response_token_ids)
        np.testing.assert_array_equal(sa.behaviour_logprobs, sb.behaviour_logprobs)
        assert sb.behaviour_logprobs.dtype == np.float32
        assert (sa.version_spans, sa.timings, sa.response_text) == (
            sb.version_spans,
            sb.timings,
            sb.response_text,
        )
    same = ("group_id", "prompt_id", "cycle", "index", "split", "prompt_text", "ground_truth")
    assert all(getattr(a, k) == getattr(b, k) for k in same)
    assert (a.metadata, a.generator_id, a.created_at) == (b.metadata, b.generator_id, b.created_at)


def test_round_trip_every_kind() -> None:
    prompt = PromptMsg(
        prompt_id="p0", cycle=2, index=5, split="eval", messages=[{"role": "user", "content": "hi"}],
        ground_truth="4", metadata={"k": 1}, min_policy_version=7, created_at=1.0,
    )  # fmt: skip
    assert decode(encode(prompt)) == prompt
    weights = WeightVersion(
        version=3, step=12, num_bytes=1 << 20, checksum="ab12", published_at=2.0
    )
    assert decode(encode(weights)) == weights
    group = make_group()
    assert_groups_equal(group, decode(encode(group)))
    scored = ScoredGroup(
        group, [1.0, 0.0], [{"acc": 1.0}, {"acc": 0.0}], ["", "timeout"], "s0", 0.25
    )
    back = decode(encode(scored))
    assert isinstance(back, ScoredGroup)
    assert (back.rewards, back.components, back.reasons) == (
        scored.rewards,
        scored.components,
        scored.reasons,
    )
    assert_groups_equal(group, back.group)


def test_token_ids_travel_as_packed_arrays() -> None:
    raw = msgpack.unpackb(encode(make_group(n_tokens=100)), raw=False)
    ids = raw["samples"][0]["response_token_ids"]
    assert ids["dtype"] == "<u4" and ids["shape"] == [100] and len(ids["data"]) == 400
    assert raw["v"] == wire.SCHEMA_VERSION and raw["kind"] == "group"


def test_int32_token_ids_are_accepted_and_negative_ones_refused() -> None:
    d = make_group().to_wire()
    d["prompt_token_ids"] = wire.pack_array(np.arange(4, dtype="<i4"))
    assert decode(msgpack.packb(d)).prompt_token_ids.dtype == np.uint32
    d["prompt_token_ids"] = wire.pack_array(np.array([1, -1], dtype="<i4"))
    assert _reason(msgpack.packb(d)) == "bad_value"


def _reason(data: bytes, **kw: int) -> str:
    with pytest.raises(WireError) as info:
        decode(data, **kw)
    return info.value.reason


def _mutated(mutate) -> bytes:
    d = make_group().to_wire()
    mutate(d)
    return msgpack.packb(d, use_bin_type=True)


def _set_sample(key: str, value) -> bytes:
    return _mutated(lambda d: d["samples"][0].__setitem__(key, value))


def test_every_rejection_reason() -> None:
    good = encode(make_group())
    assert _reason(good, max_bytes=len(good) - 1) == "oversize"
    assert _reason(b"\xc1\x00") == "undecodable"
    assert _reason(good[: len(good) // 2]) == "undecodable"
    assert _reason(msgpack.packb(msgpack.ExtType(5, b"x"))) == "undecodable"
    assert _reason(msgpack.packb([1, 2])) == "bad_schema"
    assert _reason(_mutated(lambda d: d.__setitem__("v", 2))) == "bad_version"
    assert _reason(_mutated(lambda d: d.pop("v"))) == "bad_version"
    assert _reason(_mutated(lambda d: d.__setitem__("kind", "nope"))) == "bad_kind"
    assert _reason(_mutated(lambda d: d.pop("prompt_text"))) == "bad_schema"
    assert _reason(_mutated(lambda d: d.__setitem__("extra", 1))) == "bad_schema"
    assert _reason(_mutated(lambda d: d.__setitem__("cycle", "1"))) == "bad_schema"
    assert _reason(_mutated(lambda d: d.__setitem__("cycle", True))) == "bad_schema"
    assert _reason(_mutated(lambda d: d.__setitem__("split", "test"))) == "bad_value"
    assert _reason(_mutated(lambda d: d.__setitem__("created_at", math.inf))) == "bad_schema"
    nan = np.array([-0.1, np.nan, -0.2, -0.3, -0.1, -0.2], dtype=np.float32)
    assert _reason(_set_sample("behaviour_logprobs", wire.pack_array(nan))) == "bad_value"
    positive = np.full(6, 0.5, dtype=np.float32)
    assert _reason(_set_sample("behaviour_logprobs", wire.pack_array(positive))) == "bad_value"
    short = -np.ones(5, dtype=np.float32)
    assert _reason(_set_sample("behaviour_logprobs", wire.pack_array(short))) == "bad_value"
    lying = {"dtype": "<u4", "shape": [6], "data": b"\x00" * 20}
    assert _reason(_set_sample("response_token_ids", lying)) == "bad_schema"
    huge = {"dtype": "<u4", "shape": [1 << 40], "data": b""}
    assert _reason(_set_sample("response_token_ids", huge)) == "oversize"
    assert _reason(_set_sample("version_spans", [[0, 3], [9, 4]])) == "bad_value"
    assert _reason(_set_sample("version_spans", [[0, 4]])) == "bad_value"
    assert _reason(_set_sample("version_spans", [[0, 3], [2, 1]])) == "bad_value"


def test_scored_group_needs_one_reward_per_sample() -> None:
    d = ScoredGroup(make_group(), [1.0, 0.0], [{}, {}], ["", ""], "s", 0.1).to_wire()
    d["rewards"] = [1.0]
    assert _reason(msgpack.packb(d, use_bin_type=True)) == "bad_value"
    d["rewards"] = [1.0, math.nan]
    assert _reason(msgpack.packb(d, use_bin_type=True)) == "bad_schema"


def test_prompt_needs_text_or_messages() -> None:
    d = PromptMsg(prompt_id="p", cycle=0, index=0, text="x").to_wire()
    d["text"] = None
    assert _reason(msgpack.packb(d)) == "bad_value"


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_SEED = encode(make_group(n_samples=1, n_tokens=4))


def _decode_or_wire_error(data: bytes) -> None:
    try:
        decode(data, max_bytes=1 << 20)
    except WireError as e:
        assert e.reason in wire.ERROR_REASONS


@FUZZ
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes_raise_only_wire_error(data: bytes) -> None:
    _decode_or_wire_error(data)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(_SEED) - 1), st.integers(0, 255)), max_size=8),
       st.integers(0, len(_SEED)))  # fmt: skip
def test_fuzz_mutated_valid_message_raises_only_wire_error(flips, cut: int) -> None:
    data = bytearray(_SEED)
    for pos, value in flips:
        data[pos] = value
    _decode_or_wire_error(bytes(data[:cut]) if cut < len(data) else bytes(data))


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


_GROUP_KEYS = sorted(make_group().to_wire())
_SAMPLE_KEYS = sorted(make_group().samples[0].to_wire())
_target = st.tuples(st.just(False), st.sampled_from(_GROUP_KEYS)) | st.tuples(
    st.just(True), st.sampled_from(_SAMPLE_KEYS)
)


@FUZZ
@given(_target, _values)
def test_fuzz_structured_field_replacement(target, value) -> None:
    in_sample, key = target
    d = make_group().to_wire()
    (d["samples"][0] if in_sample else d)[key] = value
    _decode_or_wire_error(msgpack.packb(d, use_bin_type=True))
