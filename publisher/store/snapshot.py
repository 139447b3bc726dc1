"""Consistent host-memory snapshots of a trainer's weights.

``publish()`` must return as soon as the caller may overwrite its weights, so
this module does exactly one copy per tensor into one flat host buffer (pinned
when any tensor is on a GPU) and nothing else; hashing and serving happen on
other threads, over that immutable copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from weightpub_wire.buffers import BufferPool, byte_view, copy_bytes, flat_bytes
from weightpub_wire.checksums import COPY_BLOCK, chunk_checksum
from weightpub_wire.chunk_order import priority_tensors
from weightpub_wire.dtypes import dtype_name
from weightpub_wire.manifest import chunks_of
from weightpub_wire.protocol import TENSOR_ALIGN, TensorEntry

__all__ = [
    "ChunkHasher",
    "Snapshot",
    "WeightsLike",
    "checked_pair",
    "copy_hash",
    "copy_in_priority_order",
    "copy_into",
    "cuda_devices",
    "hashable_in_place",
    "named_tensors",
    "plan_snapshot",
    "source_chunks",
    "tell_sum",
    "wait_for_copies",
    "whole_chunks",
]

WeightsLike = torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def named_tensors(weights: WeightsLike) -> list[tuple[str, torch.Tensor]]:
    """Accept a module (its ``state_dict``), a mapping, or an iterable of pairs."""
    if isinstance(weights, torch.nn.Module):
        items: Iterable[tuple[str, Any]] = weights.state_dict().items()
    elif isinstance(weights, Mapping):
        items = weights.items()
    else:
        items = weights
    result: list[tuple[str, torch.Tensor]] = []
    for pair in items:
        name, tensor = checked_pair(pair)
        result.append((name, _materialize(tensor)))
    return result


def checked_pair(pair: Any) -> tuple[str, torch.Tensor]:
    """One (name, tensor) of a user's weights, or a ``TypeError`` saying what it was."""
    name, tensor = pair
    if not isinstance(name, str) or not name:
        raise TypeError(f"weight names must be non-empty strings, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    return name, tensor


def _materialize(tensor: torch.Tensor) -> torch.Tensor:
    """Gather FSDP/TP DTensors into full tensors; drop autograd.

    ``publish()`` sends sharded weights through ``publisher/sources/streamed_copy.py``
    (one layer group at a time); this whole-tensor gather serves direct callers.
    """
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


class ChunkHasher:
    """Hashes each chunk on a worker thread as soon as all its bytes are written.

    Used when the sources cannot be hashed in place (GPU or non-contiguous
    tensors): checksumming then overlaps the copy instead of following it.
    """

    def __init__(self, executor: Executor, buffer: torch.Tensor, total: int,
                 chunk_size: int, on_sum: Callable[[int, int], None] | None = None) -> None:
        """``on_sum(chunk, sum)``: told each chunk's sum as its hash ends (early sums)."""
        self._executor = executor
        self._on_sum = on_sum
        self._view = byte_view(buffer, total)
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
            future = self._executor.submit(chunk_checksum, piece)
            if self._on_sum is not None:
                future.add_done_callback(functools.partial(tell_sum, self._on_sum, self._next))
            self._futures.append(future)
            self._next += 1

    def checksums(self) -> tuple[int, ...]:
        self.written_up_to(self._total)
        return tuple(f.result() for f in self._futures)


def tell_sum(on_sum: Callable[[int, int], None], chunk: int, future: Future[int]) -> None:
    """A hash's done-callback: ``on_sum(chunk, sum)`` once it ended well (a failed or
    cancelled hash tells nothing: the version is then never complete)."""
    if not future.cancelled() and future.exception() is None:
        on_sum(chunk, future.result())


def source_chunks(pairs: list[tuple[str, torch.Tensor]], entries: list[TensorEntry],
                  total: int, chunk_size: int) -> list[list[memoryview]]:
    """The flat layout's chunks as lists of slices of the source tensors (and zero padding).

    Hashing these gives the same checksums as hashing the finished snapshot
    (its padding is zeroed too), without waiting for the copy: the manifest
    can go out while the copy is still running.
    """
    chunks: list[list[memoryview]] = [[]]
    filled = 0
    zeros = memoryview(bytes(TENSOR_ALIGN))

    def feed(view: memoryview) -> None:
        nonlocal filled
        while len(view):
            if filled == chunk_size:
                chunks.append([])
                filled = 0
            take = min(len(view), chunk_size - filled)
            chunks[-1].append(view[:take])
            view = view[take:]
            filled += take

    for index, (entry, (_, tensor)) in enumerate(zip(entries, pairs, strict=True)):
        if entry.nbytes:
            feed(byte_view(flat_bytes(tensor)))
        end = entries[index + 1].offset if index + 1 < len(entries) else total
        feed(zeros[: end - entry.offset - entry.nbytes])
    return chunks if total else []


@dataclass(slots=True)
class Snapshot:
    """One version's bytes in a flat host buffer, plus where each tensor sits.

    ``copied_bytes`` grows while the copy runs: every byte below it is final,
    so chunks below it may already be served.
    """

    entries: list[TensorEntry]
    buffer: torch.Tensor  # flat uint8, host memory
    total_bytes: int
    copied_bytes: int = 0
    failed: bool = False
    #: bytes of each chunk not yet final, when the copy runs out of layout order
    pending: list[int] | None = None
    #: told ``(start, stop)`` before those bytes are written: the buffer may still hold
    #: an older version being served (``publisher/store/buffer_claims.py``)
    claim: Callable[[int, int], None] | None = None

    def claim_range(self, start: int, stop: int) -> None:
        if self.claim is not None:
            self.claim(start, stop)


def plan_snapshot(weights: WeightsLike, pool: BufferPool,
                  admit: Callable[[int], None] | None = None,
                  ) -> tuple[Snapshot, list[tuple[str, torch.Tensor]]]:
    """Lay the version out and take a buffer for it; nothing is copied yet.

    ``admit`` is told the version's bytes before the buffer is taken (and may refuse).
    """
    pairs = named_tensors(weights)
    entries, total = plan_layout(pairs)
    if admit is not None:
        admit(total)
    pinned = torch.cuda.is_available() and any(t.device.type == "cuda" for _, t in pairs)
    return Snapshot(entries=entries, buffer=pool.take(total, pinned=pinned),
                    total_bytes=total), pairs


def hashable_in_place(pairs: list[tuple[str, torch.Tensor]]) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for _, t in pairs)


