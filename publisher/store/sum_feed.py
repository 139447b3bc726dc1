"""A version's chunk checksums as their hashes end (``announce_early``, issue 29).

With ``announce_early`` the manifest goes out before the snapshot is hashed; the hashing
workers put each chunk's sum here as it ends and the serving thread hands them on in
that order (``weightpub_wire.sum_messages``: a subscriber asks for the ones after the
first ``have``). Append-only under one lock: writers are the hashing workers, the
reader the serving thread.
"""

from __future__ import annotations

import threading

__all__ = ["SumFeed"]


class SumFeed:
    """Per chunk its xxh3-64 sum, in the order the hashes ended."""

    def __init__(self, num_chunks: int) -> None:
        self.num_chunks = num_chunks
        self._lock = threading.Lock()
        self._chunks: list[int] = []
        self._sums: list[int] = []
        self._by_chunk: list[int | None] = [None] * num_chunks

    def put(self, chunk: int, value: int) -> None:
        """Chunk ``chunk``'s sum is ``value`` (a second put of a chunk is ignored)."""
        with self._lock:
            if self._by_chunk[chunk] is None:
                self._by_chunk[chunk] = value
                self._chunks.append(chunk)
                self._sums.append(value)

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def complete(self) -> bool:
        return len(self._chunks) == self.num_chunks

    def since(self, have: int, limit: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The chunks and sums after the first ``have`` (at most ``limit``)."""
        with self._lock:
            end = min(len(self._chunks), have + limit)
            return tuple(self._chunks[have:end]), tuple(self._sums[have:end])

    def checksums(self) -> tuple[int, ...]:
        """Every chunk's sum in chunk order (once ``complete``)."""
        with self._lock:
            if len(self._chunks) != self.num_chunks:
                raise RuntimeError(f"{len(self._chunks)} of {self.num_chunks} sums in")
            return tuple(v for v in self._by_chunk if v is not None)
