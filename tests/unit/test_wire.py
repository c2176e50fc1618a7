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
    ToolCallRecord,
    Trajectory,
    TrajectoryGroup,
    WeightVersion,
    WireError,
    decode,
    encode,
)
from common.protocol.wire_fields import READABLE_VERSIONS


def make_episode(i: int, n_tokens: int, group_id: str, rng) -> Trajectory:
    """An episode of ``n_tokens`` ids (>= 6): an assistant turn sampled at version 3, a tool
    turn of two ids, an assistant turn sampled at version 3 then 4 (an update inside it)."""
    a, b = n_tokens // 3, n_tokens // 3 + 2
    mask = np.ones(n_tokens, dtype=np.uint8)
    mask[a:b] = 0
    versions = np.full(n_tokens, 3, dtype=np.int32)
    versions[a:b] = -1
    versions[b + 1 :] = 4
    logprobs = -rng.random(n_tokens).astype(np.float32) * mask
    return Trajectory(
        sample_id=f"{group_id}/{i}", sample_index=i,
        response_token_ids=rng.integers(0, 50_000, n_tokens).astype(np.uint32),
        behaviour_logprobs=logprobs, loss_mask=mask, token_versions=versions, policy_version=3,
        finish_reason="stop", response_text="the answer is \\boxed{2}",
        turns=[("assistant", 0, a), ("tool", a, b), ("assistant", b, n_tokens)],
        tool_calls=[ToolCallRecord(name="calculator", arguments='{"expression": "1+1"}', ok=True,
                                   seconds=0.01, turn=0)],
        template_mismatch=-1, timings={"generate_s": 0.5},
    )  # fmt: skip


def make_group(n_samples: int = 2, n_tokens: int = 9, group_id: str = "g0") -> TrajectoryGroup:
    rng = np.random.default_rng(0)
    samples = [make_episode(i, n_tokens, group_id, rng) for i in range(n_samples)]
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
        for name in ("response_token_ids", "behaviour_logprobs", "loss_mask", "token_versions"):
            np.testing.assert_array_equal(getattr(sa, name), getattr(sb, name))
        assert sb.behaviour_logprobs.dtype == np.float32
        same = ("version_spans", "timings", "response_text", "turns", "tool_calls",
                "template_mismatch", "policy_version", "finish_reason")  # fmt: skip
        assert [getattr(sa, k) for k in same] == [getattr(sb, k) for k in same]
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
    assert (
        _reason(_mutated(lambda d: d.__setitem__("v", max(READABLE_VERSIONS) + 1))) == "bad_version"
    )
    assert _reason(_mutated(lambda d: d.pop("v"))) == "bad_version"
    assert _reason(_mutated(lambda d: d.__setitem__("kind", "nope"))) == "bad_kind"
    assert _reason(_mutated(lambda d: d.pop("prompt_text"))) == "bad_schema"
    assert _reason(_mutated(lambda d: d.__setitem__("extra", 1))) == "bad_schema"
    assert _reason(_mutated(lambda d: d.__setitem__("cycle", "1"))) == "bad_schema"
    assert _reason(_mutated(lambda d: d.__setitem__("cycle", True))) == "bad_schema"
    assert _reason(_mutated(lambda d: d.__setitem__("split", "test"))) == "bad_value"
    assert _reason(_mutated(lambda d: d.__setitem__("created_at", math.inf))) == "bad_schema"
    nan = np.array([-0.1, np.nan, -0.2, 0, 0, -0.2, -0.1, -0.2, -0.3], dtype=np.float32)
    assert _reason(_set_sample("behaviour_logprobs", wire.pack_array(nan))) == "bad_value"
    positive = np.full(9, 0.5, dtype=np.float32)
    assert _reason(_set_sample("behaviour_logprobs", wire.pack_array(positive))) == "bad_value"
    short = -np.ones(5, dtype=np.float32)
    assert _reason(_set_sample("behaviour_logprobs", wire.pack_array(short))) == "bad_value"
    lying = {"dtype": "<u4", "shape": [9], "data": b"\x00" * 20}
    assert _reason(_set_sample("response_token_ids", lying)) == "bad_schema"
    huge = {"dtype": "<u4", "shape": [1 << 40], "data": b""}
    assert _reason(_set_sample("response_token_ids", huge)) == "oversize"


def _array_of(key: str, values, dtype: str) -> bytes:
    return _set_sample(key, wire.pack_array(np.asarray(values, dtype=dtype)))


