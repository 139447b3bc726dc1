"""The slice recorder on plain tensors (no vLLM): the elements a loader's views cover."""

from __future__ import annotations

import pytest
import torch

from subscriber_ext.vllm_ext.apply.slice_record import (
    RangeSink,
    RangeTensor,
    UnsupportedLoad,
    element_runs,
    merge_runs,
)


def _record(op, shape=(8, 6), dtype=torch.bfloat16) -> list[tuple[int, int]]:
    """Runs recorded for ``op(stand_in)`` copied into a meta parameter; checked on real data."""
    sink = RangeSink()
    stand_in = RangeTensor("w", shape, dtype, sink)
    piece = op(stand_in)
    torch.empty(tuple(piece.shape), device="meta", dtype=piece.dtype).copy_(piece)
    runs = merge_runs(sink.runs["w"])
    real = torch.arange(int(torch.tensor(shape).prod())).view(shape)  # oracle: real indices
    want = sorted(set(op(real).reshape(-1).tolist()))
    got = [i for start, end in runs for i in range(start, end)]
    assert got == want
    return runs


def test_row_and_column_slices() -> None:
    assert _record(lambda w: w.narrow(0, 4, 4)) == [(24, 48)]
    assert _record(lambda w: w.narrow(1, 3, 3)) == [(i * 6 + 3, i * 6 + 6) for i in range(8)]
    assert _record(lambda w: w[2:4]) == [(12, 24)]


def test_chunks_transposes_dtype_copies_and_copying_reshapes() -> None:
    assert _record(lambda w: w.chunk(2, dim=0)[1].t().contiguous().reshape(-1)) == [(24, 48)]
    assert _record(lambda w: w.to(torch.float32).narrow(0, 0, 2)) == [(0, 12)]
    # a reshape of a column slice must copy: the stand-in carries indices from there on
    runs = _record(lambda w: w.narrow(1, 0, 2).reshape(4, 4).narrow(0, 1, 2))
    assert runs == [(12, 14), (18, 20), (24, 26), (30, 32)]
    assert _record(lambda w: w.unbind(0)[3]) == [(18, 24)]


def test_math_on_the_weights_is_refused_not_guessed() -> None:
    stand_in = RangeTensor("w", (4, 4), torch.float32, RangeSink())
    with pytest.raises(UnsupportedLoad, match="not a slice"):
        _ = stand_in * 2
    with pytest.raises(UnsupportedLoad, match="another dtype"):
        stand_in.view(torch.int32)
    dest = torch.empty((8,), device="meta")
    with pytest.raises(UnsupportedLoad, match="broadcasting"):
        dest.copy_(stand_in[0])


def test_element_runs_merge_and_skip_empty() -> None:
    assert element_runs((3, 2), (2, 1), 4) == [(4, 10)]
    assert element_runs((2, 3), (1, 2), 0) == [(0, 6)]
    assert element_runs((0, 5), (5, 1), 0) == []
    assert merge_runs([(5, 7), (0, 2), (2, 3), (6, 9)]) == [(0, 3), (5, 9)]