def whole_chunks(entries: list[TensorEntry], total: int, chunk_size: int) -> set[int]:
    """The chunks that lie wholly inside one tensor's bytes (no padding, no other tensor):
    ``copy_in_priority_order(on_sum=...)`` copies and hashes each in one pass."""
    whole: set[int] = set()
    for entry in entries:
        for chunk in chunks_of(entry, chunk_size):
            if _whole(chunk, entry, total, chunk_size):
                whole.add(chunk)
    return whole


def _whole(chunk: int, entry: TensorEntry, total: int, chunk_size: int) -> bool:
    """Whether ``chunk`` lies wholly inside ``entry``'s bytes (``whole_chunks``' test)."""
    start = chunk * chunk_size
    return entry.offset <= start and min(start + chunk_size, total) <= entry.offset + entry.nbytes


def copy_hash(dst: torch.Tensor, src: torch.Tensor, block: int = COPY_BLOCK) -> int:
    """Copy one flat uint8 tensor into another and return xxh3-64 of the bytes: each
    ``block`` hashed right after it is copied, still in the cache (one pass over memory;
    ``copy_bytes`` per block, so the GIL is free during the copies)."""
    state = xxhash.xxh3_64()
    view = byte_view(dst)
    size = dst.numel()
    for start in range(0, size, block):
        stop = min(start + block, size)
        copy_bytes(dst[start:stop], src[start:stop])
        state.update(view[start:stop])
    return state.intdigest()


def copy_in_priority_order(snapshot: Snapshot, pairs: list[tuple[str, torch.Tensor]],
                           chunk_size: int,
                           on_sum: Callable[[int, int], None] | None = None) -> None:
    """Copy CPU tensors in ``chunk_order`` (largest first), marking each chunk final.

    Subscribers fetch in the same order, so what they ask for first is copied first;
    the server sends a chunk once ``pending`` says all its bytes are final. ``on_sum``
    (early sums): each chunk wholly inside one tensor is copied and hashed in one pass
    (``copy_hash``) and told ``(chunk, sum)``; the others are hashed elsewhere.
    """
    buffer, entries, total = snapshot.buffer, snapshot.entries, snapshot.total_bytes
    pending = [min(chunk_size, total - start) for start in range(0, total, chunk_size)]
    snapshot.pending = pending

    def done(start: int, stop: int) -> None:
        while start < stop:
            chunk = start // chunk_size
            end = min(stop, (chunk + 1) * chunk_size)
            pending[chunk] -= end - start  # one GIL-held store: the server reads it
            start = end

    for index in priority_tensors(entries, total):
        entry, (_, tensor) = entries[index], pairs[index]
        end = entries[index + 1].offset if index + 1 < len(entries) else total
        snapshot.claim_range(entry.offset + entry.nbytes, end)
        buffer[entry.offset + entry.nbytes: end].zero_()  # alignment padding: no stale bytes
        done(entry.offset + entry.nbytes, end)
        if entry.nbytes and on_sum is not None:
            _copy_hashing(snapshot, entry, flat_bytes(tensor), chunk_size, on_sum, done)
        elif entry.nbytes:
            dst = buffer[entry.offset: entry.offset + entry.nbytes]
            src = flat_bytes(tensor)
            for start in range(0, entry.nbytes, chunk_size):
                stop = min(start + chunk_size, entry.nbytes)
                snapshot.claim_range(entry.offset + start, entry.offset + stop)
                copy_bytes(dst[start:stop], src[start:stop])
                done(entry.offset + start, entry.offset + stop)
    first = entries[0].offset if entries else total
    done(0, first)
    snapshot.copied_bytes = total


