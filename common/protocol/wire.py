"""Versioned msgpack wire schema for everything that travels over the trajectory bus.

Every message is a msgpack map with ``v`` (schema version) and ``kind``. Token ids and
log-probs travel as packed little-endian arrays ``{"dtype", "shape", "data"}``, never as lists of
Python ints. ``decode`` treats its input as untrusted: it caps the size before unpacking, caps
msgpack lengths, rejects ext types, validates every field, and raises only ``WireError``.
Arrays returned by ``decode`` are read-only views into the message bytes (``.copy()`` to modify).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

from common.protocol.wire_arrays import (  # noqa: F401  (part of this module's interface)
    ERROR_REASONS,
    MAX_ARRAY_ELEMS,
    WireError,
    _is_int,
    pack_array,
    unpack_array,
)

SCHEMA_VERSION = 1
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
LOGPROB_EPS = 1e-3  # float32 rounding of log(p) for p ~ 1 can land slightly above 0
_SPLITS = ("train", "eval")


# ----------------------------------------------------------------------------- validation


def _is_str(x: Any) -> bool:
    return isinstance(x, str)


def _number(x: Any) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


def _scalar(x: Any) -> bool:
    return x is None or isinstance(x, (str, int, float, bool))


def _anything(x: Any) -> bool:
    return True


def _list_of(pred: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, list) and all(map(pred, x))


def _map_of(pred: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, dict) and all(_is_str(k) and pred(v) for k, v in x.items())


def _pair(x: Any) -> bool:
    return isinstance(x, list) and len(x) == 2 and all(map(_is_int, x))


def _check(ok: bool, reason: str, detail: str) -> None:
    if not ok:
        raise WireError(reason, detail)


@functools.cache
def _allowed_keys(cls: Any, head: bool) -> frozenset[str]:
    return frozenset(cls.__dataclass_fields__) | ({"v", "kind"} if head else frozenset())


class _Fields:
    """Typed access to one decoded map; every problem becomes a WireError naming the field."""

    def __init__(self, d: Any, where: str, cls: type, head: bool = True) -> None:
        _check(isinstance(d, dict), "bad_schema", f"{where} must be a map")
        if head:
            v = d.get("v")
            _check(_is_int(v) and v == SCHEMA_VERSION, "bad_version", f"{where}: v={v!r}")
            _check(d.get("kind") == where, "bad_kind", f"kind={d.get('kind')!r}, want {where!r}")
        extra = d.keys() - _allowed_keys(cls, head)
        _check(not extra, "bad_schema", f"{where} has unknown fields {sorted(map(str, extra))}")
        self.d, self.where = d, where

    def get(self, name: str, check=_anything, what: str = "", optional: bool = False) -> Any:
        if name not in self.d:
            _check(optional, "bad_schema", f"{self.where}.{name} is missing")
            return None
        value = self.d[name]
        if value is None and optional:
            return None
        _check(check(value), "bad_schema", f"{self.where}.{name} must be {what}")
        return value

    def nat(self, name: str) -> int:
        value = self.get(name, _is_int, "an int")
        _check(value >= 0, "bad_value", f"{self.where}.{name}={value} is negative")
        return value

    def num(self, name: str) -> float:
        return float(self.get(name, _number, "a finite number"))

    def text(self, name: str, optional: bool = False) -> Any:
        return self.get(name, _is_str, "a string", optional)

    def split(self) -> str:
        value = self.text("split")
        _check(value in _SPLITS, "bad_value", f"{self.where}.split={value!r} not in {_SPLITS}")
        return value

    def metadata(self) -> dict[str, Any]:
        return dict(self.get("metadata", _map_of(_scalar), "a map of str to scalars"))


def _token_ids(obj: Any, where: str) -> np.ndarray:
    arr = unpack_array(obj)
    _check(arr.ndim == 1, "bad_schema", f"{where} must be 1-D")
    _check(arr.dtype.str in ("<u4", "<i4"), "bad_schema", f"{where} must be <u4 or <i4")
    if arr.dtype.str == "<i4":
        _check(bool((arr >= 0).all()), "bad_value", f"{where} has negative token ids")
        arr = arr.view("<u4")
    return arr


def _logprobs(obj: Any, n_tokens: int) -> np.ndarray:
    lp = unpack_array(obj)
    _check(lp.dtype.str == "<f4" and lp.ndim == 1, "bad_schema", "logprobs must be 1-D <f4")
    _check(len(lp) == n_tokens, "bad_value", f"{n_tokens} tokens but {len(lp)} log-probs")
    _check(bool(np.isfinite(lp).all()), "bad_value", "behaviour_logprobs has NaN/inf")
    _check(bool((lp <= LOGPROB_EPS).all()), "bad_value", "behaviour_logprobs has values > 0")
    return lp


def _spans(spans: list, version: int, n_tokens: int) -> list[tuple[int, int]]:
    ok = bool(spans) and spans[0] == [0, version]
    _check(ok, "bad_value", "version_spans must start with [0, policy_version]")
    for (i0, v0), (i1, v1) in zip(spans, spans[1:], strict=False):
        ok = i0 < i1 <= n_tokens and v0 <= v1
        _check(ok, "bad_value", "version_spans need increasing indices, non-decreasing versions")
    return [(i, v) for i, v in spans]


# ----------------------------------------------------------------------------- messages


class _Msg:
    kind: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "kind": self.kind, **self.__dict__}


@dataclass
class PromptMsg(_Msg):
    """A prompt handed to generators. ``index`` is the sampler position (for resume)."""

    kind: ClassVar[str] = "prompt"
    prompt_id: str
    cycle: int
    index: int
    split: str = "train"
    text: str | None = None
    messages: list[dict[str, str]] | None = None
    ground_truth: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    min_policy_version: int = 0  # a generator must run weights >= this before sampling it
    created_at: float = field(default_factory=time.time)

    @classmethod
    def from_wire(cls, d: Any) -> PromptMsg:
        f = _Fields(d, cls.kind, cls)
        chat = f.get("messages", _list_of(_map_of(_is_str)), "a list of {str: str}", True)
        text = f.text("text", optional=True)
        _check(text is not None or chat is not None, "bad_value", "prompt needs text or messages")
        return cls(
            prompt_id=f.text("prompt_id"), cycle=f.nat("cycle"), index=f.nat("index"),
            split=f.split(), text=text, messages=chat,
            ground_truth=f.text("ground_truth", optional=True), metadata=f.metadata(),
            min_policy_version=f.nat("min_policy_version"), created_at=f.num("created_at"),
        )  # fmt: skip


@dataclass
class Trajectory:
    """One sampled response. ``version_spans`` lists (first token index, policy version)."""

    sample_id: str
    sample_index: int
    response_token_ids: np.ndarray  # uint32
    behaviour_logprobs: np.ndarray  # float32, same length
    policy_version: int  # version at the first token
    version_spans: list[tuple[int, int]]
    finish_reason: str
    response_text: str = ""
    timings: dict[str, float] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["response_token_ids"] = pack_array(np.asarray(self.response_token_ids, dtype="<u4"))
        d["behaviour_logprobs"] = pack_array(np.asarray(self.behaviour_logprobs, dtype="<f4"))
        d["version_spans"] = [[int(i), int(v)] for i, v in self.version_spans]
        return d

    @classmethod
    def from_wire(cls, d: Any) -> Trajectory:
        f = _Fields(d, "sample", cls, head=False)
        ids = _token_ids(f.get("response_token_ids"), "response_token_ids")
        version = f.nat("policy_version")
        spans = f.get("version_spans", _list_of(_pair), "a list of [index, version] pairs")
        return cls(
            sample_id=f.text("sample_id"), sample_index=f.nat("sample_index"),
            response_token_ids=ids, behaviour_logprobs=_logprobs(f.get("behaviour_logprobs"), len(ids)),
            policy_version=version, version_spans=_spans(spans, version, len(ids)),
            finish_reason=f.text("finish_reason"), response_text=f.text("response_text"),
            timings=f.get("timings", _map_of(_number), "a map of str to numbers"),
        )  # fmt: skip


@dataclass
class TrajectoryGroup(_Msg):
    """All responses a generator sampled for one prompt (a GRPO group)."""

    kind: ClassVar[str] = "group"
    group_id: str
    prompt_id: str
    cycle: int
    index: int
    split: str
    prompt_token_ids: np.ndarray  # uint32
    prompt_text: str
    ground_truth: str | None
    metadata: dict[str, Any]
    generator_id: str
    samples: list[Trajectory]
    created_at: float = field(default_factory=time.time)

    def to_wire(self) -> dict[str, Any]:
        d = super().to_wire()
        d["prompt_token_ids"] = pack_array(np.asarray(self.prompt_token_ids, dtype="<u4"))
        d["samples"] = [s.to_wire() for s in self.samples]
        return d

    @classmethod
    def from_wire(cls, d: Any) -> TrajectoryGroup:
        f = _Fields(d, cls.kind, cls)
        samples = f.get("samples", _list_of(_anything), "a list")
        return cls(
            group_id=f.text("group_id"), prompt_id=f.text("prompt_id"), cycle=f.nat("cycle"),
            index=f.nat("index"), split=f.split(),
            prompt_token_ids=_token_ids(f.get("prompt_token_ids"), "prompt_token_ids"),
            prompt_text=f.text("prompt_text"), ground_truth=f.text("ground_truth", optional=True),
            metadata=f.metadata(), generator_id=f.text("generator_id"),
            samples=[Trajectory.from_wire(s) for s in samples], created_at=f.num("created_at"),
        )  # fmt: skip


@dataclass
class ScoredGroup(_Msg):
    """A group with one reward per sample; ``reasons[i]`` is "" when scoring went fine."""

    kind: ClassVar[str] = "scored_group"
    group: TrajectoryGroup
    rewards: list[float]
    components: list[dict[str, float]]
    reasons: list[str]
    scorer_id: str
    score_seconds: float

    def to_wire(self) -> dict[str, Any]:
        return {**super().to_wire(), "group": self.group.to_wire()}

    @classmethod
    def from_wire(cls, d: Any) -> ScoredGroup:
        f = _Fields(d, cls.kind, cls)
        group = TrajectoryGroup.from_wire(f.get("group"))
        rewards = f.get("rewards", _list_of(_number), "a list of finite numbers")
        comps = f.get("components", _list_of(_map_of(_number)), "a list of {str: number}")
        reasons = f.get("reasons", _list_of(_is_str), "a list of strings")
        n = len(group.samples)
        ok = len(rewards) == len(comps) == len(reasons) == n
        _check(ok, "bad_value", f"rewards/components/reasons need one entry per sample ({n})")
        return cls(
            group=group, rewards=[float(r) for r in rewards],
            components=[{k: float(v) for k, v in c.items()} for c in comps], reasons=reasons,
            scorer_id=f.text("scorer_id"), score_seconds=f.num("score_seconds"),
        )  # fmt: skip


@dataclass
class WeightVersion(_Msg):
    """Announcement that the learner published policy ``version`` after optimizer ``step``."""

    kind: ClassVar[str] = "weights"
    version: int
    step: int
    num_bytes: int
    checksum: str
    published_at: float = field(default_factory=time.time)

    @classmethod
    def from_wire(cls, d: Any) -> WeightVersion:
        f = _Fields(d, cls.kind, cls)
        return cls(
            version=f.nat("version"), step=f.nat("step"), num_bytes=f.nat("num_bytes"),
            checksum=f.text("checksum"), published_at=f.num("published_at"),
        )  # fmt: skip


Message = PromptMsg | TrajectoryGroup | ScoredGroup | WeightVersion
MESSAGE_TYPES: dict[str, type] = {
    c.kind: c for c in (PromptMsg, TrajectoryGroup, ScoredGroup, WeightVersion)
}


def encode(msg: Message) -> bytes:
    """Serialise a message to msgpack bytes."""
    if type(msg) not in MESSAGE_TYPES.values():
        raise ValueError(f"encode: {type(msg).__name__} is not a wire message type")
    return msgpack.packb(msg.to_wire(), use_bin_type=True)


def _reject_ext(code: int, data: bytes) -> Any:
    raise WireError("undecodable", f"msgpack ext type {code} is not allowed")


def decode(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Message:
    """Decode untrusted bytes into a message. Raises only ``WireError``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError("undecodable", f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise WireError("oversize", f"{len(data)} bytes exceeds max_bytes={max_bytes}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_reject_ext,
            use_list=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=1 << 20,
            max_map_len=1 << 16,
            max_ext_len=0,
        )
    except WireError:
        raise
    except Exception as e:  # msgpack raises many types (ValueError, StackError, UnicodeError...)
        raise WireError("undecodable", f"{type(e).__name__}: {e}"[:300]) from None
    if not isinstance(obj, dict):
        raise WireError("bad_schema", f"message must be a map, got {type(obj).__name__}")
    v = obj.get("v")
    if not _is_int(v) or v != SCHEMA_VERSION:
        raise WireError("bad_version", f"schema version {v!r}; this build reads {SCHEMA_VERSION}")
    kind = obj.get("kind")
    cls: Any = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError("bad_kind", f"unknown kind {str(obj.get('kind'))[:50]!r}")
    try:
        return cls.from_wire(obj)
    except WireError:
        raise
    except Exception as e:  # a validation gap must still not escape as a random exception
        raise WireError("bad_schema", f"{type(e).__name__}: {e}"[:300]) from None
