"""The worker-side routing record (``common.engine_routing``) without vLLM: each forward's rows
filed under their request and position, records grown as requests run longer, taken by the
engine's request id (vLLM's suffixed ids, the k-th of n completions), gaps left unrecorded."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch  # noqa: TID253 - tests of torch code

from common.engine_routing import NOT_RECORDED, _Record, records_from_rpc

LAYERS, TOP_K = 2, 2


def _step(rec: _Record, requests: list[tuple[str, list[int]]]) -> None:
    """One forward pass over ``requests`` (id, positions computed), rows = position * 10 + layer."""
    positions = [p for _, ps in requests for p in ps]
    starts = np.cumsum([0] + [len(ps) for _, ps in requests])
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=len(requests), req_ids=[r for r, _ in requests]),
        query_start_loc=SimpleNamespace(cpu=torch.tensor(starts, dtype=torch.int32)),
    )
    padded = torch.tensor(positions + [0, 0])  # the runner may pad a step: not rows of anyone
    for layer in range(LAYERS):
        ids = torch.tensor([[p * 10 + layer, p * 10 + layer + 1] for p in positions + [0, 0]])
        rec.capture(layer, ids)
    rec.file(runner, padded)


def test_rows_go_to_their_request_and_position_and_records_grow():
    rec = _Record(LAYERS, TOP_K, max_len=512)
    _step(rec, [("a-12345678", list(range(5))), ("0_b-abcdefgh", list(range(3)))])  # prefills
    for p in range(5, 100):  # decodes: one row each, a long response grows the record
        _step(rec, [("a-12345678", [p]), ("0_b-abcdefgh", [p - 2])])
    a = rec.take("a")[0]
    assert a.shape == (100, LAYERS, TOP_K) and a.dtype == np.int16
    assert (a[:, 1, 0] == np.arange(100) * 10 + 1).all()
    b = rec.take("b")[0]
    assert b.shape == (98, LAYERS, TOP_K) and (b[:, 0, 1] == np.arange(98) * 10 + 1).all()
    assert rec.take("a") == {} and not rec.requests  # taken once, then forgotten


def test_the_completions_of_one_request_by_index_and_gaps_unrecorded():
    rec = _Record(LAYERS, TOP_K, max_len=64)
    _step(rec, [("1_p@g0@1-aaaaaaaa", [0, 1, 3]), ("0_p@g0@1-bbbbbbbb", [0, 1, 2, 3]),
                ("0_p@g0@10-cccccccc", [0])])  # fmt: skip
    got = records_from_rpc(
        [(k, list(v.shape), v.tobytes()) for k, v in sorted(rec.take("p@g0@1").items())]
    )
    assert sorted(got) == [0, 1] and list(rec.requests) == ["0_p@g0@10-cccccccc"]
    assert (got[1][2] == NOT_RECORDED).all() and (got[1][3, 0] == [30, 31]).all()
    assert (got[0][:, 0, 0] == [0, 10, 20, 30]).all()
