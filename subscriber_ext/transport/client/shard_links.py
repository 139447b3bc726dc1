"""A sharded version's chunks, each fetched from the trainer rank that serves it.

A manifest with ``shards`` (``publisher.sharded_publisher``) says which rank's
ROUTER serves which chunk range; the rank numbers its own chunks from 0. Each
rank is a ``ChunkSource`` (``ShardRankSource``, ``staging/chunk_source.py``) with
one DEALER (``weightpub_wire/monitored_dealer.py``); ``ShardLinks`` is the picker
that gives a sharded manifest its ranks (opened when a manifest names them, closed
when the target's manifest no longer does). Like the publisher's own
credit, at most the client's window of chunks is in flight per rank, in requests
of ``chunks_per_request``; requests name the rank's chunk ids and instance,
replies are renumbered into the union before ``ChunkReceiver`` places and
verifies them, so checksums, conflation and the all-or-nothing staging are the
client's as for any version (deltas too: ``base`` is passed on, each rank serves its
range's deltas against its own shard of the base). A request a rank leaves unanswered for
``request_timeout`` (counted from that rank's last chunk, at most
``QUEUED_TIMEOUT_FACTOR`` timeouts in all) is asked again and counts a try of
each chunk: a rank that died costs the version after ``max_chunk_retries``.

No stall without a named error (issue 28.1): a request that times out at a rank this
client is not connected to (unreachable, refused, or gone) gives the version up at
once, naming the rank; and a version with chunks missing and nothing asked of anyone
for ``request_timeout`` (a range no link serves) is given up by ``FetchCredit``'s
``IdleWatch``, naming the ranks whose chunks are missing (``idle_limit``). Either way
``last_error`` says so and the next version is followed.

Stream (``stream=True`` here and at a rank): a rank whose ``ShardSource`` has a
``stream_port`` gets a ``StreamSource`` of its own (``stream_source.py``, a first
source taking that rank's range only), which asks its one-time token over this rank's
DEALER (the reply is read here and handed to it) and receives the range on the
rank's port; whatever fails there falls back to this rank's frames, counted per rank.

CURVE: every link gets the client's socket hooks (``curve_server_key_file``,
``curve_secret_key_file``): all ranks of a sharded trainer serve with the one
trainer key pair, so the publisher's public key authenticates each rank too, and
each rank admits this client only if its allow-list does. A refused handshake on a
link becomes ``last_error`` at once (each link's monitor), naming the rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import ClassVar

import zmq

from subscriber_ext.transport.client.dealer_source import DealerSource, rank_handshakes
from subscriber_ext.transport.client.stream_source import StreamPicker, StreamSource
from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.chunk_source import ChunkSource, Retry, SourceSink
from weightpub_wire import chunk_frame, stream_link
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ProtocolError, TransportError, WeightPubTimeout
from weightpub_wire.monitored_dealer import (
    LINK_EVENTS,
    MonitoredDealer,
    SocketHook,
    chunk_reply_bytes,
)
from weightpub_wire.reply_reader import read_replies

__all__ = ["ShardLinks", "ShardRankSource"]


class ShardRankSource(DealerSource):
    """One DEALER to one trainer rank, and that rank's part of the current target."""

    kind: ClassVar[str] = "shard_ranks"

    def __init__(self, dealer: MonitoredDealer, sink: SourceSink, *, chunks_per_request: int,
                 request_timeout: float, limits: wire.Limits,
                 on_handshake: Callable[[TransportError, bool], None]) -> None:
        super().__init__(dealer, sink, chunks_per_request=chunks_per_request,
                         request_timeout=request_timeout, limits=limits)
        self._on_handshake = on_handshake
        self.rank = 0
        self.refused_by: TransportError | None = None  # its last handshake was refused (CURVE)
        self.first_chunk = 0
        self.num_chunks = 0
        self.publisher_id = ""
        self.cursor = 0  # chunks below first_chunk + cursor are in (the target's)
        self.stream: StreamSource | None = None  # this rank's stream port, when offered
        self._fetching: tuple[weakref.ref[Assembly], int, int] | None = None

    @property
    def label(self) -> str:
        return f"trainer rank {self.rank}"

    def serve(self, shard: wire.ShardSource) -> None:
        """Follow a manifest's range for this rank (its cursor starts over)."""
        self.rank = shard.rank
        self.first_chunk, self.num_chunks = shard.first_chunk, shard.num_chunks
        self.publisher_id, self.cursor = shard.publisher_id, 0

    # -- asking --------------------------------------------------------------------------------
    def candidates(self, target: Assembly, asked: set[int], limit: int) -> list[int]:
        self._start_over(target)
        missing = target.missing
        end = self.first_chunk + self.num_chunks
        while self.cursor < self.num_chunks and self.first_chunk + self.cursor not in missing:
            self.cursor += 1
        todo: list[int] = []
        chunk = self.first_chunk + self.cursor
        while chunk < end and len(todo) < limit:
            if chunk in missing and chunk not in asked:
                todo.append(chunk)
            chunk += 1
        return todo

    def ask(self, target: Assembly, chunks: Sequence[int], now: float) -> list[int]:
        def request(req: int, batch: list[int]) -> wire.FetchRequest:
            return wire.FetchRequest(
                req=req, publisher_id=self.publisher_id, version=target.fetch_version,
                chunks=tuple(c - self.first_chunk for c in batch), base=target.fetch_base)

        return self.ask_batches(chunks, now, request)

    def _start_over(self, target: Assembly) -> None:
        """The cursor back to the rank's first chunk for a new fetch: another target, the
        next delta of a chain (the rank's deltas against its own range of the base), or the
        same version again in full after a delta failed."""
        fetching = self._fetching
        if fetching is None or fetching[0]() is not target or \
                fetching[1:] != (target.fetch_version, target.fetch_base):
            self._fetching = (weakref.ref(target), target.fetch_version, target.fetch_base)
            self.cursor = 0

    def expire(self, now: float, retry: Retry) -> bool:
        """Re-ask what the rank left unanswered too long; each chunk counts a try."""
        timeout = self.request_timeout
        for request in self._sink.requests.timed_out(now, timeout, self, self.answered):
            if not self.dealer.connected:  # asking again cannot help: say which rank, now
                why = self.refused_by or f"trainer rank {self.rank}'s shard at " \
                    f"{self.endpoint} is not connected (unreachable or gone)"
                version = 0 if self._fetching is None else self._fetching[1]
                self._sink.give_up(WeightPubTimeout(
                    f"version {version}: chunks timed out after {timeout}s: {why}; given up"))
                return True
            for chunk in sorted(request.chunks):
                if retry(chunk, "timed out at its trainer rank", WeightPubTimeout):
                    return True
        return False

    def idle_limit(self) -> float | None:
        return self.request_timeout

    # -- replies -------------------------------------------------------------------------------
    def on_handshakes(self, results: list[str | None]) -> None:
        self.refused_by = rank_handshakes(self.rank, self.refused_by, results,
                                          self._on_handshake)

    def read(self, now: float) -> None:
        def chunk(header: chunk_frame.ChunkHeader, frame: zmq.Frame) -> None:
            self.answered = now
            union = chunk_frame.ChunkHeader(req=header.req, version=header.version,
                                            chunk=header.chunk + self.first_chunk,
                                            size=header.size, follows=header.follows)
            self._sink.chunk(union, frame, self, self)

        def error(reply: wire.ErrorReply) -> None:
            stream = self.stream
            if stream is not None and stream.owns(reply):  # no token: frames serve
                stream.on_reply(reply)
            else:
                sink.error(reply)

        def other(message: stream_link.StreamToken) -> None:
            stream = self.stream
            if stream is not None and stream.owns(message):
                stream.on_reply(message)  # else a token nobody waits for: dropped

        sink = self._sink
        read_replies(self.sock, self.limits, most=256, pairing=self.pairing,
                     discard_rest=sink.discard_rest,
                     on_chunk=chunk, on_error=error,
                     on_bad=lambda exc: sink.bad(
                         ProtocolError(f"shard {self.endpoint}: bad reply: {exc}")),
                     others=(stream_link.StreamToken,), on_other=other)


