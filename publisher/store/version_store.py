"""The newest K published versions, kept in host memory for slow subscribers, in K buffers.

Memory: the publisher holds ``keep_versions`` snapshot buffers (default 1) and no
more. ``publish()`` of a new version, with K versions held, lends the oldest one's
buffer to the new snapshot (``VersionStore.make_room``): the old version stays
listed and served while the copy overwrites it region by region, and every reader
checks after its copy that the bytes it read are still its version's
(``publisher.store.buffer_claims``; ``PublishedVersion.intact``). A chunk already
overwritten gets ``version_unavailable``: its subscriber moves to the new version,
as conflation does. A reader that copies a whole version out over a long time (a
collective round, a relay still writing its chunks in) ``pin``s it instead: a pinned
version's buffer is not lent, and the next snapshot takes a buffer of its own (within
``host_budget_bytes``) until it is unpinned. A snapshot that fails (``drop_lent``)
hands the buffer back to the version that lent it if it overwrote none of its bytes;
otherwise that version is withdrawn: with one buffer per version there is nothing
left to serve it from (``keep_versions=2`` keeps the newest through a failed publish).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from publisher.store.buffer_claims import BufferClaims, ClaimTable
from publisher.store.snapshot import Snapshot
from publisher.store.sum_feed import SumFeed
from weightpub_wire.buffers import BufferPool
from weightpub_wire.errors import ConfigError
from weightpub_wire.protocol import Manifest

__all__ = ["PublishedVersion", "VersionStore"]


@dataclass(slots=True)
class PublishedVersion:
    """A manifest plus the bytes it describes, until a newer version claims them."""

    manifest: Manifest
    buffer: torch.Tensor
    view: memoryview
    snapshot: Snapshot | None = None
    pins: list[object] = field(default_factory=list)  # long readers (collective round, relay)
    ready: Callable[[int], bool] | None = None  # chunk by chunk (a relayed version, relayed.py)
    #: which version each region of the buffer holds (set by ``VersionStore.add``)
    claims: BufferClaims | None = None
    #: the buffer went to a newer snapshot: chunks are served only while ``intact``
    lent: bool = False
    #: announced before its hashes ended (``announce_early``): its sums as they end
    sums: SumFeed | None = None
    # pins and lending under one lock: nothing starts a long read of a lent buffer
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def chunk_ready(self, chunk: int) -> bool:
        """Whether the chunk's bytes are final (the manifest may precede the copy's end)."""
        if self.ready is not None:
            return self.ready(chunk)
        if self.snapshot is None:
            return True
        start, size = self.manifest.chunk_span(chunk)
        snapshot = self.snapshot
        if start + size <= snapshot.copied_bytes:
            return True
        return snapshot.pending is not None and snapshot.pending[chunk] == 0

    @property
    def failed(self) -> bool:
        return self.snapshot is not None and self.snapshot.failed

    def chunk_view(self, chunk: int) -> memoryview:
        """The chunk's bytes in place: check ``intact`` after copying them anywhere."""
        start, size = self.manifest.chunk_span(chunk)
        return self.view[start: start + size]

    def intact(self, chunk: int) -> bool:
        """Whether no newer version has begun to overwrite the chunk: ask after reading it."""
        if self.claims is None:
            return True
        start, size = self.manifest.chunk_span(chunk)
        return self.claims.holds(start, start + size, self.manifest.version)

    def send_begin(self, chunk: int) -> bool:
        """Before ZeroMQ sends the chunk in place (no copy): count the send, so no newer
        snapshot overwrites it meanwhile (``buffer_claims.py``); False if one already has."""
        if self.claims is None:
            return True
        start, size = self.manifest.chunk_span(chunk)
        return self.claims.send_begin(start, start + size, self.manifest.version)

    def send_end(self, chunk: int) -> None:
        """ZeroMQ has sent (or dropped) the frame ``send_begin`` counted."""
        if self.claims is not None:
            start, size = self.manifest.chunk_span(chunk)
            self.claims.send_end(start, start + size)

    def claim(self, start: int, stop: int) -> None:
        """Before writing ``[start, stop)`` of this version (a relay's chunk)."""
        if self.claims is not None:
            self.claims.claim(start, stop, self.manifest.version)

    def pin(self, reader: object) -> bool:
        """Keep the bytes for ``reader`` until ``unpin``; False if the buffer is already lent."""
        with self._lock:
            if self.lent:
                return False
            self.pins.append(reader)
            return True

    def unpin(self, reader: object) -> None:
        with self._lock:
            if reader in self.pins:
                self.pins.remove(reader)

    def lend(self) -> bool:
        """Give the buffer up for a newer snapshot unless a long reader pins it; True if lent."""
        with self._lock:
            if self.lent or self.pins:
                return False
            self.lent = True
            return True


