"""Packed arrays on the wire (``common.protocol.wire``): token ids and log-probs travel as
``{"dtype", "shape", "data"}`` maps of little-endian bytes, never as lists of Python ints; and
``WireError``, the one error a decode raises, with its reasons."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

MAX_ARRAY_ELEMS = 1 << 26
ERROR_REASONS = frozenset(
    {"oversize", "undecodable", "bad_version", "bad_kind", "bad_schema", "bad_value"}
)
_ARRAY_DTYPES = frozenset({"<u4", "<i4", "<f4", "<u8", "<i8", "<f8", "|u1", "<u2"})


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class WireError(Exception):
    """The one error ``decode`` raises. ``reason`` is one of ``ERROR_REASONS``."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in ERROR_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def pack_array(arr: np.ndarray) -> dict[str, Any]:
    """Pack a numpy array as ``{"dtype", "shape", "data"}`` with little-endian bytes."""
    arr = np.asarray(arr)
    little = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    dtype = little.dtype.str
    if dtype not in _ARRAY_DTYPES:
        raise ValueError(f"pack_array: dtype {dtype} is not one of {sorted(_ARRAY_DTYPES)}")
    return {"dtype": dtype, "shape": list(little.shape), "data": little.tobytes()}


def unpack_array(obj: Any, *, max_elems: int = MAX_ARRAY_ELEMS) -> np.ndarray:
    """Inverse of ``pack_array``; raises ``WireError`` on any inconsistency."""
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise WireError("bad_schema", "array must be a map with exactly dtype, shape, data")
    dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if dtype not in _ARRAY_DTYPES:
        raise WireError("bad_schema", f"array dtype {dtype!r} not allowed")
    if not isinstance(shape, list) or len(shape) > 4 or not all(_is_int(s) for s in shape):
        raise WireError("bad_schema", "array shape must be a list of at most 4 ints")
    if any(s < 0 for s in shape) or not isinstance(data, bytes):
        raise WireError("bad_schema", "array shape must be non-negative and data bytes")
    n = math.prod(shape)
    if n > max_elems:
        raise WireError("oversize", f"array of {n} elements exceeds {max_elems}")
    itemsize = np.dtype(dtype).itemsize
    if len(data) != n * itemsize:
        raise WireError(
            "bad_schema", f"array data is {len(data)} bytes, shape needs {n * itemsize}"
        )
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
