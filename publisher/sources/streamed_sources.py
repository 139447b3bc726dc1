"""Publishing sharded weights and vLLM ``WeightSource``s one layer group at a time.

Why: ``DTensor.full_tensor()`` (FSDP2, tensor parallel) materializes a whole
parameter on every rank of its mesh. Gathering every parameter before the copy
made every rank hold the whole model beside its shards: past one device's (or
host's) memory, publishing could not run. Here a version is laid out from global
shapes and dtypes alone (``DTensor.shape`` is global; a ``WeightSource`` declares
``metadata()``), then gathered, copied into the snapshot and dropped one group at
a time: a decoder layer, as vLLM's ``layerwise_groups`` defines it. The
publishing rank (``plan_version``, then ``copy_streamed``) and every other rank
(``gather_full_tensors``) run the same gathers in the same order, so a rank's
extra memory is about one group (the gather's own buffers at most double it).

Sharded trainers (``ShardedPublisher``): every rank walks every group the same
way (``plan_shard``) and keeps only the tensors it owns (``owner_ranks``, the
same answer on every rank from names, shapes and dtypes), so its snapshot is
about 1/world of the model. Each tensor is gathered to its owner only where
it can be (``_take``: a DTensor on a 1-D mesh of the publisher's ranks,
``Shard(0)``, FSDP2's default, or ``Replicate``), so a rank receives about its
shard per version, not the whole model (1 TB per rank per version at 1T
parameters); anything else is ``full_tensor()``-ed on every rank and dropped
at once where not owned.

No vLLM import (``publisher`` never imports it): a ``WeightSource`` is known by
its ``metadata()`` and ``iter_groups()`` methods.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from publisher.sources.vllm_sources import as_grouped, is_weight_source
from publisher.store.snapshot import (
    Snapshot,
    WeightsLike,
    checked_pair,
    cuda_devices,
    plan_layout,
    plan_snapshot,
    wait_for_copies,
)
from weightpub_wire.buffers import BufferPool, copy_bytes, flat_bytes
from weightpub_wire.dtypes import dtype_name
from weightpub_wire.errors import ConfigError

__all__ = [
    "PublishSource",
    "StreamedPairs",
    "WeightSourceLike",
    "copy_streamed",
    "gather_full_tensors",
    "layer_groups",
    "owner_ranks",
    "plan_shard",
    "plan_version",
]

#: one group as it is materialized: names and full tensors (None: not held on this rank)
Group = tuple[list[str], list[Any]]


@runtime_checkable
class WeightSourceLike(Protocol):
    """What ``publish()`` needs of vLLM's ``WeightSource`` (``ModuleSource`` included)."""

    def metadata(self) -> Sequence[Any]:
        """``ParamMeta``-like items: ``name``, ``dtype``, full ``shape``; no transfer."""

    def iter_groups(self) -> Iterator[Group]:
        """One ``(names, tensors)`` batch per group, materialized (a collective)."""


PublishSource = WeightsLike | WeightSourceLike


def layer_groups(names: list[str]) -> list[list[str]]:
    """One group per decoder layer, exactly vLLM's ``layerwise_groups`` (0.32).

    Why a copy: ``publisher`` never imports vLLM, and group *g* must name the
    same tensors on every rank. A name keys on its outermost integer segment
    (``model.layers.3.mlp.experts.7.w1`` is layer 3); un-indexed names before the
    first indexed one form the first group, the others the last; stacks follow
    the first appearance of their prefix, ascending index within it.
    ``tests/transport/test_streamed_sources.py`` checks it against vLLM's.
    """
    pre: list[str] = []
    post: list[str] = []
    stacks: dict[tuple[str, int], list[str]] = {}
    order: list[tuple[str, int]] = []
    for name in names:
        key = _stack_key(name)
        if key is None:
            (post if order else pre).append(name)
            continue
        if key not in stacks:
            stacks[key] = []
            order.append(key)
        stacks[key].append(name)
    prefix_rank: dict[str, int] = {}
    for key in order:
        prefix_rank.setdefault(key[0], len(prefix_rank))
    order.sort(key=lambda key: (prefix_rank[key[0]], key[1]))
    groups: list[list[str]] = [pre] if pre else []
    groups += [stacks[key] for key in order]
    if post:
        groups.append(post)
    return groups


