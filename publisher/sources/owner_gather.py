"""Gathers that bring a sharded tensor whole to the rank that keeps it, and only there.

Why: ``DTensor.full_tensor()`` gives every rank of the mesh the whole tensor:
for a sharded trainer that is the whole model received per rank per version.
``take`` sends a DTensor on a 1-D mesh of the publisher's ranks (``Shard(0)``,
FSDP2's default, or ``Replicate``) to its owner only (gloo: point-to-point rows
into one tensor; NCCL: ``gather`` into one padded buffer); a small all-gather
per mesh (``MeshRanks``) maps mesh ranks to publisher ranks so every rank takes
the same path. Anything else is ``full()``-ed on every rank. Every function
here is a collective: every rank calls it for every tensor, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from weightpub_wire.errors import ConfigError

__all__ = ["MeshRanks", "MeshTable", "full", "is_sharded", "take"]


def is_sharded(tensor: object) -> bool:
    """A DTensor (or anything else whose ``full_tensor()`` gathers it)."""
    return callable(getattr(tensor, "full_tensor", None))


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor().detach() if is_sharded(tensor) else tensor.detach()  # type: ignore[attr-defined]


class MeshRanks:
    """Which publisher rank each rank of a 1-D mesh is, learned once per mesh per pass.

    Why: gathering a tensor to its owner needs the owner's rank in the mesh's
    process group, and every rank must choose the same path for every tensor (a
    rank gathering where another all-gathers waits forever). One small
    all-gather of (publisher rank, mesh coordinate) per mesh gives every rank
    the same table; a mesh whose ranks are not exactly the publisher's
    ``world_size`` ranks gets None (the ``full_tensor()`` path, on every rank).
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._meshes: dict[int, tuple[Any, MeshTable | None]] = {}

    def table(self, mesh: Any, device: torch.device) -> MeshTable | None:
        key = id(mesh)
        if key not in self._meshes:  # keeps the mesh alive: its id is not reused
            self._meshes[key] = (mesh, self._exchange(mesh, device))
        return self._meshes[key][1]

    def _exchange(self, mesh: Any, device: torch.device) -> MeshTable | None:
        group = mesh.get_group()
        mine = torch.tensor([self.rank, mesh.get_local_rank()], dtype=torch.int64,
                            device=device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine, group=group)
        ranks = [int(row[0]) for row in rows]  # by group rank
        coordinates = [int(row[1]) for row in rows]
        every = list(range(self.world_size))
        if sorted(ranks) != every or sorted(coordinates) != every:
            return None
        return MeshTable(group, [dist.get_global_rank(group, g) for g in every], ranks,
                          coordinates, dist.get_rank(group))


class MeshTable:
    """A 1-D mesh's group as the publisher ranks see it (every list by group rank)."""

    def __init__(self, group: Any, global_ranks: list[int], ranks: list[int],
                 coordinates: list[int], me: int) -> None:
        self.group = group
        self.global_ranks = global_ranks  # what send/recv/gather name a peer by
        self.ranks = ranks  # publisher ranks
        self.coordinates = coordinates  # mesh coordinates: which rows a rank holds
        self.me = me


def take(tensor: Any, owner: int, meshes: MeshRanks) -> Any | None:
    """``tensor`` whole on its ``owner`` (this rank: returned), nothing elsewhere (None).

    Every rank calls it for every tensor in the same order (it is a collective).
    A DTensor on a 1-D mesh of the publisher's ranks, ``Shard(0)`` (FSDP2's
    default) or ``Replicate``: only the owner receives (``gather_rows``) or,
    replicated, takes its own copy: so each rank receives about its shard per
    version rather than the whole model. Anything else (2-D meshes, other
    placements, TP, non-DTensor ``full_tensor()`` objects): ``full_tensor()`` on
    every rank, kept by the owner only.
    """
    table, placement = _placement(tensor, meshes)
    if table is None:
        whole = full(tensor)
        return whole if owner == meshes.rank else None
    local = tensor.to_local().detach()
    if placement == "replicate":
        return local if owner == meshes.rank else None
    return _gather_rows(tensor, local, table.ranks.index(owner), table)


