"""``common.weights.checksum``: the running checksum of an update, both kinds. ``wsum64`` is the
GPU's (computed where the bytes are); its arithmetic is torch's, so it runs here on the CPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from common.weights.buckets import unit_buffers  # noqa: E402
from common.weights.checksum import WSUM, XXH3, UpdateHasher, tensors_checksum  # noqa: E402
from common.weights.layout import build_layout, pieces  # noqa: E402


def _update(kind: str):
    g = torch.Generator().manual_seed(0)
    named = sorted([("a.big", torch.randn(300_001, generator=g)),  # alone (>= 1 MiB), odd size
                    ("b.small", torch.randn(7, generator=g).bfloat16()),
                    ("c.small", torch.arange(5))])  # fmt: skip
    layout = build_layout(named, 1, 1 << 20, chunk_bytes=1 << 18)
    layout["checksum"] = kind
    return named, layout, unit_buffers(named, layout, "cpu")


def _running(layout, units, *, piecewise: bool) -> list[bytes]:
    h, out = UpdateHasher(layout), []
    for (start, end, _, _), buf in zip(layout["units"], units, strict=True):
        ends = (
            [b for _, b in pieces(0, end - start, layout["chunk"])] if piecewise else [end - start]
        )
        for b in ends:
            h.upto(buf, start, start + b)
        out.append(h.digest())
    return out


@pytest.mark.parametrize("kind", [XXH3, WSUM])
def test_running_checksum_is_the_same_piece_by_piece_and_catches_any_change(kind):
    named, layout, units = _update(kind)
    assert len(layout["units"]) == 2  # the big tensor alone, the small ones packed
    whole = _running(layout, units, piecewise=False)
    assert _running(layout, units, piecewise=True) == whole
    if kind == XXH3:  # the last running digest is the tensors' own checksum
        assert whole[-1].hex() == tensors_checksum(named)
    for k, pos in [(0, 0), (0, 1_200_003), (1, 5)]:
        bad = [u.clone() for u in units]
        bad[k][pos] ^= 0x01  # one flipped bit
        assert _running(layout, bad, piecewise=True)[k] != whole[k]
    swapped = [u.clone() for u in units]  # two 8-byte words trade places
    swapped[0][:8], swapped[0][8:16] = units[0][8:16].clone(), units[0][:8].clone()
    assert _running(layout, swapped, piecewise=True)[0] != whole[0]
    renamed = dict(layout, tensors=[["z" + t[0], *t[1:]] for t in layout["tensors"]])
    assert _running(renamed, units, piecewise=False)[-1] != whole[-1]
