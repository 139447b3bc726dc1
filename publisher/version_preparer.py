"""``publish()``'s copy and hash, and the thread that announces what they produce.

Split from ``weight_publisher.py``: the trainer's call returns once its tensors
are copied, while the checksums may still be running; getting the manifest out
as early as possible (before the copy ends, for CPU sources) is a job of its
own, with its own threads (two hashing workers, one preparing thread). The
publisher only supplies ``announce``, called on the preparing thread with each
version's chunk size and checksums (the chunk size is the publisher's choice, per
version: ``PublisherOptions.chunk_size_for``).

With ``early`` (``announce_early``, issue 29) the order changes: the version is
announced as soon as it is laid out (``EarlyHooks.announce``, a manifest whose sums
follow), each chunk's sum goes into the version's ``SumFeed`` as its hash ends (the
hashes run in the order subscribers fetch), and ``EarlyHooks.complete`` gets every sum
once they are all in. A copy that fails never completes: its sums are never all given.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from publisher.sources.streamed_copy import copy_streamed
from publisher.sources.streamed_plan import StreamedPairs
from publisher.store.snapshot import (
    ChunkHasher,
    Snapshot,
    copy_in_priority_order,
    copy_into,
    hashable_in_place,
    source_chunks,
    tell_sum,
    whole_chunks,
)
from publisher.store.sum_feed import SumFeed
from weightpub_wire.checksums import pieces_checksum
from weightpub_wire.chunk_order import priority_chunk_ids
from weightpub_wire.errors import WeightPubTimeout

__all__ = ["Announce", "EarlyHooks", "VersionPreparer"]

log = logging.getLogger("weightpub.publisher")
#: most seconds the announcing thread waits for an early version's snapshot copy (done by
#: ``publish()``, which always ends it: a bound for a copy that hangs, far above a host
#: copy of any version at GB/s)
COPY_WAIT_S = 900.0

#: (version, snapshot, chunk_size, checksums, created_at): builds the manifest, announces it
Announce = Callable[[int, Snapshot, int, tuple[int, ...], float], None]
_Item = tuple[int, Snapshot, int, Callable[[], tuple[int, ...]], float, SumFeed | None]


@dataclass(frozen=True, slots=True)
class EarlyHooks:
    """``announce_early``: ``announce(version, snapshot, chunk_size, feed, created_at)``
    before any hash ends; ``complete(version, snapshot, checksums)`` once all did."""

    announce: Callable[[int, Snapshot, int, SumFeed, float], None]
    complete: Callable[[int, Snapshot, tuple[int, ...]], None]


class VersionPreparer:
    """Copies and hashes snapshots; hands each to ``announce`` on its own thread, in order."""

    def __init__(self, announce: Announce, early: EarlyHooks | None = None) -> None:
        self._announce = announce
        self._early = early
        self._hash_executor = ThreadPoolExecutor(2, thread_name_prefix="weightpub-publish-hash")
        self._pending: queue.Queue[_Item | None] = queue.Queue()
        self._thread = threading.Thread(target=self._prepare_loop,
                                        name="weightpub-publish-announce", daemon=True)
        self._thread.start()

    def copy_and_hash(self, number: int, snapshot: Snapshot,
                      pairs: list[tuple[str, torch.Tensor]], chunk_size: int) -> None:
        """Copy once; hash ``chunk_size`` chunks so that the manifest goes out early.

        CPU sources are hashed in place on a worker thread while this thread
        copies, and the manifest is announced before the copy ends (the server
        holds back chunks not yet copied). Other sources are hashed chunk by
        chunk behind the copy.
        """
        created = time.time()
        total = snapshot.total_bytes
        feed = None if self._early is None else SumFeed(-(-total // chunk_size))
        # a streamed plan always runs its gathers (other ranks are in them), even when
        # this rank keeps only materialized tensors (a sharded rank owning none)
        if feed is not None and not isinstance(pairs, StreamedPairs) \
                and hashable_in_place(pairs):
            self._copy_hashing(number, snapshot, pairs, chunk_size, feed, created)
            return
        if not isinstance(pairs, StreamedPairs) and hashable_in_place(pairs):
            chunks = source_chunks(pairs, snapshot.entries, total, chunk_size)
            hashes = [self._hash_executor.submit(pieces_checksum, c) for c in chunks]
            self._pending.put((number, snapshot, chunk_size,
                               lambda: tuple(h.result() for h in hashes), created, None))
            with _copying(snapshot):
                copy_in_priority_order(snapshot, pairs, chunk_size)  # as subscribers fetch
            wait(hashes)  # the sources are read until every hash ends
            return
        hasher = ChunkHasher(self._hash_executor, snapshot.buffer, total, chunk_size,
                             on_sum=None if feed is None else feed.put)
        copied = threading.Event()
        if feed is not None:  # announced now; the sums follow the copy chunk by chunk
            self._pending.put((number, snapshot, chunk_size,
                               functools.partial(_after_copy, copied, snapshot, hasher.checksums),
                               created, feed))
        with _copying(snapshot, copied):
            if isinstance(pairs, StreamedPairs):  # sharded / WeightSource: group by group
                copy_streamed(snapshot, pairs, chunk_size, hasher.written_up_to)
            else:
                copy_into(snapshot, pairs, chunk_size, hasher.written_up_to)
        if feed is None:
            self._pending.put((number, snapshot, chunk_size, hasher.checksums, created, None))

    def _copy_hashing(self, number: int, snapshot: Snapshot,
                      pairs: list[tuple[str, torch.Tensor]], chunk_size: int, feed: SumFeed,
                      created: float) -> None:
        """Early sums, CPU sources: announced at once; each chunk wholly inside one tensor
        is copied and hashed in one pass (its sum into ``feed`` as its copy ends), the
        others (tensor edges, padding) hashed from the sources on the workers, in the
        order subscribers fetch."""
        total = snapshot.total_bytes
        chunks = source_chunks(pairs, snapshot.entries, total, chunk_size)
        whole = whole_chunks(snapshot.entries, total, chunk_size)
        hashes: list[Future[int]] = []
        for chunk in priority_chunk_ids(snapshot.entries, total, chunk_size):
            if chunk not in whole:
                hashes.append(self._hash_executor.submit(pieces_checksum, chunks[chunk]))
                hashes[-1].add_done_callback(functools.partial(tell_sum, feed.put, chunk))
        copied = threading.Event()
        self._pending.put((number, snapshot, chunk_size,
                           functools.partial(_after_copy, copied, snapshot,
                                             functools.partial(_fed_sums, feed, hashes)),
                           created, feed))
        try:
            with _copying(snapshot, copied):
                copy_in_priority_order(snapshot, pairs, chunk_size, on_sum=feed.put)
        finally:
            wait(hashes)  # the sources are read until every hash ends

    def close(self) -> None:
        """Let the versions queued so far be announced (10 s at most), then stop."""
        self._pending.put(None)
        self._thread.join(timeout=10)
        self._hash_executor.shutdown(wait=True)

    def _prepare_loop(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            number, snapshot, chunk_size, checksums, created_at, feed = item
            try:
                if feed is None:
                    self._announce(number, snapshot, chunk_size, checksums(), created_at)
                    continue
                assert self._early is not None
                self._early.announce(number, snapshot, chunk_size, feed, created_at)
                sums = checksums()  # every hash ended
                if not snapshot.failed:
                    self._early.complete(number, snapshot, sums)
            except Exception:  # keep serving older versions whatever happened
                log.exception("failed to prepare version %d", number)


@contextlib.contextmanager
def _copying(snapshot: Snapshot, copied: threading.Event | None = None) -> Iterator[None]:
    """A snapshot's copy: if it raises, the snapshot is marked failed (never served, an
    early version never completed); ``copied`` is set however it ends."""
    try:
        yield
    except BaseException:
        snapshot.failed = True
        raise
    finally:
        if copied is not None:
            copied.set()


def _fed_sums(feed: SumFeed, hashes: list[Future[int]]) -> tuple[int, ...]:
    """Every sum of a copied-and-hashed early version (the workers' ones included)."""
    for future in hashes:
        future.result()  # raises what a hash raised
    return feed.checksums()


def _after_copy(copied: threading.Event, snapshot: Snapshot,
                sums: Callable[[], tuple[int, ...]]) -> tuple[int, ...]:
    """The sums of an early version once its copy ended (on the announcing thread)."""
    if not copied.wait(timeout=COPY_WAIT_S):  # set in a finally: a safety net only
        raise WeightPubTimeout(f"the snapshot's copy did not end in {COPY_WAIT_S:.0f}s")
    if snapshot.failed:
        raise RuntimeError("the snapshot's copy failed")
    return sums()
