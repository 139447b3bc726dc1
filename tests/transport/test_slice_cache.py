"""The peer server's cache of gathered slices (``peers/slice_cache.py``), on a real pool.

Kept bytes count in the pool's staging budget (``BufferPool.hold``): the cache stays
within its own bound and the budget's room, and gives everything back when a version
needs the staging memory (``room_for`` sheds it before the version would wait).
"""

from __future__ import annotations

import numpy as np
import pytest

from subscriber_ext.transport.peers.slice_cache import SliceCache
from weightpub_wire.buffers import BufferPool

KIB = 1 << 10


def slice_of(chunk: int, nbytes: int = 4 * KIB) -> np.ndarray:
    return np.full(nbytes, chunk % 251, dtype=np.uint8)


def test_a_second_ask_is_a_hit_and_the_bytes_are_counted_in_the_pool() -> None:
    pool = BufferPool(pinned=False, budget_bytes=1 << 20)
    cache = SliceCache(64 * KIB, pool)
    key = ("p", 1, "plan", 3)
    assert cache.get(key) is None
    kept = cache.put(key, slice_of(3))
    again = cache.get(key)
    assert again is not None and bytes(again) == bytes(kept) == bytes(slice_of(3))
    assert (cache.hits, cache.misses) == (1, 1)
    assert pool.side_bytes == pool.held_bytes == cache.nbytes == 4 * KIB


def test_a_slice_only_one_peer_wants_is_kept_once_it_is_asked_again() -> None:
    pool = BufferPool(pinned=False, budget_bytes=1 << 20)
    cache = SliceCache(64 * KIB, pool)
    key = ("p", 1, "plan", 3)
    cache.put(key, slice_of(3), keep=False)  # one other member of the plan: it asks once
    assert len(cache) == 0 == pool.side_bytes and cache.get(key) is None
    cache.put(key, slice_of(3), keep=False)  # asked again (a re-ask, another asker)
    assert cache.get(key) is not None and pool.side_bytes == 4 * KIB
    cache.keep([])
    cache.put(key, slice_of(3), keep=False)  # forgotten with its version
    assert len(cache) == 0


def test_the_cache_never_exceeds_its_bound_and_drops_the_least_recently_used() -> None:
    pool = BufferPool(pinned=False, budget_bytes=1 << 20)
    cache = SliceCache(10 * KIB, pool)
    for chunk in range(3):
        cache.put(("p", 1, "plan", chunk), slice_of(chunk))
        assert cache.nbytes <= 10 * KIB
    assert len(cache) == 2  # the third pushed the first out
    assert cache.get(("p", 1, "plan", 0)) is None
    cache.get(("p", 1, "plan", 1))  # now the most recent
    cache.put(("p", 1, "plan", 9), slice_of(9))
    assert cache.get(("p", 1, "plan", 1)) is not None
    assert cache.get(("p", 1, "plan", 2)) is None
    cache.put(("p", 1, "plan", 7), slice_of(7, 11 * KIB))  # bigger than the bound
    assert cache.not_kept == 1 and cache.nbytes <= 10 * KIB
    assert pool.side_bytes == cache.nbytes


def test_versions_no_longer_held_are_dropped() -> None:
    pool = BufferPool(pinned=False, budget_bytes=1 << 20)
    cache = SliceCache(64 * KIB, pool)
    for version in (1, 2, 3):
        cache.put(("p", version, "plan", 0), slice_of(version))
    cache.keep([("p", 2), ("p", 3)])
    assert cache.get(("p", 1, "plan", 0)) is None and len(cache) == 2
    cache.keep([("q", 3)])  # another publisher's version 3 is another version
    assert len(cache) == 0 and pool.side_bytes == 0


def test_the_budget_bounds_the_cache_and_staging_takes_the_room_back() -> None:
    pool = BufferPool(pinned=False, budget_bytes=64 * KIB)
    cache = SliceCache(1 << 20, pool)  # its own bound is not the limit here
    pool.on_shed(cache.shed)
    other = [4 * KIB]  # another holder beside it (a stream's scratch): shed too
    assert pool.hold(other[0])
    pool.on_shed(lambda: pool.unhold(other.pop()) if other else None)
    staged = pool.take(48 * KIB)
    for chunk in range(8):
        cache.put(("p", 1, "plan", chunk), slice_of(chunk))
    assert cache.nbytes == 12 * KIB and cache.not_kept == 5  # what the budget left
    assert pool.held_bytes == 64 * KIB
    pool.give(staged)  # kept idle for reuse, still counted
    assert pool.room_for(60 * KIB)  # the holders go first; the idle buffer then
    assert cache.nbytes == 0 == pool.side_bytes and cache.sheds == 1 and not other
    pool.off_shed(cache.shed)
    assert pool.hold(4 * KIB) and pool.room_for(60 * KIB)  # no shedder left: not shed
    assert pool.side_bytes == 4 * KIB
    pool.unhold(4 * KIB)
    with pytest.raises(ValueError, match="unhold"):
        pool.unhold(1)


def test_a_negative_cache_size_is_refused_naming_the_option() -> None:
    from subscriber_ext.transport.peers.peer_options import PeerOptions
    from weightpub_wire.errors import ConfigError
    with pytest.raises(ConfigError, match="slice_cache_bytes: -1 is negative"):
        PeerOptions(slice_cache_bytes=-1)
    with pytest.raises(ValueError, match="max_entries 0 >= 1"):
        SliceCache(1, max_entries=0)
