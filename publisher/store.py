"""The newest K published versions, kept in host memory for slow subscribers.

A chunk reply copies its bytes out of a version's buffer (behind its one-frame
header) while holding the version (``sending``); a buffer is recycled only once
no reader pins it and no tracked frame points into it (``track``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import zmq

from publisher.snapshot import Snapshot
from weightpub_wire.buffers import BufferPool
from weightpub_wire.errors import ConfigError
from weightpub_wire.protocol import Manifest

__all__ = ["PublishedVersion", "VersionStore"]


@dataclass(slots=True)
class PublishedVersion:
    """A manifest plus the bytes it describes; the bytes never change once published."""

    manifest: Manifest
    buffer: torch.Tensor
    view: memoryview
    snapshot: Snapshot | None = None
    trackers: list[zmq.MessageTracker] = field(default_factory=list)
    pins: list[object] = field(default_factory=list)  # readers besides ZeroMQ (delta encoder)
    ready: Callable[[int], bool] | None = None  # chunk by chunk (a relayed version, relayed.py)
    #: set once the buffer went back to the pool: nothing may read it any more
    retired: bool = False
    # the server thread tracks sends and other threads pin while a publish() retires
    # evicted versions: one lock, so no tracker or pin is lost and nothing starts
    # reading a buffer already handed to a newer version
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

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
        start, size = self.manifest.chunk_span(chunk)
        return self.view[start: start + size]

    @contextmanager
    def sending(self) -> Iterator[bool]:
        """Hold while queueing a zero-copy send of these bytes and ``track``-ing it, so the
        buffer cannot be retired in between; yields False once it was retired."""
        with self._lock:
            yield not self.retired

    def track(self, tracker: zmq.MessageTracker) -> None:
        with self._lock:
            if len(self.trackers) > 64:
                self.trackers = [t for t in self.trackers if not t.done]
            self.trackers.append(tracker)

    def pin(self, reader: object) -> bool:
        """Keep the bytes for ``reader`` until ``unpin``; False if they are already gone."""
        with self._lock:
            if self.retired:
                return False
            self.pins.append(reader)
            return True

    def unpin(self, reader: object) -> None:
        with self._lock:
            if reader in self.pins:
                self.pins.remove(reader)

    def retire_if_idle(self) -> bool:
        """Retire the buffer unless a send or a reader still uses it; True if retired."""
        with self._lock:
            self.trackers = [t for t in self.trackers if not t.done]
            if self.trackers or self.pins:
                return False
            self.retired = True
            return True


class VersionStore:
    """Thread-safe map version -> PublishedVersion holding at most ``keep`` entries."""

    def __init__(self, keep: int, pool: BufferPool) -> None:
        if keep < 1:
            raise ConfigError(f"keep_versions: {keep} must be >= 1")
        self._keep = keep
        self._pool = pool
        self._versions: OrderedDict[int, PublishedVersion] = OrderedDict()
        self._evicted: list[PublishedVersion] = []
        self._lock = threading.Lock()

    def add(self, version: PublishedVersion) -> None:
        with self._lock:
            self._versions[version.manifest.version] = version
            while len(self._versions) > self._keep:
                _, old = self._versions.popitem(last=False)
                self._evicted.append(old)
            self._recycle_locked()

    def discard(self, version: int) -> None:
        """Forget a version whose snapshot failed (its buffer is not reused)."""
        with self._lock:
            self._versions.pop(version, None)

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
        """Evicted versions whose buffers are still being read (sends, pins)."""
        with self._lock:
            return len(self._evicted)

    def recycle(self) -> None:
        """Return evicted buffers whose zero-copy sends have all completed to the pool."""
        with self._lock:
            self._recycle_locked()

    def _recycle_locked(self) -> None:
        still: list[PublishedVersion] = []
        for old in self._evicted:
            if old.retire_if_idle():
                self._pool.give(old.buffer)
            else:
                still.append(old)
        self._evicted = still

    def clear(self) -> None:
        with self._lock:
            self._versions.clear()
            self._evicted.clear()