def _stack_key(name: str) -> tuple[str, int] | None:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


class StreamedPairs(list[tuple[str, torch.Tensor]]):
    """A version's layout as ``(name, meta tensor)`` pairs, and how to fill it group by group.

    A list so that ``VersionPreparer`` takes it where it takes materialized
    pairs; the tensors are on the ``meta`` device (shape and dtype, no bytes), so
    nothing can read them by mistake. ``produce()`` starts one pass over the
    groups (each gather a collective; ``groups()`` does it and records that it
    ran); ``sizes`` are the groups' tensor counts in layout order; ``missing``
    names what the groups do not cover (refused when publishing, after the gathers).
    """

    def __init__(self, pairs: list[tuple[str, torch.Tensor]],
                 produce: Callable[[], Iterator[Group]], sizes: list[int], *,
                 pinned: bool, missing: Collection[str] = ()) -> None:
        super().__init__(pairs)
        self.produce = produce
        self.sizes = sizes
        self.pinned = pinned
        self.missing = sorted(missing)
        self.started = False

    def groups(self) -> Iterator[Group]:
        """One pass over the groups; ``started`` says a pass began (the ranks are in it)."""
        self.started = True
        return self.produce()

    def followed_by(self, pairs: list[tuple[str, torch.Tensor]]) -> StreamedPairs:
        """This layout with materialized ``pairs`` after it, yielded as one last group."""
        names = [name for name, _ in pairs]

        def produce() -> Iterator[Group]:
            yield from self.produce()
            yield names, [tensor for _, tensor in pairs]

        return StreamedPairs([*self, *pairs], produce, [*self.sizes, len(pairs)],
                             pinned=self.pinned, missing=self.missing)

    @property
    def largest_group_bytes(self) -> int:
        """The bytes of the largest group: what one gather holds at once."""
        largest, start = 0, 0
        for size in self.sizes:
            largest = max(largest, sum(_nbytes(t) for _, t in self[start:start + size]))
            start += size
        return largest

    def drain(self) -> None:
        """Run every group's gather and drop it: what a rank that copies nothing does.

        ``next(..., None)`` keeps no name bound to a group, so the previous one is
        freed before the next is gathered.
        """
        groups = self.groups()
        while next(groups, None) is not None:
            pass


def plan_version(weights: PublishSource, pool: BufferPool,
                 admit: Callable[[int], None] | None = None,
                 ) -> tuple[Snapshot, list[tuple[str, torch.Tensor]]]:
    """``plan_snapshot``, streamed when ``weights`` is sharded or a ``WeightSource``.

    Streamed, nothing is gathered yet: the layout comes from global shapes. When
    the budget refuses (or anything else fails before the copy), every group is
    still gathered and dropped: the other ranks are already in those collectives.
    """
    planned = _plan(weights)
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
    planned = _plan(weights)
    if isinstance(planned, StreamedPairs):
        planned.drain()


def plan_shard(weights: PublishSource, rank: int, world_size: int,
               ) -> StreamedPairs | list[tuple[str, Any]]:
    """Rank ``rank``'s part of ``weights`` for a ``ShardedPublisher``.

    Sharded weights (DTensors) or a ``WeightSource``: a plan whose pass walks
    every group (every rank must run it, in step) and keeps only the tensors
    ``owner_ranks`` gives this rank; 1-D ``Shard(0)``/``Replicate`` DTensors are
    sent to their owner only (``_take``), the rest (a ``WeightSource``'s groups
    included) gathered whole on every rank. Anything else is this rank's own
    tensors, returned as plain pairs (unchecked, as ``plan_snapshot`` takes them).
    """
    return _plan(weights, (rank, world_size))


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
    for index in sorted(range(len(pairs)), key=lambda i: -_nbytes(pairs[i][1])):
        load, rank = heapq.heappop(loads)
        name, tensor = pairs[index]
        owners[name] = rank
        heapq.heappush(loads, (load + _nbytes(tensor), rank))
    return owners


