"""Checksums taken from the source tensors equal checksums of the finished snapshot."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import xxhash

from publisher.store.snapshot import (
    ChunkHasher,
    copy_in_priority_order,
    copy_into,
    plan_snapshot,
    source_chunks,
    whole_chunks,
)
from weightpub_wire.buffers import BufferPool
from weightpub_wire.checksums import pieces_checksum as hash_pieces

CHUNK = 4096


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7, dtype=torch.bfloat16),
        "odd": torch.randint(0, 255, (4097,), dtype=torch.uint8),  # spans a chunk edge
        "big": torch.randn(3, 2000),  # several chunks, starts mid-chunk
        "flag": torch.tensor([True, False, True]),
        "last": torch.randn(5).to(torch.float16),
    }


@pytest.mark.parametrize("chunk", [CHUNK, 8192, 1 << 20])
def test_source_hashes_equal_snapshot_hashes(chunk):
    weights = _weights()
    snapshot, pairs = plan_snapshot(weights, BufferPool())
    from_sources = tuple(hash_pieces(c) for c in source_chunks(pairs, snapshot.entries,
                                                               snapshot.total_bytes, chunk))
    snapshot.buffer.fill_(0xAB)  # stale bytes must not leak into the padding
    copy_into(snapshot, pairs, chunk)
    assert snapshot.copied_bytes == snapshot.total_bytes
    view = memoryview(snapshot.buffer.numpy())
    from_buffer = tuple(xxhash.xxh3_64_intdigest(view[s: s + chunk])
                        for s in range(0, snapshot.total_bytes, chunk))
    assert from_sources == from_buffer
    with ThreadPoolExecutor(2) as pool:
        hasher = ChunkHasher(pool, snapshot.buffer, snapshot.total_bytes, chunk)
        assert hasher.checksums() == from_buffer
    for entry in snapshot.entries:
        raw = snapshot.buffer[entry.offset: entry.offset + entry.nbytes]
        assert torch.equal(raw, weights[entry.name].reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("chunk", [1024, CHUNK])
def test_priority_copy_hashes_exactly_the_whole_chunks(chunk):
    """The early-sums path hashes on the workers every chunk not in ``whole_chunks``: the
    copy must sum exactly those chunks (one missed never completes, one extra is sent twice)."""
    snapshot, pairs = plan_snapshot(_weights(), BufferPool())
    sums: dict[int, int] = {}
    copy_in_priority_order(snapshot, pairs, chunk, on_sum=sums.__setitem__)
    whole = whole_chunks(snapshot.entries, snapshot.total_bytes, chunk)
    assert whole and sorted(sums) == sorted(whole)
    view = memoryview(snapshot.buffer.numpy())
    for index, value in sums.items():
        assert value == xxhash.xxh3_64_intdigest(view[index * chunk: (index + 1) * chunk])