def test_episode_fields_are_validated() -> None:
    # make_episode(n=9): assistant [0, 3) v3, tool [3, 5), assistant [5, 9) v3 then v4
    m = [1, 1, 1, 0, 0, 1, 1, 1, 1]
    v = [3, 3, 3, -1, -1, 3, 4, 4, 4]
    assert _reason(_array_of("loss_mask", [2, *m[1:]], "|u1")) == "bad_value"
    assert _reason(_array_of("loss_mask", m, "<i4")) == "bad_schema"
    # a sampled id in the tool turn; a tool id with a version; versions going back
    assert _reason(_array_of("loss_mask", [1, 1, 1, 1, 0, 1, 1, 1, 1], "|u1")) == "bad_value"
    assert _reason(_array_of("token_versions", [3, 3, 3, 3, -1, 3, 4, 4, 4], "<i4")) == "bad_value"
    assert _reason(_array_of("token_versions", [3, 3, 3, -1, -1, 4, 3, 4, 4], "<i4")) == "bad_value"
    assert _reason(_array_of("token_versions", [4, 4, 4, -1, -1, 4, 4, 4, 4], "<i4")) == "bad_value"
    assert v == make_group().samples[0].token_versions.tolist()  # and policy_version 3 = oldest
    logprob_on_tool = np.array([-0.1, -0.1, -0.1, -0.5, 0, -0.1, -0.1, -0.1, -0.1])
    assert _reason(_array_of("behaviour_logprobs", logprob_on_tool, "<f4")) == "bad_value"
    assert _reason(_set_sample("turns", [["assistant", 0, 3], ["tool", 3, 9]])) == "bad_value"
    assert _reason(_set_sample("turns", [["assistant", 0, 3], ["tool", 4, 5]])) == "bad_value"
    assert _reason(_set_sample("turns", [["robot", 0, 9]])) == "bad_schema"
    assert _reason(_set_sample("turns", [["assistant", 0, 5]])) == "bad_value"
    bad_call = {"name": "c", "arguments": "", "ok": True, "error": "", "seconds": 0.0, "turn": 5}
    assert _reason(_set_sample("tool_calls", [bad_call])) == "bad_value"
    assert _reason(_set_sample("tool_calls", [{**bad_call, "turn": 0, "ok": 1}])) == "bad_schema"


def _v1_group() -> dict:
    """A group as a v1 generator wrote it (single-turn, version spans)."""
    rng = np.random.default_rng(1)
    samples = [
        {"sample_id": f"g/{i}", "sample_index": i,
         "response_token_ids": wire.pack_array(rng.integers(0, 99, 6).astype("<u4")),
         "behaviour_logprobs": wire.pack_array(-rng.random(6).astype("<f4")),
         "policy_version": 3, "version_spans": [[0, 3], [4, 5]], "finish_reason": "length",
         "response_text": "\\boxed{2}", "timings": {"generate_s": 0.5}}
        for i in range(2)
    ]  # fmt: skip
    return {"v": 1, "kind": "group", "group_id": "g", "prompt_id": "g", "cycle": 0, "index": 0,
            "split": "train", "prompt_token_ids": wire.pack_array(np.arange(3, dtype="<u4")),
            "prompt_text": "q", "ground_truth": "2", "metadata": {}, "generator_id": "gen-old",
            "samples": samples, "created_at": 1.0}  # fmt: skip


def test_a_v1_message_is_read_as_a_one_turn_episode() -> None:
    group = decode(msgpack.packb(_v1_group(), use_bin_type=True))
    assert isinstance(group, TrajectoryGroup)
    s = group.samples[0]
    assert s.loss_mask.tolist() == [1] * 6 and s.turns == [("assistant", 0, 6)]
    assert s.token_versions.tolist() == [3, 3, 3, 3, 5, 5] and s.policy_version == 3
    assert s.version_spans == [(0, 3), (4, 5)] and s.tool_calls == []
    scored = {"v": 1, "kind": "scored_group", "group": _v1_group(), "rewards": [1.0, 0.0],
              "components": [{}, {}], "reasons": ["", ""], "scorer_id": "s",
              "score_seconds": 0.1}  # fmt: skip
    back = decode(msgpack.packb(scored, use_bin_type=True))
    assert isinstance(back, ScoredGroup) and back.group.samples[1].turns == [("assistant", 0, 6)]
    # re-encoded, it is a v2 message
    assert msgpack.unpackb(encode(back), raw=False)["v"] == wire.SCHEMA_VERSION == 2


def test_v1_spans_are_still_checked_and_v2_fields_refused_in_v1() -> None:
    def v1_with(key, value) -> bytes:
        d = _v1_group()
        d["samples"][0][key] = value
        return msgpack.packb(d, use_bin_type=True)

    assert _reason(v1_with("version_spans", [[0, 3], [9, 4]])) == "bad_value"
    assert _reason(v1_with("version_spans", [[0, 4]])) == "bad_value"
    assert _reason(v1_with("version_spans", [[0, 3], [2, 1]])) == "bad_value"
    assert _reason(v1_with("loss_mask", wire.pack_array(np.ones(6, "|u1")))) == "bad_schema"
    inner_v2 = _v1_group()
    outer = {
        "v": 2,
        "kind": "scored_group",
        "group": inner_v2,
        "rewards": [1.0, 0.0],
        "components": [{}, {}],
        "reasons": ["", ""],
        "scorer_id": "s",
        "score_seconds": 0.1,
    }
    assert _reason(msgpack.packb(outer, use_bin_type=True)) == "bad_version"


def test_versions_this_build_cannot_read_are_dead_lettered_with_the_reason() -> None:
    for v in (0, 4, "2", None):
        d = make_group().to_wire()
        d["v"] = v
        with pytest.raises(WireError) as e:
            decode(msgpack.packb(d, use_bin_type=True))
        assert e.value.reason == "bad_version" and "this build reads (1, 2, 3)" in str(e.value)


def test_a_single_turn_response_is_an_episode_of_one_turn() -> None:
    t = Trajectory.single_turn(sample_id="s", sample_index=0, token_ids=[5, 6, 7],
                               logprobs=[-0.1, -0.2, -0.3], version_spans=[(0, 2), (2, 3)],
                               finish_reason="stop")  # fmt: skip
    assert t.loss_mask.tolist() == [1, 1, 1] and t.token_versions.tolist() == [2, 2, 3]
    assert t.turns == [("assistant", 0, 3)] and t.policy_version == 2


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
_SEED = encode(make_group(n_samples=1, n_tokens=6))


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
