"""Staging buffers in shared memory: one copy of a version that every local rank maps.

Why memfd (``memfd_create``) rather than files in ``/dev/shm``: the memory has
no name anywhere, so nothing can leak when a process is ``kill -9``-ed; the
kernel frees it when the last process holding its file descriptor or a mapping
of it exits. It is also not bounded by the size of ``/dev/shm`` (64 MiB in a
default Docker container). Other ranks get the descriptor over the node
channel (``SCM_RIGHTS``, see ``node_channel.py``) and map it read-only, so a
stray write on one rank faults instead of corrupting every rank's weights.

The owner's ``SharedSegments`` is an ``Allocator`` for ``weightpub_wire.buffers.BufferPool``:
the pool decides when a buffer is reused or dropped; ``free`` closes the
descriptor and tells the other ranks to drop their mapping too.
Each mapping shows up in ``/proc/<pid>/maps`` as ``/memfd:weightpub-stage-<label>``.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weightpub_wire.buffers import (
    Register,
    Unregister,
    cuda_host_register,
    cuda_host_unregister,
    page_locked,
)

__all__ = ["MEMFD_PREFIX", "Segment", "SharedSegments", "map_segment"]

MEMFD_PREFIX = "weightpub-stage-"


@dataclass(frozen=True, slots=True)
class Segment:
    """One shared staging buffer: its id on this node, descriptor and size."""

    segment_id: int
    fd: int
    nbytes: int


class SharedSegments:
    """Allocator of memfd-backed staging buffers (owner side).

    ``on_free(segment_id)`` runs when the pool drops a buffer, from whichever
    thread gave it back (the node owner forwards it to the other ranks).
    """

    def __init__(self, label: str, on_free: Callable[[int], None] | None = None, *,
                 register: Register = cuda_host_register,
                 unregister: Unregister = cuda_host_unregister) -> None:
        self.name = (MEMFD_PREFIX + label)[:240]
        self.on_free = on_free
        self._register = register
        self._unregister = unregister
        self._ids = itertools.count(1)
        self._by_ptr: dict[int, Segment] = {}
        self._lock = threading.Lock()

    def allocate(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        """A new shared buffer of exactly ``nbytes``; ``pinned``: page-locked in this
        process while any view of it lives (``weightpub_wire.buffers.page_locked``)."""
        fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        if pinned:
            buffer = page_locked(mapping, nbytes, self._register, self._unregister)
        else:
            buffer = torch.frombuffer(mapping, dtype=torch.uint8)  # unmapped with its last view
        with self._lock:
            self._by_ptr[buffer.data_ptr()] = Segment(next(self._ids), fd, nbytes)
        return buffer

    def free(self, key: int) -> None:
        with self._lock:
            segment = self._by_ptr.pop(key, None)
        if segment is None:
            return
        os.close(segment.fd)
        if self.on_free is not None:
            self.on_free(segment.segment_id)

    def segment_of(self, buffer: torch.Tensor) -> Segment | None:
        """The segment a buffer (or a view starting at its first byte) lives in."""
        with self._lock:
            return self._by_ptr.get(buffer.data_ptr())

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._by_ptr.values())

    def close(self) -> None:
        """Close every descriptor; memory lives on while any view or other rank maps it."""
        with self._lock:
            segments, self._by_ptr = list(self._by_ptr.values()), {}
        for segment in segments:
            os.close(segment.fd)


def map_segment(fd: int, nbytes: int) -> torch.Tensor:
    """Map a received segment read-only (pages populated now, off the step path).

    The returned flat uint8 tensor keeps the mapping alive; ``fd`` may be closed.
    """
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                        prot=mmap.PROT_READ)
    with warnings.catch_warnings():  # read-only on purpose: a write must fault, not corrupt
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapping, dtype=torch.uint8)
