"""A slice plan on the wire: which bytes of each published tensor one receiver needs.

Why its own type: a replica rank (issue 30) fetches only the bytes its weight
loaders read; the subscriber registers its plan with the publisher once and then
names it by ``digest`` in every slice request (``weightpub_wire.slice_messages``).
A plan is per model *layout*, not per version: it holds tensor names and byte
offsets within each tensor, never flat offsets, so it stays valid while versions
of the same model follow.

Runs are strided so that a row-parallel slice (the first half of every row of a
matrix) is one run per matrix instead of one per row::

    SliceRuns(tensor, [(offset, length, stride, count), ...])
        count copies of ``length`` bytes, the i-th at ``offset + i * stride``
        (``stride`` 0 when ``count`` is 1), offsets within the tensor's bytes

Rules checked while decoding (``decode_plan``; a ``ProtocolError`` names the
tensor and the run): at most ``MAX_PLAN_TENSORS`` tensors and ``MAX_PLAN_RUNS``
runs in all, no tensor twice, every run non-empty, the copies of one run not
overlapping (``stride >= length``), runs of a tensor in ascending order and not
overlapping. That a run ends inside its tensor needs the tensor's size: the
manifest's, ``weightpub_wire.slice_layout.SliceLayout.build`` checks it per version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Annotated

import msgspec
from msgspec import Meta

from weightpub_wire.errors import ProtocolError
from weightpub_wire.message_base import U63, Name, Text

__all__ = ["MAX_PLAN_BYTES", "MAX_PLAN_RUNS", "MAX_PLAN_TENSORS", "Run", "SlicePlan",
           "SliceRuns", "decode_plan", "encode_plan", "from_ranges", "needed_bytes",
           "run_end"]

MAX_PLAN_TENSORS = 1_000_000  # as many as a manifest may list
MAX_PLAN_RUNS = 4_000_000  # runs in one plan, all tensors together
MAX_PLAN_BYTES = 64 << 20  # one encoded plan

#: (offset within the tensor, length, stride, count), all in bytes
Run = tuple[U63, U63, U63, U63]


class SliceRuns(msgspec.Struct, array_like=True, frozen=True):
    """The bytes one receiver needs of one tensor, as strided runs (module text)."""

    tensor: Name
    runs: Annotated[list[Run], Meta(max_length=MAX_PLAN_RUNS)]


class SlicePlan(msgspec.Struct, frozen=True):
    """One receiver's plan: a ``layout`` label ("tp2/rank0") and its tensors' runs."""

    layout: Text
    tensors: Annotated[list[SliceRuns], Meta(max_length=MAX_PLAN_TENSORS)]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        total = 0
        for index, entry in enumerate(self.tensors):
            where = f"tensors[{index}]"
            if entry.tensor in seen:
                raise ValueError(f"{where}.tensor: {entry.tensor!r} is listed twice")
            seen.add(entry.tensor)
            total += len(entry.runs)
            if total > MAX_PLAN_RUNS:
                raise ValueError(f"{where}.runs: more than {MAX_PLAN_RUNS} runs in the plan")
            end = 0
            for number, (offset, length, stride, count) in enumerate(entry.runs):
                at = f"{where}.runs[{number}]"
                if length == 0 or count == 0:
                    raise ValueError(f"{at}: empty run (length {length}, count {count}) "
                                     f"of tensor {entry.tensor!r}")
                if count > 1 and stride < length:
                    raise ValueError(f"{at}: stride {stride} below length {length}: its "
                                     f"copies overlap (tensor {entry.tensor!r})")
                if offset < end:
                    raise ValueError(f"{at}: starts at byte {offset}, inside the previous "
                                     f"run (ends at {end}) of tensor {entry.tensor!r}: runs "
                                     "must ascend without overlapping")
                end = run_end((offset, length, stride, count))

    def digest(self) -> str:
        """A stable name for the plan: blake2b-128 of its encoding, in hex (32 characters)."""
        return hashlib.blake2b(encode_plan(self), digest_size=16).hexdigest()

    @property
    def needed_bytes(self) -> int:
        return needed_bytes(self)


def run_end(run: tuple[int, int, int, int]) -> int:
    """One past the last byte of ``run`` (within its tensor)."""
    offset, length, stride, count = run
    return offset + (count - 1) * stride + length


def needed_bytes(plan: SlicePlan) -> int:
    """The bytes the plan asks for of each version."""
    return sum(length * count for entry in plan.tensors for _, length, _, count in entry.runs)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SlicePlan)


def encode_plan(plan: SlicePlan) -> bytes:
    return _ENCODER.encode(plan)


def decode_plan(data: bytes | memoryview, *, max_bytes: int = MAX_PLAN_BYTES) -> SlicePlan:
    """A plan from its encoding, every rule checked; ``ProtocolError`` names what is wrong."""
    if len(data) > max_bytes:
        raise ProtocolError(f"slice_plan: {len(data)} bytes exceeds {max_bytes}")
    try:
        return _DECODER.decode(data)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"slice_plan: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"slice_plan: not valid msgpack ({exc})") from exc


def from_ranges(layout: str, ranges: Mapping[str, Sequence[tuple[int, int]]]) -> SlicePlan:
    """A plan from ``[start, end)`` byte ranges per tensor (as ``SlicePlan.ranges`` of the
    vLLM recorder holds them): ranges are sorted and merged, then equal-length ranges at
    a constant step become one strided run. Tensors are listed by name, so the same
    ranges always give the same ``digest``; a tensor with no bytes is left out."""
    tensors: list[SliceRuns] = []
    for name in sorted(ranges):
        merged = _merge(ranges[name])
        if merged:
            tensors.append(SliceRuns(name, _compress(merged)))
    try:
        return SlicePlan(layout=layout, tensors=tensors)
    except (ValueError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"slice_plan: {exc}") from exc


def _merge(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted((int(s), int(e)) for s, e in ranges):
        if start < 0 or end < start:
            raise ProtocolError(f"slice_plan: bad range [{start}, {end})")
        if end == start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _compress(ranges: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    runs: list[tuple[int, int, int, int]] = []
    index = 0
    while index < len(ranges):
        start, end = ranges[index]
        length = end - start
        count = 1
        stride = 0
        if index + 1 < len(ranges) and ranges[index + 1][1] - ranges[index + 1][0] == length:
            stride = ranges[index + 1][0] - start
            count = 2
            while index + count < len(ranges):
                nxt_start, nxt_end = ranges[index + count]
                if nxt_end - nxt_start != length or \
                        nxt_start - ranges[index + count - 1][0] != stride:
                    break
                count += 1
        runs.append((start, length, stride if count > 1 else 0, count))
        index += count
    return runs
