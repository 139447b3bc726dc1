"""Where a slice plan's bytes sit in one version: per chunk, strided blocks of the flat buffer.

Both sides build the same ``SliceLayout`` from a plan (``slice_plan``) and a manifest:
the publisher gathers each chunk's blocks back to back into one reply (one copy, of
only the planned bytes) and hashes them once per version for ``slice_sums``; the
subscriber hashes the reply as it came and scatters it into its sparse staging
buffer. A block is ``(flat start, length, stride, count)``: ``count`` copies of
``length`` bytes ``stride`` apart, all inside one chunk, so a half-row slice of a
matrix costs one numpy strided copy per chunk, not one per row. Blocks of a chunk are
in ascending flat order, which is the order their bytes travel.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import xxhash

from weightpub_wire.errors import ProtocolError
from weightpub_wire.manifest import Manifest
from weightpub_wire.slice_plan import SlicePlan, run_end

__all__ = ["PAGE", "Block", "SliceLayout"]

PAGE = 4096
Block = tuple[int, int, int, int]  # flat start, length, stride, count


def _rows(array: np.ndarray, start: int, length: int, stride: int, count: int) -> np.ndarray:
    """``count`` rows of ``length`` bytes, ``stride`` apart, from ``start``: a view."""
    if count == 1:
        return array[start: start + length].reshape(1, length)
    return np.lib.stride_tricks.as_strided(array[start:], shape=(count, length),
                                           strides=(stride, 1))


@dataclass(frozen=True, slots=True)
class SliceLayout:
    """A plan's blocks in one version's chunks (``build``), and the copies they drive."""

    chunks: tuple[int, ...]  # the chunks the plan touches, ascending
    blocks: dict[int, list[Block]]
    sizes: dict[int, int]  # planned bytes per touched chunk
    needed_bytes: int
    resident_bytes: int  # pages the planned bytes touch (at most the version, page-rounded)

    @classmethod
    def build(cls, plan: SlicePlan, manifest: Manifest) -> SliceLayout:
        """``ProtocolError`` when the plan names a tensor the version lacks or a run ends
        past its tensor (the plan is for another model)."""
        entries = {entry.name: entry for entry in manifest.tensors}
        size = manifest.chunk_size
        total = manifest.total_bytes
        blocks: dict[int, list[Block]] = {}
        for index, item in enumerate(plan.tensors):
            entry = entries.get(item.tensor)
            if entry is None:
                raise ProtocolError(f"slice_plan.tensors[{index}].tensor: {item.tensor!r} is "
                                    f"not a tensor of version {manifest.version}")
            for number, run in enumerate(item.runs):
                if run_end(run) > entry.nbytes:
                    raise ProtocolError(
                        f"slice_plan.tensors[{index}].runs[{number}]: ends at byte "
                        f"{run_end(run)}, past the {entry.nbytes} bytes of tensor "
                        f"{item.tensor!r}")
                for chunk, block in _split(entry.offset, run, size, total):
                    blocks.setdefault(chunk, []).append(block)
        sizes: dict[int, int] = {}
        resident = 0
        for chunk, found in blocks.items():
            found.sort()
            sizes[chunk] = sum(length * count for _, length, _, count in found)
            resident += sum(_pages(block) for block in found)
        resident = min(resident, -(-total // PAGE) * PAGE)
        return cls(chunks=tuple(sorted(blocks)), blocks=blocks, sizes=sizes,
                   needed_bytes=sum(sizes.values()), resident_bytes=resident)

    def whole(self, manifest: Manifest, chunk: int) -> bool:
        """Whether the plan covers ``chunk`` entirely (its slice is the chunk itself)."""
        return self.sizes.get(chunk) == manifest.chunk_span(chunk)[1]

    def gather(self, chunk: int, version: np.ndarray, out: np.ndarray | None = None,
               ) -> np.ndarray:
        """The plan's bytes of ``chunk``, back to back, copied out of ``version`` (the flat
        buffer as a uint8 array) into ``out`` (a new array if None)."""
        if out is None:
            out = np.empty(self.sizes[chunk], dtype=np.uint8)
        pos = 0
        for start, length, stride, count in self.blocks[chunk]:
            nbytes = length * count
            out[pos: pos + nbytes].reshape(count, length)[...] = \
                _rows(version, start, length, stride, count)
            pos += nbytes
        return out

    def checksum(self, chunk: int, version: np.ndarray, scratch: np.ndarray) -> int:
        """xxh3-64 of the plan's bytes of ``chunk`` (``scratch``: at least a chunk)."""
        size = self.sizes[chunk]
        return xxhash.xxh3_64_intdigest(self.gather(chunk, version, scratch[:size]).data)

    def scatter(self, chunk: int, payload: np.ndarray, target: np.ndarray, *,
                chunk_start: int | None = None) -> None:
        """Write a reply's bytes into ``target`` (the flat staging buffer) where the plan
        says. ``chunk_start`` None: ``payload`` is the gathered slice; else it is the whole
        chunk (a fallback) starting at that flat offset, and only planned bytes are taken."""
        pos = 0
        for start, length, stride, count in self.blocks[chunk]:
            if chunk_start is None:
                rows = payload[pos: pos + length * count].reshape(count, length)
                pos += length * count
            else:
                rows = _rows(payload, start - chunk_start, length, stride, count)
            _rows(target, start, length, stride, count)[...] = rows


def _split(tensor_offset: int, run: tuple[int, int, int, int], size: int,
           total: int) -> Iterable[tuple[int, Block]]:
    """A run's bytes cut at chunk boundaries: (chunk, block) with every block in one chunk."""
    offset, length, stride, count = run
    base = tensor_offset + offset
    if count == 1:
        stride = length
    end = base + (count - 1) * stride + length
    for chunk in range(base // size, (end - 1) // size + 1):
        low = chunk * size
        high = min(low + size, total)
        first = max(0, (low - base - length) // stride + 1)  # first row ending past low
        last = min(count - 1, (high - base - 1) // stride)  # last row starting before high
        if first > last:
            continue  # the chunk falls between two rows
        tail: Block | None = None
        start = base + first * stride
        if start < low:  # a row that began in an earlier chunk
            yield chunk, (low, min(start + length, high) - low, 0, 1)
            first += 1
        if first <= last:
            start = base + last * stride
            if start + length > high:  # a row that goes on into the next chunk
                tail = (start, high - start, 0, 1)
                last -= 1
        if first <= last:
            rows = last - first + 1
            yield chunk, (base + first * stride, length, stride if rows > 1 else 0, rows)
        if tail is not None:
            yield chunk, tail


def _pages(block: Block) -> int:
    start, length, stride, count = block
    span_end = start + (count - 1) * stride + length
    span = ((span_end - 1) // PAGE - start // PAGE + 1) * PAGE
    if count == 1:
        return span
    return min(span, count * (length // PAGE + 2) * PAGE)
