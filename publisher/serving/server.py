"""The publisher's serving thread: ROUTER requests, PUB manifests and heartbeats.

All ZeroMQ sockets live on this one thread (sockets are not thread-safe);
other threads talk to it through an inproc PULL socket. A request that fails
validation gets an ``error`` reply or is dropped, never an exception that
stops the loop. Each loop iteration does a bounded amount of work (at most
``max_requests_per_loop`` requests), so heartbeats go out on time whatever a
peer sends.

What a peer may make this thread hold is bounded in three places:
``connections.py`` (bytes ZeroMQ buffers for a connection, connection count),
``peers.py`` (replies queued for a peer, chunks it has outstanding, stalled
readers) and ``reports.py`` (back-channel rows). Warnings are rate-limited.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from publisher.collective.collective_sender import CollectivePublisher
from publisher.deltas.delta_encoder import DeltaPublisher
from publisher.serving.connection_credit import Peer, PeerLimits, PeerTable
from publisher.serving.connections import ConnectionGuard, GuardLimits
from publisher.serving.delta_serving import DeltaServing
from publisher.serving.reports import ReportLimits, ReportTable
from publisher.serving.slice_serving import SliceLimits, SliceServing
from publisher.serving.stream_server import StreamServer
from publisher.serving.sum_serving import SumServing
from publisher.serving.tracker import Tracker, TrackerLimits
from publisher.store.version_store import PublishedVersion, VersionStore
from weightpub_wire import protocol as wire
from weightpub_wire.allow_list import AllowList
from weightpub_wire.chunk_frame import ChunkHeader
from weightpub_wire.errors import ProtocolError, ProtocolVersionError
from weightpub_wire.message_base import _Message
from weightpub_wire.peer_protocol import PeerHello
from weightpub_wire.ratelog import RateLimitedLog
from weightpub_wire.slice_messages import SLICE_REQUESTS
from weightpub_wire.sockets import bind, configure_socket
from weightpub_wire.stream_link import StreamToken, StreamTokenRequest
from weightpub_wire.sum_messages import SUM_REQUESTS, ChunkSums

__all__ = ["GuardLimits", "PeerLimits", "ReportLimits", "ServerLimits", "ServerOptions",
           "ServingThread", "SliceLimits", "StatusExtras", "TrackerLimits"]

log = logging.getLogger("weightpub.publisher")
_REQUESTS: tuple[type[_Message], ...] = (
    wire.LatestRequest, wire.FetchRequest, wire.StatusRequest, wire.Report,
    wire.CollectivePoll, PeerHello, StreamTokenRequest, *SLICE_REQUESTS, *SUM_REQUESTS)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Every bound the serving thread enforces (see docs/RELIABILITY.md)."""

    max_request_bytes: int = 64 << 10  # one request frame (ZeroMQ MAXMSGSIZE)
    max_chunks_per_request: int = 256
    max_requests_per_loop: int = 1000
    router_rcvhwm: int = 256  # complete requests ZeroMQ queues per peer
    peers: PeerLimits = field(default_factory=PeerLimits)
    reports: ReportLimits = field(default_factory=ReportLimits)
    connections: GuardLimits = field(default_factory=GuardLimits)
    tracker: TrackerLimits = field(default_factory=TrackerLimits)  # peer sharing (tracker.py)
    slices: SliceLimits = field(default_factory=SliceLimits)  # slice fetches (slice_serving.py)


@dataclass(frozen=True, slots=True)
class StatusExtras:
    """What a status reply says beyond the serving thread's own state."""

    memory: wire.HostMemory | None = None
    shard_group: wire.ShardGroup | None = None
    nixl: wire.NixlHolding | None = None  # the NIXL offers (``nixl=True``)


@dataclass(frozen=True, slots=True)
class ServerOptions:
    router_bind: str
    pub_bind: str
    heartbeat_interval: float = 1.0
    limits: ServerLimits = field(default_factory=ServerLimits)
    curve: bool = False  # requests carry the client's CURVE key (User-Id)
    allow_list: AllowList | None = None  # checked on every request, not only at connect


