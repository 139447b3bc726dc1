"""Which rank of a sharded trainer keeps each tensor (``ShardedPublisher``).

Every rank computes the same answer from global names, shapes and dtypes alone,
so the ranks agree without talking and each keeps about 1/world of the bytes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from weightpub_wire.errors import ConfigError

__all__ = ["nbytes", "owner_ranks"]


def owner_ranks(pairs: Sequence[tuple[str, torch.Tensor]], world_size: int) -> dict[str, int]:
    """Which rank keeps each tensor: largest first, each to the least loaded rank by bytes.

    Why this rule: it depends on names, shapes and dtypes only (global ones for
    DTensors), so every rank computes the same split without talking, and it
    keeps each rank near 1/world of the bytes (ties: layout order, lower rank).
    """
    if world_size < 1:
        raise ConfigError(f"world_size: {world_size} is not positive")
    loads = [(0, rank) for rank in range(world_size)]
    owners: dict[str, int] = {}
    for index in sorted(range(len(pairs)), key=lambda i: -nbytes(pairs[i][1])):
        load, rank = heapq.heappop(loads)
        name, tensor = pairs[index]
        owners[name] = rank
        heapq.heappush(loads, (load + nbytes(tensor), rank))
    return owners


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
