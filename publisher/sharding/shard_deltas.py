"""Deltas over sharded versions: which bases the union of the ranks' deltas can start from.

Every rank of a ``ShardedPublisher`` encodes deltas of its own shard (its own
``DeltaPublisher``) against its own previous shard, and says in its
``ShardSubmit`` which of its versions it serves deltas from (``delta``: the
rank's chain, each link digested over the rank's own checksums). Deltas are
chunk-wise, so the union's chunk ``first_chunk + i`` as a delta against base B
is the rank's chunk ``i`` against its chunk ``i`` of B: valid only when every
rank served the same chunk range in B as now.

``ShardDeltas`` (the coordinator's) remembers the last few announced unions
(digests and layout only, never bytes: ``MAX_DELTA_CHAIN`` of them) and gives
the new union a chain of the bases that (a) it announced, (b) every rank's
chain ends with, the same versions in the same order (a delta step fetches
version ``v`` against its predecessor in the chain from every rank), with the
rank's digest matching what the rank submitted for that version, and (c) had
the same shard layout. Each link carries the digest of the union (what a
subscriber holding it computes). A rank that restarted starts its chain anew,
so the next union is full; one that lost a delta it offered answers
``version_unavailable`` and the subscriber fetches that version in full.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from weightpub_wire import protocol as wire
from weightpub_wire.delta_codec import version_digest
from weightpub_wire.message_base import MAX_DELTA_CHAIN
from weightpub_wire.shard_submit import ShardSubmit

__all__ = ["ShardDeltas", "shard_layout"]

#: per rank (first_chunk, num_chunks), in rank order
Layout = tuple[tuple[int, int], ...]


def shard_layout(sources: Sequence[wire.ShardSource]) -> Layout:
    return tuple((s.first_chunk, s.num_chunks) for s in sources)


@dataclass(frozen=True, slots=True)
class _Announced:
    digest: int  # the union's version_digest
    layout: Layout
    rank_digests: tuple[int, ...]  # each rank's version_digest of its own shard


class ShardDeltas:
    """The announced unions deltas may start from; used on the collecting thread only."""

    def __init__(self, keep: int = MAX_DELTA_CHAIN) -> None:
        self.keep = keep
        self._announced: OrderedDict[int, _Announced] = OrderedDict()

    def chain_for(self, shards: Sequence[ShardSubmit],
                  layout: Layout) -> tuple[wire.DeltaInfo | None, bool]:
        """``(Manifest.delta, Manifest.deltas_follow)`` of the union of ``shards`` (rank
        order) laid out as ``layout``."""
        follow = all(shard.deltas_follow for shard in shards)
        chains = [shard.delta.chain if shard.delta is not None else () for shard in shards]
        links: list[wire.DeltaBase] = []
        for back in range(1, min(len(chain) for chain in chains) + 1):
            version = chains[0][-back].version
            known = self._announced.get(version)
            if known is None or known.layout != layout or any(
                chain[-back] != wire.DeltaBase(version=version, digest=digest)
                for chain, digest in zip(chains, known.rank_digests, strict=True)
            ):
                break
            links.append(wire.DeltaBase(version=version, digest=known.digest))
        chain = tuple(reversed(links))
        return (wire.DeltaInfo(chain=chain) if chain else None), follow

    def announced(self, manifest: wire.Manifest, shards: Sequence[ShardSubmit]) -> None:
        """Remember an announced union (its digest, layout and each rank's own digest)."""
        if manifest.shards is None:
            return
        digest = version_digest(manifest.total_bytes, manifest.chunk_size, manifest.checksums)
        ranks = tuple(version_digest(s.total_bytes, s.chunk_size, s.checksums) for s in shards)
        self._announced[manifest.version] = _Announced(digest, shard_layout(manifest.shards),
                                                       ranks)
        while len(self._announced) > self.keep:
            self._announced.popitem(last=False)
