"""A sharded version's chunks, each fetched from the trainer rank that serves it.

A manifest with ``shards`` (``publisher.sharded_publisher``) says which rank's
ROUTER serves which chunk range; the rank numbers its own chunks from 0. This
keeps one DEALER per rank endpoint (opened when a manifest names it, closed
when the target's manifest no longer does) and, like the publisher's own
credit, at most the client's window of chunks in flight per rank, in requests
of ``chunks_per_request``; requests name the rank's chunk ids and instance,
replies are renumbered into the union before ``ChunkReceiver`` places and
verifies them, so checksums, conflation and the all-or-nothing staging are the
client's as for any version (deltas too: ``base`` is passed on, each rank serves its
range's deltas against its own shard of the base). A request a rank leaves unanswered for
``request_timeout`` (counted from that rank's last chunk, at most
``QUEUED_TIMEOUT_FACTOR`` timeouts in all) is asked again and counts a try of
each chunk: a rank that died costs the version after ``max_chunk_retries``.

CURVE: every link gets the client's socket hooks (``curve_server_key_file``,
``curve_secret_key_file``): all ranks of a sharded trainer serve with the one
trainer key pair, so the publisher's public key authenticates each rank too, and
each rank admits this client only if its allow-list does. A refused handshake on a
link becomes ``last_error`` at once (each link's monitor), naming the rank.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.request_table import QUEUED_TIMEOUT_FACTOR, RequestTable
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ProtocolError, TransportError
from weightpub_wire.monitor import describe_handshake_failure, open_monitor, read_events
from weightpub_wire.reply_reader import read_replies
from weightpub_wire.sockets import configure_socket, connect

__all__ = ["ShardLink", "ShardLinks"]


@dataclass(eq=False, slots=True)
class ShardLink:
    """One DEALER to one rank, and that rank's part of the current target."""

    endpoint: str
    sock: zmq.Socket
    monitor: zmq.Socket  # its handshake events (a CURVE refusal)
    rank: int = 0
    refused: TransportError | None = None  # its last handshake was refused (CURVE)
    first_chunk: int = 0
    num_chunks: int = 0
    publisher_id: str = ""
    cursor: int = 0  # chunks below first_chunk + cursor are in (the target's)
    answered: float = 0.0  # the rank's last chunk
    bad: dict[str, int] = field(default_factory=dict)
    #: a header (chunk_frame.FOLLOWS) whose payload is this socket's next message
    pairing: chunk_frame.PayloadPairing = field(default_factory=chunk_frame.PayloadPairing)


