"""Which version's bytes each region of a snapshot buffer holds: a sequence lock per region.

Why: the publisher keeps ``keep_versions`` snapshot buffers and nothing more, so a
new version is copied over the oldest kept one while that one may still be served
(a subscriber finishing it, a late joiner that has not heard of the new one yet).
A writer ``claim``s each range before it writes it; a reader copies a chunk out
(into a reply's scratch, a delta's encoder) and then asks whether the buffer still
``holds`` its version there. A claim is never undone, so if the check after the
copy still sees the reader's version, no write of another version had started
when the copy ended: the bytes copied are that version's, whole. Otherwise the
reader drops what it copied (a ``version_unavailable`` reply, a raw delta chunk).
Nobody waits: the writer never waits for readers and a reader never sees mixed
bytes.

A region is ``REGION`` bytes; a claim covers every region it touches, so a reader
of the old version may lose a chunk one region early, never late.
"""

from __future__ import annotations

import threading
import weakref

import numpy
import torch

__all__ = ["REGION", "BufferClaims", "ClaimTable"]

REGION = 64 << 10


class BufferClaims:
    """Per region of one buffer: the version whose write reached it last (0: none yet).

    Claims and checks are single numpy stores and loads made while holding the GIL;
    the copies they guard run outside it (``ctypes.memmove``) or inside it, either way
    ordered by the GIL's hand-overs (a claim is stored before its write starts, a check
    is loaded after the read ends).
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._versions = numpy.zeros(max(1, -(-nbytes // REGION)), dtype=numpy.int64)

    def claim(self, start: int, stop: int, version: int) -> None:
        """Call before writing bytes ``[start, stop)`` of ``version``."""
        if stop > start:
            self._versions[start // REGION: -(-stop // REGION)] = version

    def holds(self, start: int, stop: int, version: int) -> bool:
        """Whether no other version has claimed any of ``[start, stop)``: call after reading."""
        if stop <= start:
            return True
        regions = self._versions[start // REGION: -(-stop // REGION)]
        return bool(regions.min() == version == regions.max())


class ClaimTable:
    """One ``BufferClaims`` per live buffer of a pool, found from any view of it.

    Keyed by the base allocation (a pool hands out views of it), so whichever version
    the pool gives a buffer to next shares the claims its old readers check.
    """

    def __init__(self) -> None:
        self._table: dict[int, tuple[weakref.ref[torch.Tensor], BufferClaims]] = {}
        self._lock = threading.RLock()  # a collected buffer's callback may run inside ``of``

    def of(self, buffer: torch.Tensor) -> BufferClaims:
        base = buffer if buffer._base is None else buffer._base
        key = base.data_ptr()
        with self._lock:
            found = self._table.get(key)
            if found is not None and found[0]() is base and found[1].nbytes == base.numel():
                return found[1]
            claims = BufferClaims(base.numel())
            self._table[key] = (weakref.ref(base, self._forget), claims)
            return claims

    def _forget(self, gone: weakref.ref[torch.Tensor]) -> None:
        with self._lock:
            for key, (ref, _) in list(self._table.items()):
                if ref is gone:
                    del self._table[key]
