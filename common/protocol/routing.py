"""Routed experts on the wire (schema v3): for a mixture-of-experts policy with routing replay
on (``learner.router_replay``), the experts the generator's engine chose for every token it ran,
so that the learner's forward routes each token as sampling did.

A group names the model's routing shape once, ``routing_shape = [L, K, E]`` (MoE layers, top-k,
experts); every routing array is then ``[tokens, L, K]`` expert ids in the smallest unsigned
type that holds them (``|u1`` for E < 255, else ``<u2``), whose largest value (255 or 65535)
means *not recorded* (the learner's own router decides that token). Per token, per layer, K
bytes: 384 B per token at Qwen3-30B-A3B's 48 layers × top-8 of 128 experts.

- ``TrajectoryGroup.prompt_routed_experts``: the group's prompt ``[P, L, K]``;
- ``Trajectory.routed_experts``: the sample's ``response_token_ids`` ``[n, L, K]``; tokens the
  environment appended (tool results, template markup) are recorded where the engine ran them
  (as the prompt of the episode's next turn), else not recorded;
- ``Trajectory.prompt_routed_experts``: a segment's own prompt (``prompt_token_ids``).

Any of them may be absent (nothing recorded for those tokens). A message with routing is
written as v3; one without is byte for byte the v2 it always was. A wrong dtype or shape, a
token count that does not match its ids, or an id >= E is a ``WireError`` (the message goes to
the dead-letter stream with the reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from common.protocol.wire_arrays import WireError, _is_int, unpack_array

ROUTING_VERSION = 3
MAX_LAYERS, MAX_TOP_K, MAX_EXPERTS = 1024, 64, 65534


@dataclass(frozen=True)
class RoutingShape:
    layers: int
    top_k: int
    experts: int

    @property
    def dtype(self) -> str:
        return "|u1" if self.experts < 255 else "<u2"

    @property
    def not_recorded(self) -> int:
        return 255 if self.dtype == "|u1" else 65535

    def to_wire(self) -> list[int]:
        return [self.layers, self.top_k, self.experts]

    @classmethod
    def from_wire(cls, value: Any) -> RoutingShape:
        ok = isinstance(value, list) and len(value) == 3 and all(map(_is_int, value))
        if not ok:
            raise WireError("bad_schema", "routing_shape must be [layers, top_k, experts]")
        layers, top_k, experts = value
        ok = (0 < layers <= MAX_LAYERS and 0 < top_k <= MAX_TOP_K and 1 < experts <= MAX_EXPERTS
              and top_k <= experts)  # fmt: skip
        if not ok:
            raise WireError("bad_value", f"routing_shape {value} is out of range")
        return cls(layers, top_k, experts)

    def encode(self, experts: Any) -> np.ndarray:
        """``[n, L, K]`` expert ids (any integer type; < 0 = not recorded) in the wire's type,
        as a ``Trajectory`` or ``TrajectoryGroup`` holds them."""
        arr = np.asarray(experts)
        if arr.ndim != 3 or arr.shape[1:] != (self.layers, self.top_k):
            raise ValueError(f"routing of shape {arr.shape}, expected [n, {self.layers}, "
                             f"{self.top_k}]")  # fmt: skip
        if arr.size and int(arr.max()) >= self.experts:
            raise ValueError(f"routing names expert {int(arr.max())} of {self.experts}")
        return np.where(arr < 0, self.not_recorded, arr).astype(np.dtype(self.dtype))

    def unpack(self, obj: Any, n: int, name: str) -> np.ndarray:
        """A wire array of routing for ``n`` tokens, checked (see the module docstring)."""
        arr = unpack_array(obj)
        if arr.dtype.str != self.dtype or arr.ndim != 3:
            raise WireError("bad_schema", f"{name} must be 3-D {self.dtype} for {self.experts} "
                            "experts")  # fmt: skip
        if arr.shape != (n, self.layers, self.top_k):
            raise WireError("bad_value", f"{name} has shape {list(arr.shape)}, the ids need "
                            f"[{n}, {self.layers}, {self.top_k}]")  # fmt: skip
        bad = (arr >= self.experts) & (arr != self.not_recorded)
        if bad.any():
            raise WireError("bad_value", f"{name} names expert {int(arr[bad].max())}, the model "
                            f"has {self.experts}")  # fmt: skip
        return arr

    def replay(self, arr: np.ndarray) -> np.ndarray:
        """The learner's form: int64 ids, -1 where not recorded."""
        out = arr.astype(np.int64)
        out[arr == self.not_recorded] = -1
        return out