class ShardLinks:
    """Runs on the subscriber's thread, beside the publisher's DEALER."""

    def __init__(self, ctx: zmq.Context, requests: RequestTable, *, limits: wire.Limits,
                 chunks_per_request: int, request_timeout: float,
                 on_chunk: Callable[[chunk_frame.ChunkHeader, zmq.Frame, zmq.Socket], None],
                 on_error: Callable[[wire.ErrorReply], None],
                 on_bad: Callable[[ProtocolError], None],
                 discard_rest: Callable[[int, zmq.Socket], None],
                 on_handshake: Callable[[TransportError, bool], None] = lambda e, r: None,
                 hooks: list[Callable[..., None]] | None = None) -> None:
        """``on_chunk``, ``on_error``, ``on_bad``, ``discard_rest``: the client's, for a
        reply on a rank's DEALER (chunk ids already in the union's numbering).
        ``hooks``: the client's socket hooks (CURVE), applied to every link;
        ``on_handshake(error, refused)``: a link's handshake was refused (True), or
        succeeded after that refusal (False)."""
        self.ctx = ctx
        self.requests = requests
        self.limits = limits
        self.chunks_per_request = chunks_per_request
        self.request_timeout = request_timeout
        self._on_chunk = on_chunk
        self._on_error = on_error
        self._on_bad = on_bad
        self._discard_rest = discard_rest
        self._on_handshake = on_handshake
        self.hooks = list(hooks or [])
        self.links: dict[str, ShardLink] = {}
        self.poller: zmq.Poller | None = None
        self._following: wire.Manifest | None = None
        self._fetching: tuple[weakref.ref[Assembly], int, int] | None = None

    # -- sockets -------------------------------------------------------------------------------
    def register(self, poller: zmq.Poller) -> None:
        self.poller = poller
        for link in self.links.values():
            poller.register(link.sock, zmq.POLLIN)
            poller.register(link.monitor, zmq.POLLIN)

    def follow(self, manifest: wire.Manifest) -> None:
        """Links for every rank ``manifest`` names (the others closed), set to its ranges."""
        if manifest is self._following or manifest.shards is None:
            return
        self._following = manifest
        wanted: dict[str, ShardLink] = {}
        for shard in manifest.shards:
            link = wanted.get(shard.endpoint) or self.links.get(shard.endpoint) \
                or self._open(shard.endpoint)
            link.rank = shard.rank
            link.first_chunk, link.num_chunks = shard.first_chunk, shard.num_chunks
            link.publisher_id, link.cursor = shard.publisher_id, 0
            wanted[shard.endpoint] = link
        for endpoint, link in self.links.items():
            if endpoint not in wanted:
                self._close(link)
        self.links = wanted

    def _open(self, endpoint: str) -> ShardLink:
        sock = self.ctx.socket(zmq.DEALER)
        configure_socket(sock, heartbeat_interval=1.0)
        for hook in self.hooks:
            hook(sock, server=False)
        sock.setsockopt(zmq.RCVHWM, 0)  # as the publisher's DEALER (client_sockets.py)
        sock.setsockopt(zmq.HANDSHAKE_IVL, max(1000, int(self.request_timeout * 1000)))
        sock.setsockopt(zmq.MAXMSGSIZE, max(wire.MAX_CHUNK_SIZE + wire.CHUNK_HEADER_BYTES,
                                            self.limits.max_control_bytes))
        monitor = open_monitor(sock, zmq.EVENT_HANDSHAKE_FAILED_AUTH
                               | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                               | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                               | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        connect(sock, endpoint)
        if self.poller is not None:
            self.poller.register(sock, zmq.POLLIN)
            self.poller.register(monitor, zmq.POLLIN)
        return ShardLink(endpoint, sock, monitor, answered=time.monotonic())

    def _close(self, link: ShardLink) -> None:
        self.requests.drop(link)
        if self.poller is not None:
            self.poller.unregister(link.sock)
            self.poller.unregister(link.monitor)
        link.monitor.close(linger=0)
        link.sock.close(linger=0)

    def close(self) -> None:
        for link in self.links.values():
            self._close(link)
        self.links = {}
        self._following = None
        self._fetching = None

    # -- asking --------------------------------------------------------------------------------
    def top_up(self, target: Assembly, window: int, now: float, *,
               route: Callable[[list[int]], list[int]] | None = None, ahead: int = 0) -> None:
        """Ask each rank for its missing chunks while it has fewer than ``window`` in flight.

        ``route(chunks)``: a peer-sharing client's split (``Peering.route``): it asks
        peers for their chunks of ``chunks`` (up to ``window + ahead`` of the rank's next
        ones, ascending) and returns those left for the rank."""
        self.follow(target.manifest)
        self._start_over(target)
        in_flight = self.requests.peer_in_flight()
        asked = self.requests.asked()
        missing = target.missing
        for link in self.links.values():
            room = window - in_flight.get(link, 0)
            if room <= 0 and route is None:
                continue
            end = link.first_chunk + link.num_chunks
            while link.cursor < link.num_chunks and \
                    link.first_chunk + link.cursor not in missing:
                link.cursor += 1
            todo: list[int] = []
            chunk = link.first_chunk + link.cursor
            scan = max(room, 0) + (ahead if route is not None else 0)
            while chunk < end and len(todo) < scan:
                if chunk in missing and chunk not in asked:
                    todo.append(chunk)
                chunk += 1
            if route is not None and todo:
                todo = route(todo)[: max(room, 0)]
            if todo and not in_flight.get(link):
                link.answered = now  # an idle rank's silence counts from now
            while todo:
                batch, todo = todo[: self.chunks_per_request], todo[self.chunks_per_request:]
                req = self.requests.next_id()
                request = wire.FetchRequest(
                    req=req, publisher_id=link.publisher_id, version=target.fetch_version,
                    chunks=tuple(c - link.first_chunk for c in batch), base=target.fetch_base)
                try:
                    link.sock.send(wire.encode(request), flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.requests.track(req, batch, now, source=link)

    def _start_over(self, target: Assembly) -> None:
        """Every rank's cursor back to its first chunk for a new fetch: another target, the
        next delta of a chain (the rank's deltas against its own range of the base), or the
        same version again in full after a delta failed."""
        fetching = self._fetching
        if fetching is None or fetching[0]() is not target or \
                fetching[1:] != (target.fetch_version, target.fetch_base):
            self._fetching = (weakref.ref(target), target.fetch_version, target.fetch_base)
            for link in self.links.values():
                link.cursor = 0

    def expire(self, now: float, retry: Callable[[int], bool]) -> None:
        """Re-ask what a rank left unanswered too long; ``retry(chunk)`` counts a try and
        is True when the version was given up."""
        timeout = self.request_timeout
        for req, request in list(self.requests.requests.items()):
            link = request.source
            if not isinstance(link, ShardLink):
                continue
            waited = now - request.sent_at
            if waited < QUEUED_TIMEOUT_FACTOR * timeout and \
                    now - max(request.sent_at, link.answered) < timeout:
                continue
            del self.requests.requests[req]
            for chunk in sorted(request.chunks):
                if retry(chunk):
                    return

    # -- replies -------------------------------------------------------------------------------
    def on_events(self, events: dict[object, int], now: float) -> None:
        for link in list(self.links.values()):
            if link.monitor in events:
                self._handshakes(link)
            if link.sock in events:
                self._read(link, now)

    def _handshakes(self, link: ShardLink) -> None:
        for event in read_events(link.monitor):
            if event.event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if link.refused is not None:
                    self._on_handshake(link.refused, False)
                    link.refused = None
                continue
            why = describe_handshake_failure(event, client=True)
            if why is not None:
                link.refused = TransportError(f"trainer rank {link.rank}'s shard: {why}")
                self._on_handshake(link.refused, True)

    def _read(self, link: ShardLink, now: float) -> None:
        def chunk(header: chunk_frame.ChunkHeader, frame: zmq.Frame) -> None:
            link.answered = now
            union = chunk_frame.ChunkHeader(req=header.req, version=header.version,
                                            chunk=header.chunk + link.first_chunk,
                                            size=header.size, follows=header.follows)
            self._on_chunk(union, frame, link.sock)

        read_replies(link.sock, self.limits, most=256, pairing=link.pairing,
                     discard_rest=self._discard_rest,
                     on_chunk=chunk, on_error=self._on_error,
                     on_bad=lambda exc: self._on_bad(
                         ProtocolError(f"shard {link.endpoint}: bad reply: {exc}")))
