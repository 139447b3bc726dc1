"""Flat byte buffers: one pool both sides recycle, and zero-copy views of them.

Why a pool: fresh host memory costs a page fault per 4 KiB (about 0.5 s/GB
here), so a publisher's snapshot buffers and a subscriber's staging buffers
are reused from one version to the next.
"""

from __future__ import annotations

import threading
from typing import Any, cast

import torch

__all__ = ["BufferPool", "byte_view", "flat_bytes"]


class BufferPool:
    """Keeps up to ``max_buffers`` freed flat uint8 buffers and hands out the best fit.

    ``pinned`` (default: whether CUDA is available) pins new buffers so host <->
    device copies run at full PCIe speed; ``take(..., pinned=)`` overrides it.
    Page-locked memory cannot be swapped or reclaimed, so a buffer larger than
    ``max_pinned_bytes`` is never pinned (a peer announcing a huge version gets,
    at most, pageable memory within the receiver's ``Limits``).
    """

    def __init__(self, max_buffers: int = 2, *, pinned: bool | None = None,
                 max_pinned_bytes: int | None = None) -> None:
        self._free: list[torch.Tensor] = []
        self._max = max_buffers
        self._pinned = torch.cuda.is_available() if pinned is None else pinned
        self.max_pinned_bytes = max_pinned_bytes
        self._lock = threading.Lock()

    def will_pin(self, nbytes: int, pinned: bool | None = None) -> bool:
        """Whether ``take(nbytes, pinned=pinned)`` returns page-locked memory."""
        pin = self._pinned if pinned is None else pinned
        return pin and (self.max_pinned_bytes is None or nbytes <= self.max_pinned_bytes)

    def take(self, nbytes: int, *, pinned: bool | None = None) -> torch.Tensor:
        """A flat uint8 buffer of exactly ``nbytes`` (a view of a maybe larger one)."""
        pin = self.will_pin(nbytes, pinned)
        with self._lock:
            best = None
            for index, buf in enumerate(self._free):
                if buf.numel() >= nbytes and buf.is_pinned() == pin and (
                        best is None or buf.numel() < self._free[best].numel()):
                    best = index
            if best is not None:
                return self._free.pop(best)[:nbytes]
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)[:nbytes]

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from ``take`` (its whole allocation is kept)."""
        base = buf if buf._base is None else buf._base
        with self._lock:
            if len(self._free) < self._max and not any(b is base for b in self._free):
                self._free.append(base)


def byte_view(buffer: torch.Tensor, nbytes: int | None = None) -> memoryview:
    """A memoryview of a flat uint8 CPU tensor (empty when ``nbytes`` is 0), no copy."""
    if nbytes == 0 or buffer.numel() == 0:
        return memoryview(b"")
    return memoryview(cast(Any, buffer.numpy()))


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes as a flat uint8 view (0-d included), no copy."""
    return (tensor.reshape(-1) if tensor.dim() else tensor.reshape(1)).view(torch.uint8)
