"""A version announced before its bytes exist: what a cut-through relay publishes.

A relay announces an upstream version downstream as soon as the upstream
manifest arrives, and fills in each chunk as its upstream subscriber verifies
it (``write_chunk``). The serving thread already holds back chunks that are
announced but not final (``PublishedVersion.chunk_ready``), so a downstream
subscriber gets each chunk a moment after the relay has it: the time through a
relay is one transfer plus a few chunk times, not two transfers. The manifest
keeps the upstream's chunking and checksums (the bytes are the same), so
nothing is hashed again, and downstream subscribers check every chunk as always.

With NIXL on (``nixl=True`` downstream), the manifest carries no offer while the copy
is incomplete: a one-sided reader is not held back chunk by chunk as frames are.
``when_done`` tells the publisher when the last chunk is in (it then adds the offer
of the relay's registered buffer and announces the manifest again) or that the
version failed first (counted as unoffered, cause "copy"). With ``nixl_cut_through``
the offer goes out with the first announcement and carries a readiness map instead:
``on_written`` stores the version's number in chunk ``i``'s registered word after its
bytes, and a reader READs a chunk only once its word says so.

Until it is complete or failed, the version pins its buffer
(``PublishedVersion.pins``): an eviction never hands the buffer to a newer
version while chunks are still being written into it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from publisher.deltas.delta_encoder import DeltaPublisher
from publisher.store.snapshot import Snapshot
from publisher.store.version_store import PublishedVersion, VersionStore
from weightpub_wire import protocol as wire
from weightpub_wire.buffers import byte_view

__all__ = ["RelayedVersion", "relay_upstream"]


class RelayedVersion:
    """One announced version whose chunks arrive later; written by one thread (the relay's
    upstream subscriber), read by the serving thread through ``is_ready``."""

    def __init__(self, published: PublishedVersion, upstream: tuple[str, int],
                 on_fail: Callable[[int], object]) -> None:
        self.published = published
        self.upstream = upstream  # (publisher_id, version) it copies
        self._ready = bytearray(published.manifest.num_chunks)
        self._missing = published.manifest.num_chunks
        self._on_fail = on_fail
        self._lock = threading.Lock()
        self._done = False
        self.written_bytes = 0
        self._on_complete: Callable[[RelayedVersion], object] | None = None
        self._on_incomplete: Callable[[RelayedVersion], object] | None = None
        #: told each chunk once its bytes are in (a NIXL readiness map: ``nixl_cut_through``)
        self.on_written: Callable[[int], object] | None = None
        published.pin(self)  # new, not yet in the store: cannot be retired yet
        if self._missing == 0:
            self._release()

    @property
    def version(self) -> int:
        return self.published.manifest.version

    @property
    def complete(self) -> bool:
        return self._missing == 0

    @property
    def failed(self) -> bool:
        return self.published.failed

    def when_done(self, on_complete: Callable[[RelayedVersion], object],
                  on_incomplete: Callable[[RelayedVersion], object]) -> None:
        """Call ``on_complete`` once every chunk is written (now, if they are), or
        ``on_incomplete`` if the version fails first; on the thread that ends it."""
        with self._lock:
            done, complete = self._done, self._missing == 0 and not self.failed
            if not done:
                self._on_complete, self._on_incomplete = on_complete, on_incomplete
        if done:
            (on_complete if complete else on_incomplete)(self)

    def is_ready(self, chunk: int) -> bool:
        """Whether the chunk's bytes are final (``PublishedVersion.chunk_ready``)."""
        return bool(self._ready[chunk])

    def write_chunk(self, chunk: int, data: memoryview) -> None:
        """Copy one verified chunk in; the serving thread may send it from now on."""
        start, size = self.published.manifest.chunk_span(chunk)
        if len(data) != size:
            raise ValueError(f"chunk {chunk} of version {self.version}: {len(data)} bytes, "
                             f"the manifest says {size}")
        with self._lock:
            if self._done or self._ready[chunk]:
                return
            self.published.claim(start, start + size)  # before the bytes (buffer_claims.py)
            self.published.view[start: start + size] = data
            self.written_bytes += size
            self._ready[chunk] = 1  # after the bytes: the serving thread reads flag, then bytes
            if self.on_written is not None:
                self.on_written(chunk)  # after the bytes too: a one-sided reader's flag
            self._missing -= 1
            if self._missing:
                return
            self._release()
            on_complete, self._on_complete, self._on_incomplete = self._on_complete, None, None
        if on_complete is not None:
            on_complete(self)

    def fail(self) -> None:
        """The upstream version will not be completed: downstream fetches get
        ``version_unavailable`` and the version is forgotten."""
        with self._lock:
            if self._done:
                return
            if self.published.snapshot is not None:
                self.published.snapshot.failed = True
            self._release()
            on_incomplete, self._on_complete, self._on_incomplete = \
                self._on_incomplete, None, None
        self._on_fail(self.version)
        if on_incomplete is not None:
            on_incomplete(self)

    def _release(self) -> None:
        self._done = True
        self.published.unpin(self)


def relay_upstream(upstream: wire.Manifest, number: int, snapshot: Snapshot,
                   store: VersionStore, deltas: DeltaPublisher, *, publisher_id: str,
                   started_at: float, model_id: str,
                   stream_port: int | None = None) -> RelayedVersion:
    """Store ``upstream`` as this instance's version ``number`` in ``snapshot``'s (empty)
    buffer, ready to be announced (``WeightPublisher.relay_version``).

    The manifest keeps the upstream's tensors, chunking and checksums; deltas against
    the previous version are planned now and encoded chunk by chunk as chunks arrive.
    ``stream_port``: this instance's stream port (``stream=True``), where its chunks are
    served too once written (``stream_server`` waits for a chunk not yet in).
    """
    total = upstream.total_bytes
    previous = store.latest()
    delta = deltas.plan(number, list(upstream.tensors), total, upstream.chunk_size,
                        upstream.checksums, previous)
    manifest = wire.Manifest(
        publisher_id=publisher_id, started_at=started_at, version=number,
        created_at=upstream.created_at, model_id=model_id or upstream.model_id,
        chunk_size=upstream.chunk_size, total_bytes=total, tensors=upstream.tensors,
        checksums=upstream.checksums, delta=delta, deltas_follow=deltas.enabled,
        stream_port=stream_port)
    published = PublishedVersion(manifest=manifest, buffer=snapshot.buffer,
                                 view=byte_view(snapshot.buffer, total), snapshot=snapshot)
    relayed = RelayedVersion(published, (upstream.publisher_id, upstream.version),
                             store.discard)
    published.ready = relayed.is_ready
    store.add(published)
    deltas.start(published, previous)  # encodes each chunk once it is written
    return relayed
