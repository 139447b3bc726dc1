"""Packed buckets for the seed's broadcast path: a few collectives instead of one per tensor.

Why: ``batch_update_named_params(params_list)`` gets the whole list of
``(name, dtype, shape)`` up front, so both sides can agree on a layout and move
the tensors in a few large buckets (one broadcast each), as vLLM's packed NCCL
engine and checkpoint-engine do; one broadcast per tensor costs a round trip per
tensor (hundreds per model).

The signature stays the seed's: a trainer asks for packing by putting one marker
spec first, ``("weightpub.packed", "uint8", [bucket_bytes])``. A list without it
(the seed's own trainers) is received one tensor at a time, as before. Layout:
tensors in list order, each at a 64-byte aligned offset, a new bucket whenever
the next tensor would take the current one past ``bucket_bytes`` (a tensor
larger than that has a bucket of its own).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightpub_wire.dtypes import dtype_name, parse_dtype
from weightpub_wire.errors import ApplyError

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "MARKER",
    "Bucket",
    "Placed",
    "layout",
    "pack",
    "packed_specs",
    "parse_specs",
    "unpack",
]

MARKER = "weightpub.packed"
DEFAULT_BUCKET_BYTES = 256 << 20
MIN_BUCKET_BYTES = 1 << 16
MAX_BUCKET_BYTES = 4 << 30
MAX_DIMS = 8
ALIGN = 64

Spec = tuple[str, str, Sequence[int]]


@dataclass(frozen=True, slots=True)
class Placed:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Bucket:
    nbytes: int
    tensors: tuple[Placed, ...]


def packed_specs(named: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[tuple[str, str, list[int]]]:
    """The ``params_list`` a trainer passes to ``batch_update_named_params`` to get packing."""
    specs = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in named]
    return [(MARKER, "uint8", [int(bucket_bytes)]), *specs]


def _check(index: int, spec: Any) -> tuple[str, torch.dtype, tuple[int, ...]]:
    if not isinstance(spec, (list, tuple)) or len(spec) != 3:
        raise ApplyError(f"params_list[{index}]: expected (name, dtype, shape)")
    name, dtype, shape = spec
    if not isinstance(name, str) or not name:
        raise ApplyError(f"params_list[{index}]: name must be a non-empty str")
    dt = parse_dtype(dtype, field=f"tensor {name!r} dtype", error=ApplyError)
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape):
        raise ApplyError(f"tensor {name!r}: shape {shape!r} must be at most {MAX_DIMS} "
                         "non-negative ints")
    return name, dt, tuple(shape)


Checked = tuple[str, torch.dtype, tuple[int, ...]]


def parse_specs(params_list: Sequence[Any]) -> tuple[int | None, list[Checked]]:
    """(bucket_bytes, or None when not packed; the checked specs). ``ApplyError`` names
    the bad spec."""
    items = list(params_list)
    bucket_bytes = None
    if items and isinstance(items[0], (list, tuple)) and items[0] and items[0][0] == MARKER:
        marker = items.pop(0)
        shape = marker[2] if len(marker) == 3 else None
        if not (isinstance(shape, (list, tuple)) and len(shape) == 1
                and isinstance(shape[0], int)
                and MIN_BUCKET_BYTES <= shape[0] <= MAX_BUCKET_BYTES):
            raise ApplyError(f"params_list[0]: {MARKER} needs [bucket_bytes] within "
                             f"[{MIN_BUCKET_BYTES}, {MAX_BUCKET_BYTES}]")
        bucket_bytes = int(shape[0])
    return bucket_bytes, [_check(i, spec) for i, spec in enumerate(items)]


def layout(specs: Sequence[Checked], bucket_bytes: int) -> list[Bucket]:
    """The buckets both sides derive from the same specs."""
    buckets: list[Bucket] = []
    current: list[Placed] = []
    end = 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        offset = -(-end // ALIGN) * ALIGN
        if current and offset + nbytes > bucket_bytes:
            buckets.append(Bucket(end, tuple(current)))
            current, offset = [], 0
        current.append(Placed(name, dtype, shape, offset, nbytes))
        end = offset + nbytes
    if current:
        buckets.append(Bucket(end, tuple(current)))
    return buckets


def pack(bucket: Bucket, tensors: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The trainer's bucket: every tensor's bytes at its offset (one copy each)."""
    out = torch.zeros(max(bucket.nbytes, 1), dtype=torch.uint8, device=device)
    for placed in bucket.tensors:
        source = tensors[placed.name]
        if source.dtype != placed.dtype or tuple(source.shape) != placed.shape:
            raise ApplyError(f"tensor {placed.name!r}: {source.dtype} {tuple(source.shape)} "
                             f"differs from its spec {placed.dtype} {placed.shape}")
        if placed.nbytes:
            flat = source.detach().contiguous().reshape(-1).view(torch.uint8)
            out[placed.offset: placed.offset + placed.nbytes].copy_(flat)
    return out


def unpack(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of a received bucket (no copy), in spec order."""
    return [(p.name, buffer[p.offset: p.offset + p.nbytes].view(p.dtype).view(p.shape))
            for p in bucket.tensors]