class VersionStore:
    """Thread-safe map version -> PublishedVersion holding at most ``keep`` entries.

    Evicted versions still pinned wait in ``_evicted`` and go back to the pool when
    unpinned (``recycle``); a lent one is already there.
    """

    def __init__(self, keep: int, pool: BufferPool) -> None:
        if keep < 1:
            raise ConfigError(f"keep_versions: {keep} must be >= 1")
        self._keep = keep
        self._pool = pool
        self._claims = ClaimTable()
        self._versions: OrderedDict[int, PublishedVersion] = OrderedDict()
        self._evicted: list[PublishedVersion] = []
        self._lock = threading.Lock()

    @property
    def keep(self) -> int:
        return self._keep

    def claims(self, buffer: torch.Tensor) -> BufferClaims:
        """The claims of ``buffer`` (any view of a pool buffer): a snapshot claims as it copies."""
        return self._claims.of(buffer)

    def writers_waiting(self) -> bool:
        """Whether a snapshot waits for ZeroMQ to finish sending bytes it will overwrite."""
        return self._claims.writers_waiting()

    def make_room(self) -> None:
        """Before a new snapshot takes a buffer: with ``keep`` versions held, lend the
        oldest one's buffer to the pool (unless pinned), so the new copy reuses it.

        The oldest version stays listed (and served chunk by chunk, while intact) until
        the new one is added.
        """
        with self._lock:
            self._recycle_locked()
            if len(self._versions) < self._keep:
                return
            oldest = next(iter(self._versions.values()))
            if oldest.lend():
                self._pool.give(oldest.buffer)

    def add(self, version: PublishedVersion) -> None:
        version.claims = self._claims.of(version.buffer)
        with self._lock:
            self._versions[version.manifest.version] = version
            while len(self._versions) > self._keep:
                _, old = self._versions.popitem(last=False)
                self._evicted.append(old)
            self._recycle_locked()

    def discard(self, version: int) -> bool:
        """Forget a version whose snapshot failed; its buffer goes back to the pool.
        False if it was not held."""
        with self._lock:
            old = self._versions.pop(version, None)
            if old is not None:
                self._evicted.append(old)
            self._recycle_locked()
        return old is not None

    def drop_lent(self, buffer: torch.Tensor) -> tuple[list[int], list[int]]:
        """A snapshot copy into ``buffer`` failed: settle the version that lent it.

        Kept when the failed copy overwrote none of its bytes (every region still holds
        it, ``BufferClaims``): the buffer is its own again and it is served on. Otherwise
        it is no longer whole and is withdrawn (its subscribers get ``version_unavailable``
        and wait for the next version instead of fetching chunks that are gone): with one
        buffer per version held there is nothing to serve it from. Returns (kept,
        withdrawn) version numbers."""
        kept: list[int] = []
        dropped: list[int] = []
        with self._lock:
            for number, held in list(self._versions.items()):
                if not held.lent or held.buffer.data_ptr() != buffer.data_ptr():
                    continue
                claims = held.claims
                if claims is not None and claims.holds(0, held.manifest.total_bytes, number):
                    held.lent = False
                    kept.append(number)
                else:
                    del self._versions[number]
                    dropped.append(number)
        return kept, dropped

    def give_back(self, buffer: torch.Tensor) -> None:
        """A snapshot that failed before it was announced: its buffer goes back to the pool
        (no reader trusts its bytes unchecked)."""
        self._pool.give(buffer)

    def get(self, version: int) -> PublishedVersion | None:
        with self._lock:
            return self._versions.get(version)

    def latest(self) -> PublishedVersion | None:
        with self._lock:
            return next(reversed(self._versions.values()), None)

    def versions(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._versions)

    def retiring(self) -> int:
        """Evicted versions whose buffers long readers still pin."""
        with self._lock:
            return len(self._evicted)

    def recycle(self) -> None:
        """Return evicted buffers no long reader pins any more to the pool."""
        with self._lock:
            self._recycle_locked()

    def _recycle_locked(self) -> None:
        still: list[PublishedVersion] = []
        for old in self._evicted:
            if old.lend():
                self._pool.give(old.buffer)
            elif not old.lent:
                still.append(old)
        self._evicted = still

    def clear(self) -> None:
        with self._lock:
            self._versions.clear()
            self._evicted.clear()