class ShardLinks:
    """The picker for sharded manifests: a ``ShardRankSource`` per rank it names."""

    def __init__(self, ctx: zmq.Context, *, limits: wire.Limits,
                 chunks_per_request: int, request_timeout: float,
                 on_handshake: Callable[[TransportError, bool], None] = lambda e, r: None,
                 hooks: Sequence[SocketHook] = ()) -> None:
        """``hooks``: the client's socket hooks (CURVE), applied to every link;
        ``on_handshake(error, refused)``: a link's handshake was refused (True), or
        succeeded after that refusal (False)."""
        self.ctx = ctx
        self.limits = limits
        self.chunks_per_request = chunks_per_request
        self.request_timeout = request_timeout
        self._on_handshake = on_handshake
        self.hooks = list(hooks)
        self.links: dict[str, ShardRankSource] = {}
        #: the ranks' stream sources (set by the subscriber when ``stream=True``)
        self.stream: StreamPicker | None = None
        self._following: wire.Manifest | None = None

    def __call__(self, manifest: wire.Manifest, sink: SourceSink) -> list[ChunkSource] | None:
        """The picker (``SourcePicker``): the ranks of a sharded manifest (their stream
        sources first, where offered), else None; ``sink``: the client's (replies arrive
        renumbered into the union's chunk ids)."""
        if manifest.shards is None:
            return None
        self.follow(manifest, sink)
        streams = [link.stream for link in self.links.values() if link.stream is not None]
        return [*streams, *self.links.values()]

    def follow(self, manifest: wire.Manifest, sink: SourceSink) -> None:
        """Links for every rank ``manifest`` names (the others closed), set to its ranges."""
        if manifest is self._following or manifest.shards is None:
            return
        self._following = manifest
        wanted: dict[str, ShardRankSource] = {}
        for shard in manifest.shards:
            link = wanted.get(shard.endpoint) or self.links.get(shard.endpoint) \
                or self._open(shard.endpoint, sink)
            link.serve(shard)
            wanted[shard.endpoint] = link
        for endpoint, link in self.links.items():
            if endpoint not in wanted:
                link.close()
        self.links = wanted
        streams = {} if self.stream is None else self.stream.follow_ranks(
            manifest, {endpoint: link.send for endpoint, link in wanted.items()}, sink)
        for endpoint, link in wanted.items():
            link.stream = streams.get(endpoint)

    def _open(self, endpoint: str, sink: SourceSink) -> ShardRankSource:
        dealer = MonitoredDealer(self.ctx, endpoint, hooks=self.hooks, events=LINK_EVENTS,
                                 handshake_timeout=self.request_timeout,
                                 max_message_bytes=chunk_reply_bytes(
                                     self.limits.max_control_bytes))
        return ShardRankSource(dealer, sink, chunks_per_request=self.chunks_per_request,
                               request_timeout=self.request_timeout, limits=self.limits,
                               on_handshake=self._on_handshake)

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links = {}
        self._following = None