def _plan(weights: PublishSource, share: tuple[int, int] | None = None,
          ) -> StreamedPairs | list[tuple[str, Any]]:
    """The streamed plan, or the plain pairs (nothing sharded) for ``plan_snapshot``.

    Reads names, global shapes and dtypes only; a one-shot iterable is read once
    here and its pairs handed on. ``share`` (rank, world size): keep only the
    tensors ``owner_ranks`` gives that rank (every group is still walked: each
    tensor's gather, to its owner or to every rank, is a collective).
    """
    if isinstance(weights, StreamedPairs):  # planned already (``plan_shard``)
        return weights
    if is_weight_source(weights):
        return _plan_source(as_grouped(weights), share)
    if isinstance(weights, torch.nn.Module):
        items: list[tuple[str, Any]] = list(weights.state_dict().items())
    elif isinstance(weights, Mapping):
        items = list(weights.items())
    else:
        items = list(weights)  # type: ignore[arg-type]
    if not any(_is_sharded(pair[1]) for pair in items if isinstance(pair, tuple)
               and len(pair) == 2):
        return items
    by_name: dict[str, torch.Tensor] = {}
    for pair in items:
        name, tensor = checked_pair(pair)
        if name in by_name:
            raise ValueError(f"weight name {name!r} appears twice")
        by_name[name] = tensor
    groups = layer_groups(list(by_name))
    pairs = [(name, _meta(tuple(by_name[name].shape), by_name[name].dtype))
             for names in groups for name in names]
    owners = None if share is None else owner_ranks(pairs, share[1])
    keep = None if share is None or owners is None else \
        {name for name, owner in owners.items() if owner == share[0]}

    def produce() -> Iterator[Group]:
        meshes = None if share is None else _MeshRanks(*share)
        for names in groups:
            kept_names: list[str] = []
            kept: list[Any] = []
            for name in names:
                # a collective every rank joins: the whole tensor to every rank, or
                # (``share``) to its owner only
                held = _full(by_name[name]) if owners is None or meshes is None else \
                    _take(by_name[name], owners[name], meshes)
                if held is not None and (keep is None or name in keep):
                    kept_names.append(name)
                    kept.append(held)
                del held  # not kept: dropped before the next gather
            yield kept_names, kept

    pinned = torch.cuda.is_available() and any(t.device.type == "cuda" for t in by_name.values())
    return _streamed(pairs, groups, produce, keep, pinned=pinned)


def _kept(pairs: list[tuple[str, torch.Tensor]], share: tuple[int, int] | None,
          ) -> set[str] | None:
    """The names a rank keeps (``share``: rank, world size); None: all of them."""
    if share is None:
        return None
    rank, world_size = share
    owners = owner_ranks(pairs, world_size)
    return {name for name, owner in owners.items() if owner == rank}


def _streamed(pairs: list[tuple[str, torch.Tensor]], groups: list[list[str]],
              produce: Callable[[], Iterator[Group]], keep: set[str] | None, *,
              pinned: bool, missing: Collection[str] = ()) -> StreamedPairs:
    """The plan of the kept tensors; ``produce`` must yield only those, group by group."""
    if keep is not None:
        pairs = [pair for pair in pairs if pair[0] in keep]
        groups = [[name for name in names if name in keep] for names in groups]
    return StreamedPairs(pairs, produce, [len(g) for g in groups], pinned=pinned,
                         missing=missing)


def _only(groups: Iterator[Group], keep: set[str]) -> Iterator[Group]:
    """A source's groups with the tensors this rank does not keep dropped.

    Nothing of a group stays bound here once it is yielded, so it is freed
    before the next one is gathered.
    """
    while (group := next(groups, None)) is not None:
        kept = [(name, t) for name, t in zip(*group, strict=True) if name in keep]
        del group
        yield [name for name, _ in kept], [t for _, t in kept]
        del kept


