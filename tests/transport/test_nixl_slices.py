"""Slices over NIXL (issues 30 and 31): a sliced subscriber READs only its plan's byte
ranges one-sided when the manifest offers NIXL.

A publisher process with ``nixl=True`` and two subscribers here with complementary
plans (``test_slice_fetch.half_plan``), real NIXL agents (UCX on loopback). What must
hold: each staged version equals the published one on the plan's bytes and reads
zeros elsewhere, the publisher sends no chunk or slice frame (every planned byte
READ one-sided, verified against the slice sums it serves), each subscriber READs
its plan's bytes and not the version; a corrupted region costs that chunk as a
ZeroMQ slice, counted as ``checksum``, never a wrong byte staged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from subscriber_ext import WeightSubscriber
from tests.transport.procs import Child, as_bytes, det_weights, spec_bytes, wait_until
from tests.transport.test_slice_fetch import SEED, SPEC, WHOLE, half_plan

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("nixl_loopback")]

CHUNK = 256 << 10


def _publisher(spawn: Callable[..., Child], **args: Any) -> tuple[Child, str]:
    child = spawn("publisher", endpoint="tcp://127.0.0.1:0", seed=SEED, chunk_size=CHUNK,
                  nixl=True, **args)
    return child, child.event("ready", timeout=60)["endpoint"]


def _publish(pub: Child, version: int) -> None:
    pub.request("publish", timeout=60, version=version, spec=SPEC)


def _check(staged: Any, version: int, rank: int) -> None:
    """Planned bytes equal the published ones; the rest reads zeros (never written)."""
    want = det_weights(SEED, version, SPEC)
    for name, tensor in want.items():
        got = staged.tensors[name]
        if tensor.dim() != 2 or name in WHOLE:
            assert as_bytes(got).equal(as_bytes(tensor)), name
            continue
        half = tensor.shape[1] // 2
        mine = slice(rank * half, (rank + 1) * half)
        other = slice((1 - rank) * half, (2 - rank) * half)
        assert as_bytes(got[:, mine]).equal(as_bytes(tensor[:, mine])), (name, rank)
        assert not as_bytes(got[:, other]).any(), (name, rank)


def test_each_plan_reads_only_its_slices_over_nixl(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber]) -> None:
    pub, endpoint = _publisher(spawn)
    subs = [make_sub(endpoint, slice_plan=half_plan(rank), request_timeout=5.0)
            for rank in (0, 1)]
    for version in (1, 2):
        _publish(pub, version)
        for rank, sub in enumerate(subs):
            staged = sub.wait_for_version(version, timeout=60)
            assert staged.data_path == "nixl"
            _check(staged, version, rank)
            staged.release()
    stats = pub.request("stats")["stats"]
    assert stats["bytes_sent_full"] == 0 and stats["bytes_sent_slices"] == 0, stats
    total = spec_bytes(SPEC)
    for sub in subs:
        status = sub.status()
        nixl, plan = status["nixl"], status["slice_plan"]
        assert nixl["fallbacks"] == 0, nixl
        # its own bytes, twice, and not the version's
        assert nixl["bytes_read"] == 2 * plan["needed_bytes"] < 2 * 0.7 * total
        assert plan["slice_bytes"] == 2 * plan["needed_bytes"] and plan["fallbacks"] == {}
        sub.mark_applied(2)  # what version 2 cost: its plan, read one-sided
        wait_until(lambda s=sub: s.status()["applied_received"] is not None, 30,
                   "applied")
        assert sub.status()["applied_received"]["by_source"] == {"nixl": plan["needed_bytes"]}


def test_a_corrupted_slice_is_refetched_as_a_zeromq_slice(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber]) -> None:
    pub, endpoint = _publisher(spawn, nixl_fault="corrupt:1")  # in rank 0's half rows
    sub = make_sub(endpoint, slice_plan=half_plan(0), request_timeout=5.0)
    _publish(pub, 1)
    staged = sub.wait_for_version(1, timeout=60)
    _check(staged, 1, 0)  # the torn chunk never staged
    assert staged.data_path == "nixl+zmq"
    status = sub.status()
    assert status["checksum_failures"] == 1
    assert status["nixl"]["fallback_causes"] == {"checksum": 1}
    stats = pub.request("stats")["stats"]
    plan = status["slice_plan"]
    assert stats["bytes_sent_full"] == 0  # the one chunk came as a ZeroMQ slice
    assert 0 < stats["bytes_sent_slices"] <= CHUNK // 2 < plan["needed_bytes"]


def test_a_sparse_buffer_registers_the_touched_pages_in_few_ranges() -> None:
    """Touched pages are registered range by range (untouched ones are never pinned);
    a plan of many scattered pieces is merged into at most ``MAX_SPARSE_RANGES``."""
    from subscriber_ext.transport.client.nixl_source import MAX_SPARSE_RANGES, touched_ranges
    from weightpub_wire.slice_layout import PAGE, SliceLayout

    def layout(blocks: dict[int, list[tuple[int, int, int, int]]]) -> SliceLayout:
        return SliceLayout(chunks=tuple(sorted(blocks)), blocks=blocks, sizes={},
                           needed_bytes=0, resident_bytes=0)

    # a row-strided block (4 rows of 100 bytes, 1,000 apart), a whole page far after it,
    # and a piece touching the one before it
    few = layout({0: [(10, 100, 1000, 4)], 3: [(40 * PAGE, PAGE, PAGE, 1),
                                              (41 * PAGE + 5, 10, 10, 1)]})
    assert touched_ranges(few, 1 << 30) == [(0, PAGE), (40 * PAGE, 2 * PAGE)]
    assert touched_ranges(few, 40 * PAGE + 100) == [(0, PAGE), (40 * PAGE, 100)]  # the end
    scattered = layout({0: [(i * 3 * PAGE, 8, 8, 1) for i in range(5000)]})
    ranges = touched_ranges(scattered, 1 << 30)
    assert len(ranges) <= MAX_SPARSE_RANGES
    covered = [(start, start + size) for start, size in ranges]
    assert all(any(lo <= i * 3 * PAGE and i * 3 * PAGE + 8 <= hi for lo, hi in covered)
               for i in range(0, 5000, 7))