def _placement(tensor: Any, meshes: MeshRanks) -> tuple[MeshTable | None, str]:
    """The mesh table and placement (``shard0``/``replicate``) of an owner-gatherable tensor."""
    if not dist.is_available() or not is_sharded(tensor):
        return None, ""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return None, ""
    mesh = tensor.device_mesh
    if mesh.ndim != 1 or mesh.size() != meshes.world_size:
        return None, ""
    (placement,) = tensor.placements
    if type(placement) is Shard and placement.dim == 0:  # not _StridedShard (a subclass)
        kind = "shard0"
    elif isinstance(placement, Replicate):
        kind = "replicate"
    else:
        return None, ""
    return meshes.table(mesh, tensor.to_local().device), kind


def _gather_rows(tensor: Any, local: torch.Tensor, owner: int, table: MeshTable,
                 ) -> torch.Tensor | None:
    """A ``Shard(0)`` DTensor's rows to group rank ``owner`` only, into one buffer there.

    Rows follow ``torch.chunk`` (FSDP2's and DTensor's split): mesh coordinate
    ``c`` holds rows ``[c * per, c * per + n_c)``, ``per = ceil(rows / world)``,
    so trailing ranks may hold fewer or none. On CPU (gloo) the owner receives
    each rank's rows straight into their place (point-to-point: gloo's
    ``gather`` goes through a flat buffer of its own, a second copy of the
    tensor); on a device (NCCL) ``gather`` into row views of one padded buffer.
    """
    shape, world = tuple(tensor.shape), table.group.size()
    rows = shape[0]
    per = -(-rows // world)
    mine = table.me == owner

    def held(index: int) -> int:  # rows group rank ``index`` holds
        return max(0, min(per, rows - table.coordinates[index] * per))

    if local.shape[0] != held(table.me):
        raise ConfigError(f"a Shard(0) DTensor of {rows} rows holds {local.shape[0]} on mesh "
                          f"coordinate {table.coordinates[table.me]}, not torch.chunk's "
                          f"{held(table.me)}")
    if not tensor.numel():
        return torch.empty(shape, dtype=local.dtype, device=local.device) if mine else None
    if local.device.type == "cpu":
        return _receive_rows(local, shape, owner, table, per, held)
    send = local if local.shape[0] == per and local.is_contiguous() else \
        _padded(local, per)
    if not mine:
        dist.gather(send, None, dst=table.global_ranks[owner], group=table.group)
        return None
    buffer = torch.empty((world * per, *shape[1:]), dtype=local.dtype, device=local.device)
    views = [buffer[table.coordinates[g] * per:(table.coordinates[g] + 1) * per]
             for g in range(world)]
    dist.gather(send, views, dst=table.global_ranks[owner], group=table.group)
    return buffer[:rows]


def _receive_rows(local: torch.Tensor, shape: tuple[int, ...], owner: int, table: MeshTable,
                  per: int, held: Callable[[int], int]) -> torch.Tensor | None:
    """Point-to-point: each rank sends its rows to the owner, which receives them in place."""
    if table.me != owner:
        if held(table.me):
            dist.send(local.contiguous(), dst=table.global_ranks[owner], group=table.group)
        return None
    out = torch.empty(shape, dtype=local.dtype, device=local.device)
    works = []
    for index in range(table.group.size()):
        start = table.coordinates[index] * per
        view = out[start:start + held(index)]
        if not view.shape[0]:
            continue
        if index == table.me:
            view.copy_(local)
        else:
            work = dist.irecv(view, src=table.global_ranks[index], group=table.group)
            assert work is not None  # this rank is in the group
            works.append(work)
    for work in works:
        work.wait()
    return out


def _padded(local: torch.Tensor, per: int) -> torch.Tensor:
    out = torch.zeros((per, *local.shape[1:]), dtype=local.dtype, device=local.device)
    out[:local.shape[0]].copy_(local)
    return out
