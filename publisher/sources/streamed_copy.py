"""Publishing a streamed plan: the snapshot's buffer, then gather, copy, drop, group by group.

The publishing rank (``plan_version``, then ``copy_streamed``) and every other
rank (``gather_full_tensors``) run the same gathers in the same order, so a
rank's extra memory is about one group (the gather's own buffers at most double
it). Every failure still walks every group: the other ranks are already in
those collectives, and a rank that left them would leave the rest waiting.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from publisher.sources.streamed_plan import Group, PublishSource, StreamedPairs, plan_streamed
from publisher.store.snapshot import (
    Snapshot,
    cuda_devices,
    plan_layout,
    plan_snapshot,
    wait_for_copies,
)
from weightpub_wire.buffers import BufferPool, copy_bytes, flat_bytes
from weightpub_wire.dtypes import dtype_name
from weightpub_wire.errors import ConfigError

__all__ = ["copy_streamed", "gather_full_tensors", "plan_version"]


def plan_version(weights: PublishSource, pool: BufferPool,
                 admit: Callable[[int], None] | None = None,
                 ) -> tuple[Snapshot, list[tuple[str, torch.Tensor]]]:
    """``plan_snapshot``, streamed when ``weights`` is sharded or a ``WeightSource``.

    Streamed, nothing is gathered yet: the layout comes from global shapes. When
    the budget refuses (or anything else fails before the copy), every group is
    still gathered and dropped: the other ranks are already in those collectives.
    """
    planned = plan_streamed(weights)
    if not isinstance(planned, StreamedPairs):
        return plan_snapshot(planned, pool, admit)
    try:
        if planned.missing:
            raise ConfigError(f"the publishing rank must hold every parameter; its groups "
                              f"leave out {len(planned.missing)}, e.g. {planned.missing[0]!r}")
        entries, total = plan_layout(planned)
        if admit is not None:
            admit(total)
        buffer = pool.take(total, pinned=planned.pinned)
    except BaseException:
        planned.drain()
        raise
    return Snapshot(entries=entries, buffer=buffer, total_bytes=total), planned


def copy_streamed(snapshot: Snapshot, pairs: StreamedPairs, chunk_size: int,
                  on_progress: Callable[[int], None] | None = None) -> None:
    """Gather each group, copy it into the snapshot, drop it; advance ``copied_bytes``.

    Every byte up to the end of a group is final once the group is copied (a
    device copy is waited for first), so ``on_progress`` (a ``ChunkHasher``)
    hashes behind the copy. A group that does not match the plan is an error
    raised after the remaining groups are gathered, so no rank waits forever.
    """
    entries = snapshot.entries
    error: Exception | None = None
    start = 0
    groups = pairs.groups()
    while (group := next(groups, None)) is not None:
        if error is None:
            try:
                end = _copy_group(snapshot, start, group, chunk_size)
            except Exception as exc:  # keep the collectives in step, raise at the end
                error = exc
            else:
                _advance(snapshot, end, on_progress)
        start += len(group[0])
        del group  # freed before the next gather
    if error is None and start != len(entries):
        error = ConfigError(f"the weight source yielded {start} tensors, its metadata "
                            f"declared {len(entries)}")
    if error is not None:
        raise error
    _advance(snapshot, snapshot.total_bytes, on_progress)


def gather_full_tensors(weights: PublishSource) -> None:
    """Take part in the publishing rank's gathers without publishing, one group at a time.

    ``DTensor.full_tensor()`` is a collective: when rank 0 calls ``publish()``
    on FSDP/TP-sharded weights (or a ``WeightSource``), every other rank of the
    mesh must call this with the same weights at the same time, or rank 0 waits
    forever. Each group is gathered and dropped before the next, in the order
    rank 0 copies them, so this rank never holds more than one group.
    Weights with nothing to gather return at once.
    """
    planned = plan_streamed(weights)
    if isinstance(planned, StreamedPairs):
        planned.drain()


def _copy_group(snapshot: Snapshot, start: int, group: Group, chunk_size: int) -> int:
    """Copy one group's tensors to their planned places; return the end of its bytes.

    Each range is claimed before it is written: the buffer may still hold an
    older version being served (``publisher/store/buffer_claims.py``).
    """
    buffer, entries, total = snapshot.buffer, snapshot.entries, snapshot.total_bytes
    names, tensors = group
    planned = entries[start:start + len(names)]
    if [e.name for e in planned] != list(names):
        raise ConfigError(f"the weight source yielded {list(names)[:3]}... where the plan "
                          f"has {[e.name for e in planned][:3]}...: groups out of order")
    for entry, tensor in zip(planned, tensors, strict=True):
        if tensor is None:
            raise ConfigError(f"the publishing rank must hold every parameter; it holds no "
                              f"{entry.name!r}")
        if tuple(tensor.shape) != tuple(entry.shape) or \
                dtype_name(tensor.dtype) != entry.dtype:
            raise ConfigError(f"{entry.name!r}: yielded {tuple(tensor.shape)} "
                              f"{tensor.dtype}, declared {tuple(entry.shape)} {entry.dtype}")
    index = start
    for entry, tensor in zip(planned, tensors, strict=True):
        index += 1
        end = entries[index].offset if index < len(entries) else total
        snapshot.claim_range(entry.offset, end)
        buffer[entry.offset + entry.nbytes: end].zero_()  # alignment padding: no stale bytes
        if not entry.nbytes:
            continue
        dst = buffer[entry.offset: entry.offset + entry.nbytes]
        source = tensor.detach()
        if source.device.type == "cpu" and source.is_contiguous():
            src = flat_bytes(source)
            for piece in range(0, entry.nbytes, chunk_size):
                stop = min(piece + chunk_size, entry.nbytes)
                copy_bytes(dst[piece:stop], src[piece:stop])
        else:
            dst.view(source.dtype).view(source.shape).copy_(
                source, non_blocking=source.device.type == "cuda")
    devices = cuda_devices(t.device for t in tensors)
    if devices:
        wait_for_copies(devices)  # the group is freed and hashed next
    return entries[index].offset if index < len(entries) else total


def _advance(snapshot: Snapshot, offset: int, on_progress: Callable[[int], None] | None) -> None:
    snapshot.copied_bytes = offset
    if on_progress is not None:
        on_progress(offset)
