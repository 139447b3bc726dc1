"""A snapshot copy that raises marks the snapshot failed on every copy path of
``VersionPreparer`` (so it is never served), and an early version is never completed.

The failure is real: an older version's send still holds the last region of the buffer
(``BufferClaims.send_begin``), so the copy's claim there times out.
"""

from __future__ import annotations

import functools

import pytest
import torch

from publisher.store.buffer_claims import REGION, BufferClaims
from publisher.store.snapshot import Snapshot, plan_snapshot
from publisher.store.sum_feed import SumFeed
from publisher.version_preparer import EarlyHooks, VersionPreparer
from weightpub_wire.buffers import BufferPool

pytestmark = pytest.mark.timeout(60)

CHUNK = 4096


@pytest.mark.parametrize("early", [False, True], ids=["complete", "early"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["in_place", "copied_then_hashed"])
def test_a_failed_copy_marks_the_snapshot_failed_and_never_completes(early: bool,
                                                                     contiguous: bool) -> None:
    big = torch.randn(256, 256)  # 4 regions
    snapshot, pairs = plan_snapshot({"big": big if contiguous else big.t(),
                                     "small": torch.randn(100)}, BufferPool())
    claims = BufferClaims(snapshot.total_bytes)
    last = (snapshot.total_bytes - 1) // REGION * REGION
    assert claims.send_begin(last, snapshot.total_bytes, 0)  # an old version's send
    snapshot.claim = functools.partial(claims.claim, version=1, wait=0.05)
    completed: list[int] = []
    announced: list[int] = []

    def announce_early(number: int, _s: Snapshot, _c: int, _f: SumFeed, _t: float) -> None:
        announced.append(number)

    hooks = EarlyHooks(announce=announce_early,
                       complete=lambda number, _s, _sums: completed.append(number))
    preparer = VersionPreparer(lambda number, *_: announced.append(number),
                               hooks if early else None)
    try:
        with pytest.raises(TimeoutError, match="still being sent"):
            preparer.copy_and_hash(1, snapshot, pairs, CHUNK)
        assert snapshot.failed
    finally:
        preparer.close()
    assert completed == []
    if early:
        assert announced == [1]  # at once, before the copy
