"""Versioned msgpack wire schema for everything that travels over the trajectory bus.

Every message is a msgpack map with ``v`` (schema version) and ``kind``. Token ids and
log-probs travel as packed little-endian arrays ``{"dtype", "shape", "data"}``, never as lists of
Python ints. ``decode`` treats its input as untrusted: it caps the size before unpacking, caps
msgpack lengths, rejects ext types, validates every field, and raises only ``WireError``.
Arrays returned by ``decode`` are read-only views into the message bytes (``.copy()`` to modify).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

from common.protocol.routing import ROUTING_VERSION, RoutingShape
from common.protocol.trajectory import ToolCallRecord, Trajectory
from common.protocol.wire_arrays import ERROR_REASONS, WireError, _is_int, pack_array
from common.protocol.wire_fields import (
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    _anything,
    _check,
    _Fields,
    _is_str,
    _list_of,
    _map_of,
    _number,
    _token_ids,
)

__all__ = [
    "ERROR_REASONS", "SCHEMA_VERSION", "Message", "PromptMsg", "ScoredGroup", "ToolCallRecord",
    "Trajectory", "TrajectoryGroup", "WeightVersion", "WireError", "decode", "encode",
    "pack_array",
]  # fmt: skip
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


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
    # routing replay (schema v3, common.protocol.routing); absent from a v2 message
    routing_shape: RoutingShape | None = None
    prompt_routed_experts: np.ndarray | None = None  # [len(prompt_token_ids), L, K]

    @property
    def wire_version(self) -> int:
        return ROUTING_VERSION if self.routing_shape is not None else SCHEMA_VERSION

    def to_wire(self) -> dict[str, Any]:
        d = super().to_wire()
        d["v"] = self.wire_version
        d["prompt_token_ids"] = pack_array(np.asarray(self.prompt_token_ids, dtype="<u4"))
        d["samples"] = [s.to_wire() for s in self.samples]
        for name in ("routing_shape", "prompt_routed_experts"):
            if d[name] is None:
                del d[name]
        if self.routing_shape is not None:
            d["routing_shape"] = self.routing_shape.to_wire()
        if self.prompt_routed_experts is not None:
            d["prompt_routed_experts"] = pack_array(self.prompt_routed_experts)
        return d

    @classmethod
    def from_wire(cls, d: Any, version: int | None = None) -> TrajectoryGroup:
        f = _Fields(d, cls.kind, cls)
        _check(version in (None, f.version), "bad_version", f"group v{f.version} in v{version}")
        samples = f.get("samples", _list_of(_anything), "a list")
        raw_shape = f.get("routing_shape", optional=True)
        ok = raw_shape is None or f.version >= ROUTING_VERSION
        _check(ok, "bad_schema", f"group.routing_shape needs schema v{ROUTING_VERSION}")
        routing = None if raw_shape is None else RoutingShape.from_wire(raw_shape)
        prompt = _token_ids(f.get("prompt_token_ids"), "prompt_token_ids")
        raw = f.get("prompt_routed_experts", optional=True)
        _check(raw is None or routing is not None, "bad_schema",
               "group.prompt_routed_experts without a routing_shape")  # fmt: skip
        return cls(
            group_id=f.text("group_id"), prompt_id=f.text("prompt_id"), cycle=f.nat("cycle"),
            index=f.nat("index"), split=f.split(), prompt_token_ids=prompt,
            prompt_text=f.text("prompt_text"), ground_truth=f.text("ground_truth", optional=True),
            metadata=f.metadata(), generator_id=f.text("generator_id"),
            samples=[Trajectory.from_wire(s, version=f.version, routing=routing) for s in samples],
            created_at=f.num("created_at"), routing_shape=routing,
            prompt_routed_experts=None if raw is None else routing.unpack(  # type: ignore[union-attr]
                raw, len(prompt), "group.prompt_routed_experts"),
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
        return {**super().to_wire(), "v": self.group.wire_version, "group": self.group.to_wire()}

    @classmethod
    def from_wire(cls, d: Any) -> ScoredGroup:
        f = _Fields(d, cls.kind, cls)
        group = TrajectoryGroup.from_wire(f.get("group"), version=f.version)
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
    if not _is_int(v) or v not in READABLE_VERSIONS:
        raise WireError(
            "bad_version", f"schema version {v!r}; this build reads {READABLE_VERSIONS}"
        )
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
