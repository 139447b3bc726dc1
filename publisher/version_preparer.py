"""``publish()``'s copy and hash, and the thread that announces what they produce.

Split from ``weight_publisher.py``: the trainer's call returns once its tensors
are copied, while the checksums may still be running; getting the manifest out
as early as possible (before the copy ends, for CPU sources) is a job of its
own, with its own threads (two hashing workers, one preparing thread). The
publisher only supplies ``announce``, called on the preparing thread with each
version's chunk size and checksums (the chunk size is the publisher's choice, per
version: ``PublisherOptions.chunk_size_for``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

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
)
from weightpub_wire.checksums import pieces_checksum

__all__ = ["Announce", "VersionPreparer"]

log = logging.getLogger("weightpub.publisher")

#: (version, snapshot, chunk_size, checksums, created_at): builds the manifest, announces it
Announce = Callable[[int, Snapshot, int, tuple[int, ...], float], None]


class VersionPreparer:
    """Copies and hashes snapshots; hands each to ``announce`` on its own thread, in order."""

    def __init__(self, announce: Announce) -> None:
        self._announce = announce
        self._hash_executor = ThreadPoolExecutor(2, thread_name_prefix="weightpub-publish-hash")
        self._pending: queue.Queue[
            tuple[int, Snapshot, int, Callable[[], tuple[int, ...]], float] | None
        ] = queue.Queue()
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
        # a streamed plan always runs its gathers (other ranks are in them), even when
        # this rank keeps only materialized tensors (a sharded rank owning none)
        if not isinstance(pairs, StreamedPairs) and hashable_in_place(pairs):
            chunks = source_chunks(pairs, snapshot.entries, snapshot.total_bytes, chunk_size)
            hashes = [self._hash_executor.submit(pieces_checksum, c) for c in chunks]
            self._pending.put((number, snapshot, chunk_size,
                               lambda: tuple(h.result() for h in hashes), created))
            copy_in_priority_order(snapshot, pairs, chunk_size)  # as subscribers fetch
            wait(hashes)  # the sources are read until every hash ends
            return
        hasher = ChunkHasher(self._hash_executor, snapshot.buffer, snapshot.total_bytes,
                             chunk_size)
        if isinstance(pairs, StreamedPairs):  # sharded / WeightSource: group by group
            copy_streamed(snapshot, pairs, chunk_size, hasher.written_up_to)
        else:
            copy_into(snapshot, pairs, chunk_size, hasher.written_up_to)
        self._pending.put((number, snapshot, chunk_size, hasher.checksums, created))

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
            number, snapshot, chunk_size, checksums, created_at = item
            try:
                self._announce(number, snapshot, chunk_size, checksums(), created_at)
            except Exception:  # keep serving older versions whatever happened
                log.exception("failed to prepare version %d", number)