class ServingThread(threading.Thread):
    """Owns the ROUTER and PUB sockets; announces versions and serves their chunks."""

    def __init__(self, ctx: zmq.Context, store: VersionStore, options: ServerOptions,
                 *, publisher_id: str, started_at: float,
                 configure: list | None = None, deltas: DeltaPublisher | None = None,
                 collective: CollectivePublisher | None = None,
                 status_extras: Callable[[], StatusExtras] | None = None,
                 budget_room: Callable[[], int] | None = None) -> None:
        """``status_extras``: what the owner adds to a status reply (its host memory, a
        shard group), called on this thread: it must only read. ``budget_room``: the
        host budget left beside the snapshots, which reply scratch must stay within."""
        super().__init__(name="weightpub-publish-serve", daemon=True)
        self._status_extras = status_extras
        self._budget_room = budget_room
        self.collective = collective  # answers polls; its own thread does the rest
        self.ctx = ctx
        self.store = store
        self.options = options
        self.limits = options.limits
        self.publisher_id = publisher_id
        self.started_at = started_at
        self.command_address = f"inproc://weightpub-cmd-{uuid.uuid4().hex}"
        self.router_endpoint = ""
        self.pub_endpoint = ""
        self._configure = configure or []
        self.reports = ReportTable(self.limits.reports)
        self.tracker = Tracker(self.limits.tracker, publisher_id, started_at)
        self.peers: PeerTable | None = None
        #: the plain-TCP stream port (``stream=True``): tokens for it are handed out here
        self.stream: StreamServer | None = None
        self.guard: ConnectionGuard | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._warn = RateLimitedLog(log)
        self.bad_messages = 0
        self.refused_reports = 0
        self.slice_serving = SliceServing(  # plans, their checksums and their bytes (issue 30)
            store, publisher_id, self._send_to, self._reply_to, limits=self.limits.slices,
            max_chunks_per_request=self.limits.max_chunks_per_request)
        #: early checksums (``announce_early``): handed on as their hashes end
        self.sum_serving = SumServing(store, publisher_id, self._reply_to)
        self.delta_serving = DeltaServing(  # answers fetches that name a delta base
            deltas, store, publisher_id, self._send_to, self._reply_to,
            max_chunks_per_request=self.limits.max_chunks_per_request,
            slice_layouts=self.slice_serving.layout_for)  # a sliced subscriber's deltas

    # -- lifecycle -----------------------------------------------------------------------------
    def start_and_wait(self, timeout: float = 10.0) -> None:
        self.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("publisher serving thread did not start")
        if self._error is not None:
            raise self._error

    def send_command(self, *frames: bytes) -> None:
        """Thread-safe: a short-lived PUSH socket per call (commands are rare)."""
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        try:
            push.connect(self.command_address)
            push.send_multipart(list(frames), flags=0)
        finally:
            push.close()

    def fleet(self) -> list[wire.Report]:
        return self.reports.live(time.time())

    @property
    def served_bytes(self) -> int:
        """Full-version chunk bytes sent (delta chunks: ``delta_serving.bytes_sent``)."""
        return 0 if self.peers is None else self.peers.chunk_bytes

    def _send_to(self, identity: bytes, header: ChunkHeader, body: memoryview | bytes,
                 version: PublishedVersion | None, owned: bool = False) -> bool:
        assert self.peers is not None
        return self.peers.send_to(identity, header, body, version, owned)

    def _reply_to(self, identity: bytes, body: bytes) -> bool:
        assert self.peers is not None
        return self.peers.reply_to(identity, body)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            router, pub, commands, guard = self._open_sockets()
        except BaseException as exc:  # surfaced to the constructor
            self._error = exc
            self._ready.set()
            return
        self.guard = guard
        peers = self.peers = PeerTable(router, self.limits.peers, guard, self._is_held,
                                       self._budget_room)
        peers.is_overwriting = self.store.writers_waiting
        self._ready.set()
        poller = zmq.Poller()
        for sock in (router, commands, *guard.monitors):
            poller.register(sock, zmq.POLLIN)
        next_beat = 0.0
        try:
            while True:
                now = time.monotonic()
                if now >= next_beat:
                    self._heartbeat(pub)
                    next_beat = now + self.options.heartbeat_interval
                timeout_ms = max(0, int((next_beat - time.monotonic()) * 1000))
                timeout_ms = min(timeout_ms, int(self.limits.connections.check_interval * 1000))
                if peers.busy() or self.delta_serving.waiting or self.slice_serving.waiting \
                        or self.sum_serving.waiting:
                    timeout_ms = min(timeout_ms, 1)  # a copy/encoding finishes, a peer drains
                events = dict(poller.poll(timeout_ms))
                if commands in events and not self._on_command(commands, pub):
                    return
                try:
                    guard.on_events(events)
                    if router in events:
                        self._drain_router(router, peers, guard)
                    now = time.monotonic()
                    peers.pump(now)
                    self.delta_serving.flush()
                    self.slice_serving.flush()
                    self.sum_serving.flush()
                    guard.check(now)
                except Exception as exc:  # one peer's surprise must not stop the service
                    self._warn.warning("loop", f"serving loop error (continuing): "
                                               f"{type(exc).__name__}: {exc}")
                    log.debug("serving loop error", exc_info=True)
                self._warn.tick()
        finally:
            self.slice_serving.close()
            self.sum_serving.close()
            guard.close()
            for sock in (router, pub, commands):
                sock.close(linger=0)

    def _open_sockets(self) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket, ConnectionGuard]:
        commands = self.ctx.socket(zmq.PULL)
        commands.bind(self.command_address)
        router = self.ctx.socket(zmq.ROUTER)
        pub = self.ctx.socket(zmq.PUB)
        for sock in (router, pub):
            # the ROUTER serves many peers and pings none (weightpub_wire.sockets)
            configure_socket(sock, heartbeat_interval=self.options.heartbeat_interval,
                             pings=sock is pub)
            sock.setsockopt(zmq.HANDSHAKE_IVL, 10_000)
            for hook in self._configure:
                hook(sock, server=True)
        limits = self.limits
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer: an error, not a silent drop
        # two messages a chunk (header, payload: chunk_frame.FOLLOWS) and control replies
        router.setsockopt(zmq.SNDHWM, 2 * limits.peers.max_pending_chunks + 1024)
        router.setsockopt(zmq.RCVHWM, limits.router_rcvhwm)
        # requests are small; ZeroMQ drops a peer that sends a bigger frame before
        # allocating it (a message of many frames is bounded by connections.py)
        router.setsockopt(zmq.MAXMSGSIZE, limits.max_request_bytes)
        pub.setsockopt(zmq.SNDHWM, 10_000)
        pub.setsockopt(zmq.MAXMSGSIZE, 4096)  # subscribers send only subscriptions
        # watched before bound: a peer connecting at once must not escape the guard
        guard = ConnectionGuard({"router": router, "pub": pub}, limits.connections)
        try:
            self.router_endpoint = bind(router, self.options.router_bind)
            self.pub_endpoint = bind(pub, self.options.pub_bind)
        except BaseException:
            guard.close()
            for sock in (router, pub, commands):
                sock.close(linger=0)
            raise
        return router, pub, commands, guard

    def _on_command(self, commands: zmq.Socket, pub: zmq.Socket) -> bool:
        frames = commands.recv_multipart()
        if frames[0] == b"close":
            return False
        if frames[0] == b"announce":
            latest = self.store.latest()
            if latest is not None:
                pub.send(wire.encode(latest.manifest))
                self._heartbeat(pub)
        return True

    def _heartbeat(self, pub: zmq.Socket) -> None:
        latest = self.store.latest()
        beat = wire.Heartbeat(
            publisher_id=self.publisher_id,
            started_at=self.started_at,
            latest_version=0 if latest is None else latest.manifest.version,
            sent_at=time.time(),
            interval=self.options.heartbeat_interval,
        )
        pub.send(wire.encode(beat))
        self.store.recycle()

    def _is_held(self, version: PublishedVersion) -> bool:
        return self.store.get(version.manifest.version) is version

    def _bad(self, kind: str, text: str) -> None:
        self.bad_messages += 1
        self._warn.warning(kind, text)

    # -- requests ------------------------------------------------------------------------------
    def _drain_router(self, router: zmq.Socket, peers: PeerTable,
                      guard: ConnectionGuard) -> None:
        for _ in range(self.limits.max_requests_per_loop):  # bounded: heartbeats never starve
            try:
                frames = router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            body_frame = frames[-1]
            fd = _property(body_frame, zmq.SRCFD)
            guard.delivered(fd if isinstance(fd, int) else None)
            if len(frames) != 2:
                self._bad("frames", f"dropped a request of {len(frames)} frames (expected 2)")
                continue
            client_key = _property(body_frame, "User-Id") if self.options.curve else None
            if self.options.allow_list is not None and (
                    not isinstance(client_key, str)
                    or not self.options.allow_list.allowed(client_key.encode())):
                self._bad("revoked", f"dropped a request from CURVE key {client_key}: not in "
                                     "the allow-list (any more); connection cut")
                guard.cut(fd if isinstance(fd, int) else None, "CURVE key revoked")
                continue
            try:
                request = wire.decode(frames[1].buffer, expect=_REQUESTS)
            except ProtocolVersionError as exc:
                self._bad("protocol", f"refused a request: {exc}")
                self._refuse_version(peers, frames, fd, exc)
                continue
            except ProtocolError as exc:
                self._bad("decode", f"dropped a bad request: {exc}")
                continue
            peer = peers.peer(frames[0].bytes, fd if isinstance(fd, int) else None,
                              time.monotonic())
            if peer is None:
                continue
            self._handle(peers, peer, request, body_frame,
                         client_key if isinstance(client_key, str) else None)

    def _refuse_version(self, peers: PeerTable, frames: list[zmq.Frame], fd: object,
                        exc: ProtocolVersionError) -> None:
        """Answer a request of another protocol version with an ``error`` naming both:
        its sender cannot decode our reply either, and says so (a ``ProtocolError``
        naming both versions) instead of waiting for an answer that never comes."""
        peer = peers.peer(frames[0].bytes, fd if isinstance(fd, int) else None,
                          time.monotonic())
        if peer is None:
            return
        error = wire.ErrorReply(req=wire.peek_req(frames[1].buffer), code="bad_request",
                                message=f"protocol version {exc.theirs} is not spoken here: "
                                        f"this publisher speaks {exc.ours}")
        peers.reply(peer, wire.encode(error))

    def _handle(self, peers: PeerTable, peer: Peer, request: wire.Message,
                frame: zmq.Frame, client_key: str | None) -> None:
        if isinstance(request, wire.FetchRequest):
            self._fetch(peers, peer, request)
        elif isinstance(request, wire.LatestRequest):
            latest = self.store.latest()
            reply = wire.LatestReply(
                req=request.req, publisher_id=self.publisher_id, started_at=self.started_at,
                pub_endpoint=self.pub_endpoint,
                heartbeat_interval=self.options.heartbeat_interval,
                manifest=None if latest is None else latest.manifest,
                collective=None if self.collective is None else self.collective.announce(),
            )
            peers.reply(peer, wire.encode(reply))
        elif isinstance(request, wire.StatusRequest):
            peers.reply(peer, wire.encode(self._status(request.req)))
        elif isinstance(request, wire.CollectivePoll):
            peers.reply(peer, wire.encode(self._collective_reply(request, frame, client_key)))
        elif isinstance(request, wire.Report):
            client = _client(frame, client_key)
            refused = self.reports.record(request, client, time.time(), client_key)
            if refused is not None:
                self.refused_reports += 1
                self._warn.warning("report", f"refused a report from {client[:48]}: {refused}")
        elif isinstance(request, PeerHello):
            self._peer_hello(peers, peer, request, frame, client_key)
        elif isinstance(request, StreamTokenRequest):
            self._stream_token(peers, peer, request, client_key)
        elif isinstance(request, ChunkSums):
            self.sum_serving.handle(peer.identity, request)
        elif isinstance(request, SLICE_REQUESTS):
            self.slice_serving.handle(peer.identity, request, len(frame.buffer))

    def _peer_hello(self, peers: PeerTable, peer: Peer, hello: PeerHello, frame: zmq.Frame,
                    client_key: str | None) -> None:
        """Peer sharing: register the subscriber with the tracker, reply with its plan."""
        if not self.tracker.enabled:
            error = wire.ErrorReply(req=hello.req, code="bad_request",
                                    message="peer sharing is off at this publisher (peer_fanout 0)")
            peers.reply(peer, wire.encode(error))
            return
        address = _property(frame, "Peer-Address")
        latest = self.store.latest()
        try:
            plan = self.tracker.hello(peer.identity, hello,
                                      address if isinstance(address, str) else None, client_key,
                                      time.monotonic(), 0 if latest is None else
                                      latest.manifest.version)
        except ProtocolError as exc:
            self._bad("tracker", f"peer hello refused: {exc}")
            error = wire.ErrorReply(req=hello.req, code="bad_request", message=str(exc))
            peers.reply(peer, wire.encode(error))
            return
        peers.reply(peer, wire.encode(plan))

    def _stream_token(self, peers: PeerTable, peer: Peer, request: StreamTokenRequest,
                      client_key: str | None) -> None:
        """A one-time token for the stream port, over this (CURVE) connection only, bound to
        the key it was asked with (revoking the key cuts the stream too)."""
        stream = self.stream
        token = None if stream is None else stream.issue_token(client_key)
        if stream is None or token is None:
            why = "the stream path is off at this publisher" if stream is None else \
                "too many stream tokens outstanding; try again later"
            peers.reply(peer, wire.encode(wire.ErrorReply(req=request.req, code="bad_request",
                                                          message=why)))
            return
        peers.reply(peer, wire.encode(StreamToken(req=request.req, token=token,
                                                  port=stream.port)))

    def _collective_reply(self, poll: wire.CollectivePoll, frame: zmq.Frame,
                          client_key: str | None) -> wire.CollectiveReply:
        if self.collective is None:
            return wire.CollectiveReply(req=poll.req, publisher_id=self.publisher_id,
                                        started_at=self.started_at, state="off",
                                        reason="this publisher serves no collective path")
        return self.collective.on_poll(_client(frame, client_key), poll)

    def _status(self, req: int) -> wire.StatusReply:
        latest = self.store.latest()
        extras = StatusExtras() if self._status_extras is None else self._status_extras()
        now = time.time()
        live = self.reports.live(now)  # the fleet's peer figures: every row, not the cut
        return wire.StatusReply(
            req=req, publisher_id=self.publisher_id, started_at=self.started_at,
            latest_version=0 if latest is None else latest.manifest.version,
            versions=self.store.versions(), subscribers=self.reports.for_status(now),
            bytes_sent_full=self.served_bytes, bytes_sent_delta=self.delta_serving.bytes_sent,
            collective=None if self.collective is None else self.collective.status(),
            memory=extras.memory, shard_group=extras.shard_group,
            bytes_sent_slices=self.slice_serving.bytes_sent,
            slice_plans=self.slice_serving.plans, slice_held_bytes=self.slice_serving.held_bytes,
            stream=None if self.stream is None else self.stream.wire_status(),
            nixl=extras.nixl,
            peer_nixl=wire.peer_total(r.peer_nixl for r in live),
            peer_stream=wire.peer_total(r.peer_stream for r in live),
        )

    def _fetch(self, peers: PeerTable, peer: Peer, request: wire.FetchRequest) -> None:
        if request.base:
            self.delta_serving.serve(peer.identity, request)
            return
        version = self.store.get(request.version)
        if version is None or version.failed or request.publisher_id != self.publisher_id:
            error = wire.ErrorReply(req=request.req, code="version_unavailable",
                                    message=f"version {request.version} of publisher "
                                            f"{request.publisher_id} is not held here "
                                            f"(held: {list(self.store.versions())})",
                                    version=request.version)
            peers.reply(peer, wire.encode(error))
            return
        if version.manifest.shards is not None:  # a subscriber that predates sharding
            error = wire.ErrorReply(req=request.req, code="bad_request",
                                    message=f"version {request.version} is served by its "
                                            "trainer ranks (manifest.shards), not here: this "
                                            "subscriber predates sharded publishing; upgrade it",
                                    version=request.version)
            peers.reply(peer, wire.encode(error))
            return
        if len(request.chunks) > self.limits.max_chunks_per_request or any(
            c >= version.manifest.num_chunks for c in request.chunks
        ):
            error = wire.ErrorReply(req=request.req, code="bad_request",
                                    message="chunk ids out of range or too many in one request",
                                    version=request.version)
            peers.reply(peer, wire.encode(error))
            return
        peers.fetch(peer, request.req, version, request.chunks, time.monotonic())


def _client(frame: zmq.Frame, client_key: str | None) -> str:
    """Who sent a request: its CURVE key, or its address without CURVE (rows are filed
    under it, so a stranger cannot overwrite another client's rows)."""
    return client_key or f"addr:{_property(frame, 'Peer-Address') or 'local'}"


def _property(frame: zmq.Frame, name: str | int) -> object:
    """A frame's metadata (``User-Id``, ``Peer-Address``, ``SRCFD``), or None if unset."""
    try:
        return frame.get(name)
    except zmq.ZMQError:
        return None
