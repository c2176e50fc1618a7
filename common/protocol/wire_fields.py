"""Validating one decoded wire map (``common.protocol.wire``): typed access to its fields, where
every problem becomes a ``WireError`` naming the field, and the schema versions a build reads."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from common.protocol.wire_arrays import WireError, _is_int, unpack_array

SCHEMA_VERSION = 2
# Versions this build decodes. v1 (single-turn trajectories with version spans) is upgraded on
# decode: every token sampled (loss mask 1), per-token versions from the spans, one turn. v3 is
# v2 with routed experts (``common.protocol.routing``): written only by a group that has them.
READABLE_VERSIONS = (1, 2, 3)
LOGPROB_EPS = 1e-3  # float32 rounding of log(p) for p ~ 1 can land slightly above 0
_SPLITS = ("train", "eval")


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
def _allowed_keys(cls: Any, head: bool, extra: frozenset[str]) -> frozenset[str]:
    return frozenset(cls.__dataclass_fields__) | ({"v", "kind"} if head else frozenset()) | extra


class _Fields:
    """Typed access to one decoded map; every problem becomes a WireError naming the field.

    ``version``: the schema version the map was written in (a message's own ``v``, or its
    enclosing message's for a nested map); ``legacy`` names fields that version may carry
    besides the dataclass's."""

    def __init__(
        self,
        d: Any,
        where: str,
        cls: type,
        head: bool = True,
        version: int = SCHEMA_VERSION,
        legacy: frozenset[str] = frozenset(),
    ) -> None:
        _check(isinstance(d, dict), "bad_schema", f"{where} must be a map")
        if head:
            v = d.get("v")
            ok = _is_int(v) and v in READABLE_VERSIONS
            _check(ok, "bad_version", f"{where}: v={v!r}")
            _check(d.get("kind") == where, "bad_kind", f"kind={d.get('kind')!r}, want {where!r}")
            version = v
        extra = d.keys() - _allowed_keys(cls, head, legacy)
        _check(not extra, "bad_schema", f"{where} has unknown fields {sorted(map(str, extra))}")
        self.d, self.where, self.version = d, where, version

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