def _plan_source(source: WeightSourceLike, share: tuple[int, int] | None) -> StreamedPairs:
    """A vLLM ``WeightSource``: its ``groups()`` order, shapes from ``metadata()``."""
    meta = {m.name: m for m in source.metadata()}
    own_groups = getattr(source, "groups", None)
    groups: list[list[str]] = own_groups() if callable(own_groups) else layer_groups(list(meta))
    unknown = [name for names in groups for name in names if name not in meta]
    if unknown:
        raise ConfigError(f"the weight source's groups name {unknown[0]!r}, which its "
                          "metadata() does not declare")
    pairs = [(name, _meta(tuple(meta[name].shape), meta[name].dtype))
             for names in groups for name in names]
    missing = set(meta) - {name for name, _ in pairs}
    keep = _kept(pairs, share)
    produce = source.iter_groups if keep is None else (
        lambda: _only(source.iter_groups(), keep))
    return _streamed(pairs, groups, produce, keep, pinned=torch.cuda.is_available(),
                     missing=missing)


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


def _is_sharded(tensor: object) -> bool:
    """A DTensor (or anything else whose ``full_tensor()`` gathers it)."""
    return callable(getattr(tensor, "full_tensor", None))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor().detach() if _is_sharded(tensor) else tensor.detach()  # type: ignore[attr-defined]


class _MeshRanks:
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
        self._meshes: dict[int, tuple[Any, _MeshTable | None]] = {}

    def table(self, mesh: Any, device: torch.device) -> _MeshTable | None:
        key = id(mesh)
        if key not in self._meshes:  # keeps the mesh alive: its id is not reused
            self._meshes[key] = (mesh, self._exchange(mesh, device))
        return self._meshes[key][1]

    def _exchange(self, mesh: Any, device: torch.device) -> _MeshTable | None:
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
        return _MeshTable(group, [dist.get_global_rank(group, g) for g in every], ranks,
                          coordinates, dist.get_rank(group))


class _MeshTable:
    """A 1-D mesh's group as the publisher ranks see it (every list by group rank)."""

    def __init__(self, group: Any, global_ranks: list[int], ranks: list[int],
                 coordinates: list[int], me: int) -> None:
        self.group = group
        self.global_ranks = global_ranks  # what send/recv/gather name a peer by
        self.ranks = ranks  # publisher ranks
        self.coordinates = coordinates  # mesh coordinates: which rows a rank holds
        self.me = me


def _take(tensor: Any, owner: int, meshes: _MeshRanks) -> Any | None:
    """``tensor`` whole on its ``owner`` (this rank: returned), nothing elsewhere (None).

    Every rank calls it for every tensor in the same order (it is a collective).
    A DTensor on a 1-D mesh of the publisher's ranks, ``Shard(0)`` (FSDP2's
    default) or ``Replicate``: only the owner receives (``_gather_rows``) or,
    replicated, takes its own copy: so each rank receives about its shard per
    version rather than the whole model. Anything else (2-D meshes, other
    placements, TP, non-DTensor ``full_tensor()`` objects): ``full_tensor()`` on
    every rank, kept by the owner only.
    """
    table, placement = _placement(tensor, meshes)
    if table is None:
        full = _full(tensor)
        return full if owner == meshes.rank else None
    local = tensor.to_local().detach()
    if placement == "replicate":
        return local if owner == meshes.rank else None
    return _gather_rows(tensor, local, table.ranks.index(owner), table)


def _placement(tensor: Any, meshes: _MeshRanks) -> tuple[_MeshTable | None, str]:
    """The mesh table and placement (``shard0``/``replicate``) of an owner-gatherable tensor."""
    if not dist.is_available() or not _is_sharded(tensor):
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


def _gather_rows(tensor: Any, local: torch.Tensor, owner: int, table: _MeshTable,
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


def _receive_rows(local: torch.Tensor, shape: tuple[int, ...], owner: int, table: _MeshTable,
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


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _advance(snapshot: Snapshot, offset: int, on_progress: Callable[[int], None] | None) -> None:
    snapshot.copied_bytes = offset
    if on_progress is not None:
        on_progress(offset)
