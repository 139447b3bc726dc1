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

Sends without a copy: the serving thread hands a chunk's bytes to ZeroMQ in place
(``copy=False``), so ZeroMQ reads them *after* the check. Such a send is counted per
region (``send_begin``: count, then check; ``send_end`` once ZeroMQ reports the frame
sent), and a writer waits, after its claim and before its write, until no counted
send is left in the regions it claimed (``claim``). The count goes up before the
check and the claim before the wait, so either the reader sees the claim (and does
not send) or the writer sees the count (and waits): a reply never carries bytes of
two versions. The writer's wait is bounded: a reader that does not read is cut by
the serving thread (``writers_waiting``, ``connection_credit.py``), which frees its
frames; past ``SEND_WAIT`` seconds the write fails with ``TimeoutError``.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

import numpy
import torch

__all__ = ["REGION", "SEND_WAIT", "BufferClaims", "ClaimTable"]

REGION = 64 << 10
log = logging.getLogger("weightpub.publisher")

SEND_WAIT = 60.0  # most seconds a writer waits for ZeroMQ to finish sending a region


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
        #: per region, sends ZeroMQ holds without a copy (changed on the serving thread only)
        self._sending = numpy.zeros(len(self._versions), dtype=numpy.int32)
        #: writers waiting for such sends to end (the serving thread then cuts stalled readers)
        self.writers_waiting = 0

    def claim(self, start: int, stop: int, version: int, wait: float = SEND_WAIT) -> None:
        """Call before writing bytes ``[start, stop)`` of ``version``: returns once no
        send of older bytes there is in flight; ``TimeoutError`` after ``wait`` seconds."""
        if stop <= start:
            return
        regions = slice(start // REGION, -(-stop // REGION))
        self._versions[regions] = version
        if not self._sending[regions].any():
            return
        deadline = time.monotonic() + wait
        pause = 0.0002
        log.debug("version %d waits to write [%d, %d): %d sends in flight there", version,
                  start, stop, int(self._sending[regions].sum()))
        self.writers_waiting += 1
        try:
            while self._sending[regions].any():
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"bytes [{start}, {stop}) of a snapshot buffer were still being sent "
                        f"{wait:.0f}s after version {version} claimed them")
                time.sleep(pause)
                pause = min(pause * 2, 0.005)
        finally:
            self.writers_waiting -= 1

    def send_begin(self, start: int, stop: int, version: int) -> bool:
        """Before handing ``[start, stop)`` to ZeroMQ without a copy (serving thread):
        counts the send if the bytes are still ``version``'s; False (nothing counted) if a
        newer version has claimed them."""
        if stop <= start:
            return True
        regions = slice(start // REGION, -(-stop // REGION))
        self._sending[regions] += 1
        if self.holds(start, stop, version):
            return True
        self._sending[regions] -= 1
        return False

    def send_end(self, start: int, stop: int) -> None:
        """ZeroMQ has let go of a frame counted by ``send_begin``."""
        if stop > start:
            self._sending[start // REGION: -(-stop // REGION)] -= 1

    @property
    def words(self) -> numpy.ndarray:
        """The version per region (int64, one word per ``REGION`` bytes), as a holder offers
        them to one-sided readers (``NixlClaims``): they tell a reused buffer by them."""
        return self._versions

    @property
    def sends_in_flight(self) -> int:
        """Region-sends ZeroMQ holds (a test and a status read it)."""
        return int(self._sending.sum())

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

    def writers_waiting(self) -> bool:
        """Whether a writer waits for ZeroMQ to finish sending some region (any thread)."""
        with self._lock:
            return any(claims.writers_waiting for _, claims in self._table.values())

    def _forget(self, gone: weakref.ref[torch.Tensor]) -> None:
        with self._lock:
            for key, (ref, _) in list(self._table.items()):
                if ref is gone:
                    del self._table[key]
