"""The words a member keeps for peers READing its staging (peers over NIXL,
``docs/peers-over-nixl.md``): per staging buffer a claims word (the newest version
started in it: a peer READing an older one there tells ``reused`` from ``checksum``)
and a readiness map (one word per chunk, the version's number once the chunk verified:
cut-through for a peer READing a version still arriving).

Why apart from ``nixl_source.py``: they are memory of their own, registered with the
member's agent and counted in the staging budget beside the buffers
(``BufferPool.hold``, in ``status()["staging_cache_bytes"]``), as a peer server's
gathered slices are. A word the budget has no room for is not made (the caller offers
without it or not at all). They live as long as their staging buffer: kept across the
versions it holds (a peer may READ a buffer's words after its version completed),
released when the pool drops the buffer (``freed``) or the member closes; at most
``MAX_BUFFERS`` buffers' words are kept (the pool holds 2 buffers, a retired one's go).
Made and READ-marked on the client's thread (the agent is not thread-safe); ``freed``
comes from whichever thread lets the pool drop a buffer, as the staging buffer's own
deregistration does (``NixlPicker.freed``), so the tables are guarded by a lock.
"""

from __future__ import annotations

import collections
import threading

import numpy

from weightpub_wire.buffers import BufferPool
from weightpub_wire.nixl_link import NixlReader

__all__ = ["MAX_BUFFERS", "PeerWords"]

#: staging buffers whose words are kept (a pool of 2 buffers: older ones are gone)
MAX_BUFFERS = 4


class PeerWords:
    """Claims words and readiness maps by staging buffer (its start address)."""

    def __init__(self) -> None:
        #: where the words are counted (None: not counted; tests of the picker alone)
        self.pool: BufferPool | None = None
        self.claims: collections.OrderedDict[int, numpy.ndarray] = collections.OrderedDict()
        self.maps: collections.OrderedDict[int, numpy.ndarray] = collections.OrderedDict()
        self.nbytes = 0  # counted in the pool's budget now
        self.refused = 0  # words not made: no room in the staging budget
        self._lock = threading.Lock()

    def claim(self, reader: NixlReader, address: int, version: int) -> numpy.ndarray | None:
        """Store ``version`` in the buffer's claims word (made, registered and counted
        at its first claim); None where the budget has no room for it."""
        with self._lock:
            return self._claim(reader, address, version)

    def _claim(self, reader: NixlReader, address: int, version: int) -> numpy.ndarray | None:
        words = self.claims.get(address)
        if words is None:
            while len(self.claims) >= MAX_BUFFERS:
                self._drop(reader, self.claims, next(iter(self.claims)))
            words = self._make(reader, 1)
            if words is None:
                return None
            self.claims[address] = words
        words[0] = version
        return words

    def ready_map(self, reader: NixlReader, address: int, count: int) -> numpy.ndarray | None:
        """The buffer's readiness map of at least ``count`` words (made or grown,
        registered and counted here; words keep their versions across versions in the
        buffer); None where the budget has no room for it."""
        with self._lock:
            return self._ready_map(reader, address, count)

    def _ready_map(self, reader: NixlReader, address: int, count: int
                   ) -> numpy.ndarray | None:
        words = self.maps.get(address)
        if words is not None and len(words) >= count:
            return words
        if words is not None:
            self._drop(reader, self.maps, address)
        while len(self.maps) >= MAX_BUFFERS:
            self._drop(reader, self.maps, next(iter(self.maps)))
        words = self._make(reader, max(count, 1))
        if words is not None:
            self.maps[address] = words
        return words

    def verified(self, address: int, chunk: int, version: int) -> None:
        """Chunk ``chunk`` of the version in the buffer at ``address`` is final."""
        with self._lock:
            words = self.maps.get(address)
            if words is not None and chunk < len(words):
                words[chunk] = version

    def claim_of(self, address: int) -> numpy.ndarray | None:
        """The claims word of the buffer at ``address`` (None: not claimed)."""
        with self._lock:
            return self.claims.get(address)

    def freed(self, reader: NixlReader | None, address: int) -> None:
        """The pool dropped the staging buffer at ``address``: its words go too."""
        with self._lock:
            for table in (self.claims, self.maps):
                if address in table:
                    self._drop(reader, table, address)

    def clear(self, reader: NixlReader | None) -> None:
        """Every word goes (the member closes; before its agent does)."""
        with self._lock:
            for table in (self.claims, self.maps):
                while table:
                    self._drop(reader, table, next(iter(table)))

    def _make(self, reader: NixlReader, count: int) -> numpy.ndarray | None:
        nbytes = 8 * count
        if self.pool is not None and not self.pool.hold(nbytes):
            self.refused += 1
            return None
        words = numpy.zeros(count, dtype="<i8")
        try:
            reader.register(words.ctypes.data, words.nbytes)
        except BaseException:
            if self.pool is not None:
                self.pool.unhold(nbytes)
            raise
        self.nbytes += nbytes
        return words

    def _drop(self, reader: NixlReader | None, table: dict[int, numpy.ndarray],
              address: int) -> None:
        words = table.pop(address)
        if reader is not None:
            reader.forget_local(words.ctypes.data, words.nbytes)
        self.nbytes -= words.nbytes
        if self.pool is not None:
            self.pool.unhold(words.nbytes)

    def stats(self) -> dict[str, int]:
        return {"peer_words_bytes": self.nbytes, "peer_words_refused": self.refused}
