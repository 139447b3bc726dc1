"""Consistent host-memory snapshots of a trainer's weights.

``publish()`` must return as soon as the caller may overwrite its weights, so
this module does exactly one copy per tensor into one flat host buffer (pinned
when any tensor is on a GPU) and nothing else; hashing and serving happen on
other threads, over that immutable copy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from publisher.dtypes import dtype_name
from publisher.protocol import TENSOR_ALIGN, TensorEntry

__all__ = [
    "BufferPool",
    "ChunkHasher",
    "Snapshot",
    "gather_full_tensors",
    "named_tensors",
    "take_snapshot",
]

WeightsLike = torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def named_tensors(weights: Any) -> list[tuple[str, torch.Tensor]]:
    """Accept a module (its ``state_dict``), a mapping, or an iterable of pairs."""
    if isinstance(weights, torch.nn.Module):
        items: Iterable[tuple[str, Any]] = weights.state_dict().items()
    elif isinstance(weights, Mapping):
        items = weights.items()
    else:
        items = weights
    result: list[tuple[str, torch.Tensor]] = []
    for pair in items:
        name, tensor = pair
        if not isinstance(name, str) or not name:
            raise TypeError(f"weight names must be non-empty strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        result.append((name, _materialize(tensor)))
    return result


def gather_full_tensors(weights: Any) -> list[tuple[str, torch.Tensor]]:
    """Take part in the ``full_tensor()`` collectives of sharded DTensors without publishing.

    ``DTensor.full_tensor()`` is a collective: when rank 0 calls ``publish()``
    on FSDP/TP-sharded weights, every other rank of the mesh must call this
    with the same weights at the same time, or rank 0 waits forever.
    """
    return named_tensors(weights)


def _materialize(tensor: torch.Tensor) -> torch.Tensor:
    """Gather FSDP/TP DTensors into full tensors; drop autograd."""
    full_tensor = getattr(tensor, "full_tensor", None)
    if callable(full_tensor):
        tensor = full_tensor()
    return tensor.detach()


def plan_layout(pairs: list[tuple[str, torch.Tensor]]) -> tuple[list[TensorEntry], int]:
    """Offsets of each tensor in the flat buffer, aligned so typed views are legal."""
    entries: list[TensorEntry] = []
    seen: set[str] = set()
    offset = 0
    for name, tensor in pairs:
        if name in seen:
            raise ValueError(f"weight name {name!r} appears twice")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(TensorEntry(name=name, dtype=dtype_name(tensor.dtype),
                                   shape=tuple(tensor.shape), offset=offset, nbytes=nbytes))
        offset += -(-nbytes // TENSOR_ALIGN) * TENSOR_ALIGN
    return entries, offset


class BufferPool:
    """Reuses freed snapshot buffers: fresh host memory costs a page fault per 4 KiB."""

    def __init__(self, max_buffers: int = 2) -> None:
        self._free: list[torch.Tensor] = []
        self._max = max_buffers
        self._lock = threading.Lock()

    def take(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        with self._lock:
            for index, buf in enumerate(self._free):
                if buf.numel() >= nbytes and buf.is_pinned() == pinned:
                    return self._free.pop(index)[:nbytes]
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)[:nbytes]

    def give(self, buf: torch.Tensor) -> None:
        base = buf if buf._base is None else buf._base
        with self._lock:
            if len(self._free) < self._max:
                self._free.append(base)


class ChunkHasher:
    """Hashes each chunk on a worker thread as soon as all its bytes are written.

    Overlaps checksumming with the snapshot copy, so a version is ready to
    announce almost as soon as ``publish()`` returns.
    """

    def __init__(self, executor: Executor, buffer: torch.Tensor, total: int,
                 chunk_size: int) -> None:
        self._executor = executor
        self._view = memoryview(buffer.numpy()) if total else memoryview(b"")
        self._total = total
        self._chunk_size = chunk_size
        self._next = 0
        self._futures: list[Future[int]] = []

    def written_up_to(self, offset: int) -> None:
        """Every byte below ``offset`` is final: hash the chunks that lie entirely below it."""
        size = self._chunk_size
        while self._next * size < self._total and \
                min((self._next + 1) * size, self._total) <= offset:
            start = self._next * size
            piece = self._view[start: min(start + size, self._total)]
            self._futures.append(self._executor.submit(xxhash.xxh3_64_intdigest, piece))
            self._next += 1

    def checksums(self) -> tuple[int, ...]:
        self.written_up_to(self._total)
        return tuple(f.result() for f in self._futures)


@dataclass(slots=True)
class Snapshot:
    """An immutable copy of one version's bytes plus where each tensor sits."""

    entries: list[TensorEntry]
    buffer: torch.Tensor  # flat uint8, host memory
    total_bytes: int
    hasher: ChunkHasher


def take_snapshot(weights: Any, pool: BufferPool, executor: Executor,
                  chunk_size: int) -> Snapshot:
    """Copy every tensor once into one flat host buffer and wait for the copies.

    CPU tensors are copied in chunk-sized pieces so the hasher can start on the
    first chunks while later ones are still being copied.
    """
    pairs = named_tensors(weights)
    entries, total = plan_layout(pairs)
    on_gpu = any(t.device.type == "cuda" for _, t in pairs)
    pinned = on_gpu and torch.cuda.is_available()
    buffer = pool.take(total, pinned=pinned)
    hasher = ChunkHasher(executor, buffer, total, chunk_size)
    for index, (entry, (_, tensor)) in enumerate(zip(entries, pairs, strict=True)):
        end = entries[index + 1].offset if index + 1 < len(entries) else total
        buffer[entry.offset + entry.nbytes: end].zero_()  # alignment padding: no stale bytes
        if entry.nbytes == 0:
            continue
        dst = buffer[entry.offset: entry.offset + entry.nbytes]
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            src = tensor.reshape(-1).view(torch.uint8) if tensor.dim() else \
                tensor.reshape(1).view(torch.uint8)
            for start in range(0, entry.nbytes, chunk_size):
                stop = min(start + chunk_size, entry.nbytes)
                dst[start:stop].copy_(src[start:stop])
                hasher.written_up_to(entry.offset + stop)
        else:
            dst.view(tensor.dtype).view(tensor.shape).copy_(
                tensor, non_blocking=tensor.device.type == "cuda")
            if not on_gpu:
                hasher.written_up_to(entry.offset + entry.nbytes)
    if on_gpu:
        torch.cuda.synchronize()
    return Snapshot(entries=entries, buffer=buffer, total_bytes=total, hasher=hasher)
