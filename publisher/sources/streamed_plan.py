"""A version laid out from global shapes, to be gathered one layer group at a time.

Why: gathering every parameter before the copy made every rank hold the whole
model beside its shards. A sharded (DTensor) model or a vLLM ``WeightSource``
is laid out from global shapes and dtypes alone (``DTensor.shape`` is global; a
``WeightSource`` declares ``metadata()``) as ``StreamedPairs``: meta tensors and
a pass that gathers group by group (``layer_grouping``). For a sharded trainer
(``plan_shard``) the pass keeps only the tensors ``shard_owners.owner_ranks``
gives this rank, each gathered to its owner only where ``owner_gather.take``
can. No vLLM import: a ``WeightSource`` is known by its ``metadata()`` and
``iter_groups()`` methods.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from publisher.sources import owner_gather
from publisher.sources.layer_grouping import layer_groups
from publisher.sources.shard_owners import nbytes, owner_ranks
from publisher.sources.vllm_sources import as_grouped, is_weight_source
from publisher.store.snapshot import WeightsLike, checked_pair
from weightpub_wire.errors import ConfigError

__all__ = ["Group", "PublishSource", "StreamedPairs", "WeightSourceLike", "plan_shard",
           "plan_streamed"]

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
            largest = max(largest, sum(nbytes(t) for _, t in self[start:start + size]))
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


def plan_shard(weights: PublishSource, rank: int, world_size: int,
               ) -> StreamedPairs | list[tuple[str, Any]]:
    """Rank ``rank``'s part of ``weights`` for a ``ShardedPublisher``.

    Sharded weights (DTensors) or a ``WeightSource``: a plan whose pass walks
    every group (every rank must run it, in step) and keeps only the tensors
    ``owner_ranks`` gives this rank; 1-D ``Shard(0)``/``Replicate`` DTensors are
    sent to their owner only (``owner_gather.take``), the rest (a ``WeightSource``'s groups
    included) gathered whole on every rank. Anything else is this rank's own
    tensors, returned as plain pairs (unchecked, as ``plan_snapshot`` takes them).
    """
    return plan_streamed(weights, (rank, world_size))


def plan_streamed(weights: PublishSource, share: tuple[int, int] | None = None,
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
    if not any(owner_gather.is_sharded(pair[1]) for pair in items if isinstance(pair, tuple)
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
        meshes = None if share is None else owner_gather.MeshRanks(*share)
        for names in groups:
            kept_names: list[str] = []
            kept: list[Any] = []
            for name in names:
                # a collective every rank joins: the whole tensor to every rank, or
                # (``share``) to its owner only
                held = owner_gather.full(by_name[name]) if owners is None or meshes is None else \
                    owner_gather.take(by_name[name], owners[name], meshes)
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


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")
