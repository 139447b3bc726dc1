"""One buffer per kept version: a newer snapshot overwrites the oldest, and readers check.

Three threads meet at a ``PublishedVersion``: the server copies chunks out of it
into reply scratch, the delta encoder reads it, and a ``publish()`` copies the
next version over it once ``keep_versions`` are held. A read that overlapped a
write of another version, reported as intact, would put bytes of a newer version
on the wire under an older version's checksums.
"""

from __future__ import annotations

import threading
import time

import torch

from publisher.store.buffer_claims import REGION, BufferClaims
from publisher.store.snapshot import Snapshot, copy_in_priority_order
from publisher.store.version_store import PublishedVersion, VersionStore
from weightpub_wire import protocol as wire
from weightpub_wire.buffers import BufferPool, byte_view

SIZE = 8 * REGION
CHUNK = 2 * REGION


def version(number: int, buffer: torch.Tensor) -> PublishedVersion:
    manifest = wire.Manifest(publisher_id="p" * 32, started_at=1.0, version=number,
                             created_at=1.0, model_id="m", chunk_size=CHUNK, total_bytes=SIZE,
                             tensors=(), checksums=(0,) * (SIZE // CHUNK))
    return PublishedVersion(manifest=manifest, buffer=buffer, view=byte_view(buffer))


def test_the_oldest_buffer_is_lent_to_the_next_snapshot_unless_pinned() -> None:
    pool = BufferPool(max_buffers=4)
    store = VersionStore(keep=1, pool=pool)
    first = version(1, pool.take(SIZE))
    store.add(first)
    reader = object()
    assert first.pin(reader)  # a collective round reading it whole
    store.make_room()
    assert not first.lent
    assert pool.take(SIZE).data_ptr() != first.buffer.data_ptr()  # a buffer of its own
    first.unpin(reader)
    store.make_room()
    assert first.lent and store.get(1) is first  # still listed, served while intact
    assert pool.take(SIZE).data_ptr() == first.buffer.data_ptr()  # the same memory
    assert not first.pin(object())  # nothing starts a long read of a lent buffer


def test_an_evicted_pinned_version_goes_back_to_the_pool_once_unpinned() -> None:
    pool = BufferPool(max_buffers=4)
    store = VersionStore(keep=1, pool=pool)
    first = version(1, pool.take(SIZE))
    store.add(first)
    assert first.pin("round")
    store.make_room()
    store.add(version(2, pool.take(SIZE)))  # evicts version 1, still pinned
    assert store.retiring() == 1 and not first.lent
    first.unpin("round")
    store.recycle()
    assert store.retiring() == 0 and first.lent
    assert pool.take(SIZE).data_ptr() == first.buffer.data_ptr()


def test_a_chunk_is_intact_until_a_newer_copy_claims_it() -> None:
    """The copy of version 2 runs over version 1's buffer in ``chunk_order``: version 1's
    chunks stay servable until their turn, and version 2's are intact once copied."""
    pool = BufferPool(max_buffers=4)
    store = VersionStore(keep=1, pool=pool)
    first = version(1, pool.take(SIZE))
    store.claims(first.buffer).claim(0, SIZE, 1)
    store.add(first)
    assert all(first.intact(c) for c in range(SIZE // CHUNK))
    store.make_room()
    buffer = pool.take(SIZE)
    entries = [wire.TensorEntry(name="big", dtype="uint8", shape=(3 * CHUNK,), offset=0,
                                nbytes=3 * CHUNK),
               wire.TensorEntry(name="small", dtype="uint8", shape=(CHUNK,),
                                offset=3 * CHUNK, nbytes=CHUNK)]
    snapshot = Snapshot(entries=entries, buffer=buffer, total_bytes=SIZE,
                        claim=lambda start, stop: store.claims(buffer).claim(start, stop, 2))
    seen: list[list[bool]] = []
    pieces = [("big", torch.full((3 * CHUNK,), 2, dtype=torch.uint8)),
              ("small", torch.full((CHUNK,), 2, dtype=torch.uint8))]
    original = snapshot.claim

    def watch(start: int, stop: int) -> None:
        assert original is not None
        seen.append([first.intact(c) for c in range(SIZE // CHUNK)])
        original(start, stop)

    snapshot.claim = watch
    copy_in_priority_order(snapshot, pieces, CHUNK)
    # the largest tensor first: its padding, then chunk 0, 1, 2, then the small one
    assert seen[1] == [True, True, True, True]  # nothing of version 1 overwritten yet
    assert seen[2] == [False, True, True, True]
    assert not any(first.intact(c) for c in range(SIZE // CHUNK))
    second = version(2, buffer)
    store.add(second)
    assert all(second.intact(c) for c in range(SIZE // CHUNK))
    assert store.versions() == (2,)


def test_a_read_that_overlaps_a_write_is_never_reported_intact() -> None:
    """A reader copies a region out, then checks; a writer claims, then writes. Whatever
    the interleaving, a copy reported intact holds one version's bytes only."""
    claims = BufferClaims(REGION)
    buffer = torch.zeros(REGION, dtype=torch.uint8)
    claims.claim(0, REGION, 1)
    buffer.fill_(1)
    stop = threading.Event()
    mixed = []
    written = [1]  # the newest version whose write ended (``chunk_ready`` in the publisher)

    def write() -> None:
        for number in range(2, 3000):
            claims.claim(0, REGION, number)
            buffer.fill_(number % 251)
            written[0] = number
            time.sleep(0.0001 * (number % 3))  # let the reader in at every point
        stop.set()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        checked = 0
        while not stop.is_set():
            number = written[0]
            copy = buffer.clone()
            if claims.holds(0, REGION, number):
                checked += 1
                if not bool((copy == number % 251).all()):
                    mixed.append(number)
    finally:
        writer.join()
    assert not mixed
    assert checked > 0