def _copy_hashing(snapshot: Snapshot, entry: TensorEntry, src: torch.Tensor, chunk_size: int,
                  on_sum: Callable[[int, int], None],
                  done: Callable[[int, int], None]) -> None:
    """One tensor in chunk-aligned pieces: a whole chunk copied and hashed in one pass."""
    total, buffer = snapshot.total_bytes, snapshot.buffer
    position, end = entry.offset, entry.offset + entry.nbytes
    while position < end:
        chunk = position // chunk_size
        chunk_end = min((chunk + 1) * chunk_size, total)
        stop = min(end, chunk_end)
        snapshot.claim_range(position, stop)
        dst, piece = buffer[position:stop], src[position - entry.offset: stop - entry.offset]
        if _whole(chunk, entry, total, chunk_size):  # then [position, stop) is the chunk
            value = copy_hash(dst, piece)
            done(position, stop)
            on_sum(chunk, value)
        else:
            copy_bytes(dst, piece)
            done(position, stop)
        position = stop


def copy_into(snapshot: Snapshot, pairs: list[tuple[str, torch.Tensor]], chunk_size: int,
              on_progress: Callable[[int], None] | None = None) -> None:
    """Copy every tensor once into the snapshot buffer, advancing ``copied_bytes``.

    CPU tensors go in chunk-sized pieces so readers (the server, a hasher) can
    start on the first chunks while later ones are still being copied.
    """
    buffer, entries, total = snapshot.buffer, snapshot.entries, snapshot.total_bytes
    devices = cuda_devices(t.device for _, t in pairs)
    on_gpu = bool(devices)
    for index, (entry, (_, tensor)) in enumerate(zip(entries, pairs, strict=True)):
        end = entries[index + 1].offset if index + 1 < len(entries) else total
        snapshot.claim_range(entry.offset + entry.nbytes, end)
        buffer[entry.offset + entry.nbytes: end].zero_()  # alignment padding: no stale bytes
        dst = buffer[entry.offset: entry.offset + entry.nbytes]
        if entry.nbytes and tensor.device.type == "cpu" and tensor.is_contiguous():
            src = flat_bytes(tensor)
            for start in range(0, entry.nbytes, chunk_size):
                stop = min(start + chunk_size, entry.nbytes)
                snapshot.claim_range(entry.offset + start, entry.offset + stop)
                copy_bytes(dst[start:stop], src[start:stop])
                _advance(snapshot, entry.offset + stop, on_progress)
        elif entry.nbytes:
            snapshot.claim_range(entry.offset, entry.offset + entry.nbytes)
            dst.view(tensor.dtype).view(tensor.shape).copy_(
                tensor, non_blocking=tensor.device.type == "cuda")
        if not on_gpu:
            _advance(snapshot, end, on_progress)
    if on_gpu:
        wait_for_copies(devices)
    _advance(snapshot, total, on_progress)


def cuda_devices(devices: Iterable[torch.device]) -> list[torch.device]:
    """Every CUDA device among ``devices``, once each, in the order first seen.

    Why: a device-to-host copy runs on the current stream of the *source's*
    device, so the copies of a model spread over ``cuda:0`` and ``cuda:1`` end
    only when both devices' streams reach them; ``torch.cuda.synchronize()``
    waits for the current device alone.
    """
    seen: list[torch.device] = []
    for device in devices:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            found = torch.device("cuda", index)
            if found not in seen:
                seen.append(found)
    return seen


def wait_for_copies(devices: list[torch.device]) -> None:
    """Wait until every copy queued so far on each device's current stream is done
    (an event per device: later work on those streams, a training step, is not
    waited for)."""
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    for event in events:
        event.synchronize()


def _advance(snapshot: Snapshot, offset: int, on_progress: Callable[[int], None] | None) -> None:
    snapshot.copied_bytes = offset
    if on_progress is not None:
        on_progress(offset)
