"""The chunk size of a version the publisher was given no ``chunk_size`` for.

Why it follows the version's size: with peer sharing, a member forwards a chunk
only once it holds all of it, and sends it to its F children at B/F each, so
every tree level adds about F·c/B to the last chunk; the tail is about L·F·c/S
of one transfer (L levels, S the version). One fixed 4 MiB chunk made a 48 MiB
version at 16 hosts 1.9x one host (1 MiB: 1.4x; docs/benchmarks.md, issue 22.5).
At least ``MIN_CHUNKS`` chunks per version bound that tail whatever the size,
while large versions keep ``LARGEST`` chunks (fewer requests, replies and
checksums per byte). A power of two keeps every chunk a divisor of any
collective bucket that is a multiple of ``LARGEST``, and the same total always
gets the same size, so consecutive versions of one model can be deltas.
"""

from __future__ import annotations

__all__ = ["LARGEST", "MIN_CHUNKS", "SMALLEST", "adaptive_chunk_size", "chunk_size_for"]

#: chunks per version at least, unless that would make chunks smaller than SMALLEST
MIN_CHUNKS = 64
SMALLEST = 256 << 10
LARGEST = 4 << 20


def adaptive_chunk_size(total_bytes: int) -> int:
    """The largest power of two in [``SMALLEST``, ``LARGEST``] that cuts ``total_bytes``
    into at least ``MIN_CHUNKS`` chunks (``SMALLEST`` when even that gives fewer)."""
    if total_bytes < 0:
        raise ValueError(f"total_bytes {total_bytes} is negative")
    # ceil(total / c) >= MIN_CHUNKS  <=>  c <= (total - 1) // (MIN_CHUNKS - 1)
    share = max((total_bytes - 1) // (MIN_CHUNKS - 1), 1)
    return min(LARGEST, max(SMALLEST, 1 << (share.bit_length() - 1)))


def chunk_size_for(explicit: int | None, total_bytes: int) -> int:
    """``explicit`` when the user set one, else the size adaptive to ``total_bytes``."""
    return explicit if explicit is not None else adaptive_chunk_size(total_bytes)
