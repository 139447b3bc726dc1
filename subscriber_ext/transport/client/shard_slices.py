"""A sliced subscriber's slices of a sharded version, each from the trainer rank that owns them.

A sharded version (``Manifest.shards``) is served by its trainer ranks, each an
ordinary publisher of its own shard (``publisher.sharded_publisher``): its tensors
laid out from 0, chunk-aligned, its chunk ``i`` the union's ``first_chunk + i``,
and it serves slices like any publisher (``publisher/serving/slice_serving.py``).
So each rank is asked for the slices of its own chunks only: ``rank_plan`` computes
the part of the subscriber's plan a rank owns (the plan's tensors that lie in that
rank's chunk range of the union; tensors are whole within a rank), and
``RankSliceSource`` (a ``SliceSource`` on a DEALER to that rank) registers that
part there, asks its ``slice_sums`` (the rank's touched chunks, which are the
union's touched chunks of its range, shifted) and ``slice_fetch``es them in the
rank's chunk ids; replies are renumbered into the union's before ``ChunkReceiver``
places them, and verified against the rank's sums as the publisher path's are (the
bytes of a chunk gathered in flat order are the same in the rank's layout and the
union's). A rank whose part of the plan is empty gets no link at all.

Stream (``stream=True`` here and at a rank): a rank whose ``ShardSource`` has a
``stream_port`` gets a ``StreamSource`` of its own (``StreamPicker.follow_ranks``, a
first source before the rank's slice source), its token asked over this rank's DEALER
and read back by its ``RankSliceSource``; the rank's planned blocks come there, in the
rank's chunk ids (a block's start counts from its chunk's first byte, the same in the
rank's layout and the union's), verified against the rank's sums.

Fallback: a rank that cannot serve slices (one that predates them and drops the
registration, one that refuses the part, bounds, sums that do not fit) serves its
touched chunks whole, counted under the cause ``sharded`` with the rank and the
reason in ``status()["slice_plan"]["last_refusal"]``; the other ranks go on with
slices. A rank left unanswered past ``request_timeout`` while its DEALER is not
connected gives the version up at once, naming the rank (as ``shard_links.py``); a
range no rank is asked for is named after ``idle_limit``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

from subscriber_ext.transport.client.dealer_source import rank_handshakes
from subscriber_ext.transport.client.slice_source import CONTROL_TRIES, SliceFetcher, SliceSource
from subscriber_ext.transport.client.stream_source import StreamPicker
from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.chunk_source import ChunkSource, Retry, SourceSink
from subscriber_ext.transport.staging.sparse_assembly import SparseAssembly
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.errors import TransportError, WeightPubTimeout
from weightpub_wire.monitored_dealer import LINK_EVENTS, MonitoredDealer, chunk_reply_bytes
from weightpub_wire.slice_plan import SlicePlan

__all__ = ["RankSliceSource", "ShardSlices", "rank_plan"]


def rank_plan(plan: SlicePlan, manifest: wire.Manifest, shard: wire.ShardSource) -> SlicePlan:
    """The part of ``plan`` the rank serving ``shard`` owns: the plan's tensors that start in
    its chunk range of ``manifest`` (empty: the rank serves nothing this plan reads)."""
    low = shard.first_chunk * manifest.chunk_size
    high = (shard.first_chunk + shard.num_chunks) * manifest.chunk_size
    offsets = {entry.name: entry.offset for entry in manifest.tensors}
    owned = [entry for entry in plan.tensors
             if low <= offsets.get(entry.tensor, -1) < high]
    return SlicePlan(layout=f"{plan.layout}@rank{shard.rank}", tensors=owned)


class RankSliceSource(SliceSource):
    """One trainer rank asked for its part of the plan, in its own chunk ids."""

    kind: ClassVar[str] = "shard_ranks"

    def __init__(self, fetcher: SliceFetcher, dealer: MonitoredDealer, sink: SourceSink, *,
                 chunks_per_request: int, request_timeout: float, limits: wire.Limits,
                 on_handshake: Callable[[TransportError, bool], None]) -> None:
        super().__init__(fetcher, dealer, sink, chunks_per_request=chunks_per_request,
                         request_timeout=request_timeout, limits=limits)
        self._on_handshake = on_handshake
        self.refused_by: TransportError | None = None  # its last handshake was refused (CURVE)
        self.rank = 0
        self.rank_publisher = ""
        self.first_chunk = 0
        self.num_chunks = 0
        self._cursor = 0  # self._mine[:cursor] are in (the current target's)

    @property
    def label(self) -> str:
        return f"trainer rank {self.rank} (slices)"

    def follow(self, shard: wire.ShardSource, plan: SlicePlan) -> None:
        """Serve ``shard``'s range with ``plan`` (this rank's part): a new part is
        registered anew."""
        self.rank, self.rank_publisher = shard.rank, shard.publisher_id
        self.first_chunk, self.num_chunks = shard.first_chunk, shard.num_chunks
        digest = plan.digest()
        if digest != self.digest:
            self.plan, self.digest = plan, digest
            self.registered.clear()
            self.refusing.clear()
        self._target = None  # the scope changed: follow the target afresh

    # -- the scope ------------------------------------------------------------------------------
    def publisher_id(self, target: Assembly) -> str:
        return self.rank_publisher

    def serves(self, target: SparseAssembly) -> tuple[int, ...]:
        self._cursor = 0
        end = self.first_chunk + self.num_chunks
        return tuple(c for c in target.layout.chunks if self.first_chunk <= c < end)

    def wire_chunk(self, chunk: int) -> int:
        return chunk - self.first_chunk

    def union_header(self, header: chunk_frame.ChunkHeader) -> chunk_frame.ChunkHeader:
        return chunk_frame.ChunkHeader(req=header.req, version=header.version,
                                       chunk=header.chunk + self.first_chunk,
                                       size=header.size, follows=header.follows)

    def next_chunks(self, target: Assembly, asked: set[int], limit: int) -> list[int]:
        mine, missing = self._mine, target.missing
        while self._cursor < len(mine) and mine[self._cursor] not in missing:
            self._cursor += 1
        todo: list[int] = []
        for chunk in mine[self._cursor:]:
            if len(todo) >= limit:
                break
            if chunk in missing and chunk not in asked:
                todo.append(chunk)
        return todo

    def _fall_back(self, target: SparseAssembly, cause: str) -> None:
        if self._whole is None:
            self.fetcher.last_refusal = f"trainer rank {self.rank}: whole chunks ({cause})" + (
                f": {self.fetcher.last_refusal}" if cause in ("refused", "busy", "evicted")
                and self.fetcher.last_refusal else "")
        super()._fall_back(target, "sharded")

    # -- a rank that is gone or refuses this client ---------------------------------------------
    def on_handshakes(self, results: list[str | None]) -> None:
        self.refused_by = rank_handshakes(self.rank, self.refused_by, results,
                                          self._on_handshake)

    def expire(self, now: float, retry: Retry) -> bool:
        timeout = self.request_timeout
        if not self.dealer.connected and any(
                True for _ in self._sink.requests.timed_out(now, timeout, self, self.answered)):
            target = None if self._target is None else self._target()
            version = 0 if target is None else target.manifest.version
            why = self.refused_by or f"trainer rank {self.rank}'s shard at {self.endpoint} " \
                "is not connected (unreachable or gone)"
            self._sink.give_up(WeightPubTimeout(
                f"version {version}: chunks timed out after {timeout}s: {why}; given up"))
            return True
        return super().expire(now, retry)

    def idle_limit(self) -> float | None:
        """A range no link serves is named after this long (``FetchCredit``'s idle watch),
        long enough for a rank's registration and sums to be asked ``CONTROL_TRIES`` times
        each (nothing is asked of it meanwhile) before it serves whole chunks."""
        return (2 * CONTROL_TRIES + 1) * self.request_timeout


class ShardSlices:
    """The picker for a sliced subscriber's sharded manifests: a ``RankSliceSource`` per
    rank whose part of the plan is not empty (``SyncClient(pickers=...)``, after the
    ``SliceFetcher``)."""

    def __init__(self, fetcher: SliceFetcher) -> None:
        self.fetcher = fetcher
        #: a link's handshake refused (True) or taken after that (False): the client's
        #: ``ClientSockets.link_handshake``, set once the client exists
        self.on_handshake: Callable[[TransportError, bool], None] = lambda error, refused: None
        self.links: dict[str, RankSliceSource] = {}
        #: the ranks' stream sources (set by the subscriber when ``stream=True``)
        self.stream: StreamPicker | None = None
        self._following: wire.Manifest | None = None
        self._picked: list[ChunkSource] = []

    def __call__(self, manifest: wire.Manifest,
                 sink: SourceSink) -> Sequence[ChunkSource] | None:
        """The rank links of a sharded manifest, their stream sources first (where
        offered); None for a manifest that is not sharded."""
        if manifest.shards is None:
            return None
        if manifest is not self._following:
            self._following = manifest
            links = self._follow(manifest, sink)
            streams = {} if self.stream is None else self.stream.follow_ranks(
                manifest, {endpoint: link.send for endpoint, link in self.links.items()},
                sink)
            for endpoint, link in self.links.items():
                link.stream = streams.get(endpoint)
            self._picked = [*streams.values(), *links]
        return self._picked

    def _follow(self, manifest: wire.Manifest, sink: SourceSink) -> list[RankSliceSource]:
        assert manifest.shards is not None
        wanted: dict[str, RankSliceSource] = {}
        for shard in manifest.shards:
            part = rank_plan(self.fetcher.plan, manifest, shard)
            if not part.tensors:
                continue  # this rank owns nothing the plan reads: no link to it
            link = wanted.get(shard.endpoint) or self.links.get(shard.endpoint) \
                or self._open(shard.endpoint, sink)
            link.follow(shard, part)
            wanted[shard.endpoint] = link
        for endpoint, link in self.links.items():
            if endpoint not in wanted:
                link.close()
        self.links = wanted
        return list(wanted.values())

    def _open(self, endpoint: str, sink: SourceSink) -> RankSliceSource:
        fetcher = self.fetcher
        dealer = MonitoredDealer(fetcher.ctx, endpoint, hooks=fetcher.hooks, events=LINK_EVENTS,
                                 handshake_timeout=fetcher.request_timeout,
                                 max_message_bytes=chunk_reply_bytes(
                                     fetcher.limits.max_control_bytes))
        return RankSliceSource(fetcher, dealer, sink,
                               chunks_per_request=fetcher.chunks_per_request,
                               request_timeout=fetcher.request_timeout, limits=fetcher.limits,
                               on_handshake=lambda error, refused: self.on_handshake(error,
                                                                                     refused))

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links = {}
        self._following = None
        self._picked = []
