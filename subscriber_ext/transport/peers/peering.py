"""Peer sharing for one subscriber: its peer server, its sources, and the tracker's plan.

A ``SyncClient`` started with ``peer_share=True`` owns one ``Peering``:

- it binds a ROUTER of its own (``peer_server.py``) in a ZeroMQ context of its
  own, so the upload's I/O thread can be measured and bounded
  (``upload_budget.py``), and serves the chunks it has verified;
- it says hello to the publisher's tracker about once a second and whenever a
  new version starts, and follows the plan it gets back (``sources.py``): each
  stripe from its chain of peers, then from the publisher;
- it is the client's first ``ChunkListener``: a chunk that verifies wakes the
  requests that wait for it (cut-through);
- it is a first ``ChunkSource`` (``staging/chunk_source.py``): each serving
  source's next chunks (the publisher's, or a trainer rank's) are offered to it
  first (``ask``), and it takes those its plan has a usable peer for.

Peers are found through the publisher only (the one endpoint a replica is
given). With CURVE the peer ROUTER is a CURVE server with this subscriber's own
key pair (the one the publisher authenticated it with), and admits only the
keys the tracker lists (ZAP, and again per request). Binding a non-loopback
address without CURVE needs ``insecure=True``, as for a publisher.
``PeerOptions`` and the ``PeerClient`` view live in ``peer_options.py``.

With ``stream=True`` it also serves on a plain TCP stream port of its own
(``peer_stream_server.py``; tokens over the ROUTER, ``_stream_token``) and asks each
planned peer's chunks on that peer's port first (``stream_reads``, the client's
``PeerStreams`` seen as ``PeerStreamHost``), then as frames (``docs/peer-stream.md``).
A sliced member's port answers ``slices`` requests for its own plan
(``_stream_slice_lookup``), and it asks its peers' planned chunks there as ``slices``.

A sliced subscriber (``slice_plan``, issue 30) shares slices: its hello names its
plan's digest (the tracker plans it only with members of the same plan), it asks its
peers with ``slice_fetch`` once the version's ``slice_sums`` are in (the slice source
asks them of the publisher first), and its server answers ``slice_fetch`` for its own
plan from its sparse staging (``_slice_lookup``: each slice gathered once, then served
from ``slice_cache.py``, whose bytes count in the staging budget); a whole-chunk
``fetch`` it cannot serve (it holds only planned bytes). A slice from a peer is
verified against the publisher's sums like one from the publisher; one that fails bans
the peer. ``other_plan_chunks`` counts the chunks fetched from the publisher while this
member was alone on its plan and the tracker held members on other plans. A sharded
trainer's sliced version is shared the same way (the coordinator's tracker; chunk ids
and sums are the union's). Not yet: slices of a delta come from the trainer side only
(raw slices from peers instead would not pay: ``docs/benchmarks.md``, peers sharing
slices).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import zmq
from zmq.auth.thread import ThreadAuthenticator

from subscriber_ext.transport.peers.chunk_sources import PeerLink, Sources, VersionKey
from subscriber_ext.transport.peers.peer_nixl import NixlHost, PeerNixlReads
from subscriber_ext.transport.peers.peer_options import PeerClient, PeerOptions, default_peer_bind
from subscriber_ext.transport.peers.peer_server import GONE, WAIT, PeerServer, Served
from subscriber_ext.transport.peers.peer_stream import PeerStreamHost
from subscriber_ext.transport.peers.peer_stream_server import PeerStreamServer
from subscriber_ext.transport.peers.slice_cache import SliceCache
from subscriber_ext.transport.peers.upload_budget import ThreadCpu, UploadBudget
from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.chunk_listener import final_bytes
from subscriber_ext.transport.staging.chunk_source import ChunkSource, Retry
from subscriber_ext.transport.staging.delta_assembly import DeltaAssembly
from subscriber_ext.transport.staging.sparse_assembly import SparseAssembly
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.bounded_counts import count_bounded
from weightpub_wire.endpoints import parse_endpoint
from weightpub_wire.errors import ConfigError, ProtocolError
from weightpub_wire.nixl_link import NixlOffer
from weightpub_wire.peer_protocol import PEER_NIXL_REPLIES, PeerHello, PeerNixlOffer, PeerPlan
from weightpub_wire.reply_reader import read_replies
from weightpub_wire.security import CurveIdentity, SocketHook, is_local
from weightpub_wire.slice_layout import SliceLayout
from weightpub_wire.slice_messages import SliceFetch
from weightpub_wire.sockets import bind, configure_socket
from weightpub_wire.stream_link import Block, StreamToken

__all__ = ["PeerClient", "PeerOptions", "Peering", "default_peer_bind"]  # options: re-exported

log = logging.getLogger("weightpub.peers")
_THREAD_PREFIXES = itertools.count(7100)  # names this Peering's ZeroMQ I/O thread
#: how long chunks for a peer wait for its ``peer_nixl`` answer (at least): a member
#: starts its NIXL agent at the first manifest offering NIXL, on its loop (0.45 s here:
#: UCX's backend), and answers only after that
NIXL_WAIT_S = 2.0


class Peering(ChunkSource):
    """One subscriber's peer sharing; every method runs on the subscriber's thread."""

    first: ClassVar[bool] = True
    kind: ClassVar[str] = "peers"

    def __init__(self, client: PeerClient, options: PeerOptions,
                 curve: CurveIdentity | None, nixl: NixlHost | None = None,
                 stream: PeerStreamHost | None = None) -> None:
        """``nixl``: the client's NIXL reader, for peers over NIXL (``peer_nixl.py``;
        only where ``nixl.peers_on``); ``stream``: its peer stream reader (peers over the
        stream, ``docs/peer-stream.md``; a whole-version member with ``stream=True``
        also serves its chunks on a stream port of its own)."""
        self.client = client
        self.nixl = nixl if nixl is not None and nixl.peers_on else None
        #: versions asked of this member over NIXL and not offered, by cause
        self.nixl_unoffered: dict[str, int] = {}
        self.options = options
        self.curve = curve
        targets = getattr(client, "targets", None)
        #: the slice plan it fetches and serves ("" for whole versions), and where its
        #: layout in a version comes from (``SliceFetcher.layout``)
        self.digest: str = (targets.delta_plan or "") if targets is not None else ""
        self._layouts: Callable[[wire.Manifest], SliceLayout] | None = \
            getattr(targets, "layout", None) if self.digest else None
        address = options.bind or default_peer_bind(client.endpoint)
        if curve is None and not options.insecure and not is_local(parse_endpoint(address)):
            raise ConfigError(
                f"peer_bind {address}: serving peers on a non-loopback address without CURVE "
                "would hand the weights to anyone who can reach it; give "
                "curve_server_key_file (peers then use CURVE too), bind 127.0.0.1, or say "
                "insecure=True (YAML: `insecure: true`) if the network is trusted")
        prefix = next(_THREAD_PREFIXES)
        self.ctx = zmq.Context(io_threads=1)
        self.ctx.set(zmq.THREAD_NAME_PREFIX, prefix)
        self.auth: ThreadAuthenticator | None = None
        router = self.ctx.socket(zmq.ROUTER)
        try:
            self.endpoint = self._open_router(router, address)
        except BaseException:
            router.close(linger=0)
            self._close_context()
            raise
        self._admit: frozenset[str] = frozenset()
        #: a sliced member's gathered slices (counted in the staging budget, shed first)
        self.slice_cache: SliceCache | None = None
        if self.digest:
            self.slice_cache = SliceCache(options.slice_cache_bytes, client.pool)
            client.pool.on_shed(self.slice_cache.shed)
        self.budget = UploadBudget(options.upload_bytes_per_s, options.upload_cpu_share,
                                   ThreadCpu(name_prefix=f"{prefix}/ZMQbg/IO"))
        streaming = bool(getattr(client.options, "stream", False))
        #: this member's stream port (``peer_stream_server.py``), None where it is off
        self.stream_port: PeerStreamServer | None = None
        if streaming:
            try:
                self.stream_port = PeerStreamServer(
                    parse_endpoint(self.endpoint).host, self._lookup, self.budget,
                    options.server, sends=client.pool,
                    admitted=self._admitted if curve is not None else None,
                    slice_lookup=self._stream_slice_lookup if self.digest else None,
                    scratch=client.pool)
            except OSError as exc:
                log.warning("peer stream: off (could not listen: %s)", exc)
        self.stream_reads = stream if streaming else None
        self.server = PeerServer(router, self._lookup, self.budget, options.server,
                                 self._admitted if curve is not None else None,
                                 sends=client.pool,
                                 slice_lookup=self._slice_lookup if self.digest else None,
                                 nixl_lookup=self._nixl_lookup if self.nixl else None,
                                 stream_token=self._stream_token
                                 if self.stream_port is not None else None)
        self.nixl_reads: PeerNixlReads | None = None if self.nixl is None else \
            PeerNixlReads(self.nixl, client.requests.next_id, max(options.plan_wait, NIXL_WAIT_S))
        self.sources = Sources(
            client.dealer.context, self._hooks_for, window=options.window_chunks,
            timeout=client.options.request_timeout,
            max_message_bytes=max(chunk_frame.frame_bytes(wire.MAX_CHUNK_SIZE),
                                  client.options.limits.max_control_bytes),
            on_open=self._watch, on_close=self._unwatch, digest=self.digest)
        self.plan: PeerPlan | None = None
        self.disabled: str | None = None  # why the publisher will not give a plan
        self.poller: zmq.Poller | None = None
        self._hello_reqs: set[int] = set()
        self._applied_req = 0
        self._awaiting: tuple[VersionKey, float] | None = None  # (version, since) of a hello
        self._next_hello = 0.0
        self.bytes_from_peers = 0
        self.chunks_from_peers = 0
        self.other_plan_chunks = 0  # from the publisher, alone on its plan (module text)
        log.info("serving peers on %s", self.endpoint)

    def _open_router(self, router: zmq.Socket, address: str) -> str:
        limits = self.options.server
        configure_socket(router, heartbeat_interval=1.0, pings=False)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, 2 * limits.max_queued_chunks + 64)
        router.setsockopt(zmq.RCVHWM, 256)
        router.setsockopt(zmq.MAXMSGSIZE, limits.max_request_bytes)
        router.setsockopt(zmq.HANDSHAKE_IVL, 10_000)
        if self.curve is not None:
            self.auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("weightpub.zap"))
            self.auth.start()
            self.auth.configure_curve_callback(domain="*", credentials_provider=self)
            self.curve.peer_server_hook()(router, server=True)
        return bind(router, address)

    # -- CURVE admission -----------------------------------------------------------------------
    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP credentials provider (pyzmq): may this key connect to the peer ROUTER?"""
        return self._admitted(key.decode(errors="replace"))

    def _admitted(self, key: str) -> bool:
        return key in self._admit

    def _stream_token(self, key: str | None, publisher_id: str) -> tuple[bytes, int] | str:
        """A one-time token for this member's stream port (an admitted key's: checked by
        the peer ROUTER), for the chunks of ``publisher_id``; or why not."""
        port = self.stream_port
        if port is None:
            return "the peer stream is off here"
        if publisher_id != self.client.instance:
            return "not_held: this member follows another publisher instance"
        token = port.issue_token(key, publisher_id)
        if token is None:
            return "too many stream tokens outstanding; try again later"
        return token, port.port

    def _hooks_for(self, key: str) -> list[SocketHook]:
        if self.curve is None or not key:
            return []
        return [self.curve.peer_client_hook(key.encode())]

    # -- the loop ------------------------------------------------------------------------------
    def register(self, poller: zmq.Poller) -> None:
        self.poller = poller
        poller.register(self.server.router, zmq.POLLIN)
        if self.stream_port is not None:
            poller.register(self.stream_port.wake_fd, zmq.POLLIN)
        if self.stream_reads is not None:
            self.stream_reads.register(poller)
        for link in self.sources.links.values():
            self._watch(link)

    def _watch(self, link: PeerLink) -> None:
        if self.poller is not None:
            self.poller.register(link.sock, zmq.POLLIN)
            self.poller.register(link.monitor, zmq.POLLIN)

    def _unwatch(self, link: PeerLink) -> None:
        self.client.requests.drop(link)
        if self.poller is not None:
            self.poller.unregister(link.sock)
            self.poller.unregister(link.monitor)

    @property
    def label(self) -> str:
        return "peers"

    def tick(self, now: float) -> float:
        """Hello when due, dial refused peers again, serve; seconds until due again."""
        if now >= self._next_hello:
            self._hello(now)
        self.sources.redial(now)
        wake = self.server.pump(now)
        if self.stream_port is not None:
            wake = min(wake, self.stream_port.pump(now))
        if self.stream_reads is not None:
            wake = min(wake, self.stream_reads.tick(now))
        if self.nixl_reads is not None:
            wake = min(wake, self.nixl_reads.tick(now))
        return wake

    def expire(self, now: float, retry: Retry) -> bool:
        """Give up on silent peers: their chunks go to the next source, no try counted."""
        key = self._key()
        in_flight = self.client.requests.peer_in_flight()
        for link in self.sources.expired(in_flight, now):
            self._fail(link, key, "timeout",
                       f"no progress for {self.sources.stall_timeout:.2f}s", now)
        if self.nixl_reads is not None:
            self.nixl_reads.expire(now, retry)
        if self.stream_reads is not None:
            self.stream_reads.expire(now, retry)
        return False

    def _hello(self, now: float) -> None:
        client = self.client
        if client.state != "ACTIVE" or client.instance is None or self.disabled is not None:
            return
        target = client.target
        req = client.requests.next_id()
        hello = PeerHello(req=req, publisher_id=client.instance, endpoint=self.endpoint,
                          version=target.manifest.version if target is not None
                          else client.current_version, plan=self.digest)
        if client.send(hello):
            self._hello_reqs = {r for r in self._hello_reqs if r > req - 16} | {req}
            self._next_hello = now + self.options.hello_interval

    def on_events(self, events: dict[Any, int], now: float) -> None:
        if self.server.router in events:
            self.server.on_readable(now)
        if self.stream_port is not None and self.stream_port.wake_fd in events:
            self.stream_port.drain_wake()
        for link in list(self.sources.links.values()):
            if link.monitor in events and self.sources.watch(link, now) and \
                    self.client.requests.peer_in_flight().get(link):
                self._fail(link, self._key(), "disconnected", "disconnected", now)
            if link.sock in events:
                self._read(link, now)
        if self.stream_reads is not None:
            self.stream_reads.on_events(events, now)
        self.server.pump(now)
        if self.stream_port is not None:
            self.stream_port.pump(now)

    def _read(self, link: PeerLink, now: float) -> None:
        def bad(exc: ProtocolError) -> None:
            self._fail(link, self._key(), "bad_reply", f"sent a bad reply ({exc})", now,
                       ban=True)

        streams = self.stream_reads

        def error(reply: wire.ErrorReply) -> None:
            if streams is not None and streams.owns(link.endpoint, reply):
                streams.on_reply(link.endpoint, reply)  # no token: frames from this peer
            elif reply.req in self.client.requests.peer_requests(link):
                self._fail(link, self._key(), reply.code, reply.message[:200], now)

        def other(reply: Any) -> None:
            reads, target = self.nixl_reads, self.client.target
            if isinstance(reply, StreamToken):
                if streams is not None and streams.owns(link.endpoint, reply):
                    streams.on_reply(link.endpoint, reply)
            elif isinstance(reply, PeerNixlOffer) and reads is not None:
                reads.answered(link.endpoint, reply,
                               None if target is None else target.manifest, now)

        read_replies(link.sock, self.client.options.limits, most=64, pairing=link.pairing,
                     discard_rest=self.client.discard_rest,
                     on_chunk=lambda header, frame: self.client.on_chunk(header, frame,
                                                                         self, link),
                     on_error=error, on_bad=bad,
                     others=(*(PEER_NIXL_REPLIES if self.nixl_reads is not None else ()),
                             *((StreamToken,) if streams is not None else ())),
                     on_other=other)

    def _key(self) -> VersionKey | None:
        target = self.client.target
        return None if target is None else (target.manifest.publisher_id,
                                            target.manifest.version)

    def _fail(self, link: PeerLink, key: VersionKey | None, kind: str, why: str, now: float,
              *, ban: bool = False) -> None:
        self.sources.fail(link, key, kind, why, now, ban=ban)
        self.client.requests.drop(link)

    # -- ChunkSource: asked first ---------------------------------------------------------------
    def ahead(self) -> int:
        """Chunks beyond a serving source's credit worth offering: every peer's window."""
        return self.sources.window * max(1, len(self.sources.links))

    def ask(self, target: Assembly, chunks: Sequence[int], now: float) -> list[int]:
        """Ask peers for what they serve in the plan; return the chunks for the serving
        source (the publisher, or a trainer rank)."""
        todo = list(chunks)
        plan = self.plan
        if self.disabled is not None or isinstance(target, DeltaAssembly) or target.fetch_base:
            return todo  # deltas come from the publisher only
        sliced = isinstance(target, SparseAssembly)
        if sliced != bool(self.digest) or (isinstance(target, SparseAssembly) and (
                target.plan != self.digest or target.sums is None
                or target.whole_cause is not None)):
            # slices from peers need the version's sums (and come as slices only): one
            # falling back to whole chunks comes from the trainer side
            return todo
        key = (target.manifest.publisher_id, target.manifest.version)
        if plan is None or plan.publisher_id != key[0] or not plan.stripes:
            # no place in the plan we hold; one for this version may be on its way
            awaiting = self._awaiting
            if awaiting is not None and awaiting[0] == key and \
                    now - awaiting[1] < self.options.plan_wait:
                return []
            return todo
        counts = self.client.requests.peer_in_flight()
        in_flight = dict(counts)
        streams = self.stream_reads
        if streams is not None:  # a peer's window counts what its stream was asked too
            for link in self.sources.links.values():
                asked = streams.in_flight(link.endpoint, counts)
                if asked:
                    in_flight[link] = in_flight.get(link, 0) + asked
        to_peers, to_publisher = self.sources.route(todo, key, in_flight, now)
        if plan.other_plans and plan.group <= 1:  # alone on its plan: peers hold other bytes
            self.other_plan_chunks += len(to_publisher)
        per_request = self.client.options.chunks_per_request
        for link, routed in to_peers.items():
            if self.nixl_reads is not None and not sliced:  # READ where the peer offers
                frames = self.nixl_reads.route(link.sock, link.endpoint, target, routed, now)
                if frames is None:
                    continue  # its answer is due: asked again at the next top-up
                routed = frames
            if streams is not None and routed:  # the peer's stream port, then its frames
                routed = streams.route(link.endpoint, functools.partial(_send_via, link),
                                       self.client.sink, target, routed, now)
                if not routed:
                    continue
            chunks = routed
            for start in range(0, len(chunks), per_request):
                batch = tuple(chunks[start: start + per_request])
                req = self.client.requests.next_id()
                request: wire.FetchRequest | SliceFetch = \
                    SliceFetch(req=req, publisher_id=key[0], version=key[1],
                               digest=self.digest, chunks=batch) if sliced else \
                    wire.FetchRequest(req=req, publisher_id=key[0], version=key[1],
                                      chunks=batch)
                try:
                    link.sock.send(wire.encode(request), zmq.NOBLOCK)
                except zmq.Again:  # not connected (yet): the timeout decides
                    self.sources.blocked(link, now)
                    break
                self.sources.sent(link, bool(in_flight.get(link)), now)
                in_flight[link] = in_flight.get(link, 0) + len(batch)
                self.client.requests.track(req, batch, now, link)
        return to_publisher

    def owns(self, message: wire.ErrorReply | PeerPlan) -> bool:
        """Whether a reply on the publisher's DEALER answers one of this peering's hellos."""
        return message.req in self._hello_reqs

    def on_reply(self, message: wire.ErrorReply | PeerPlan) -> None:
        if isinstance(message, wire.ErrorReply):
            if self.disabled is None:
                self.disabled = message.message
                log.warning("peer sharing off: %s; fetching from the publisher only",
                            message.message)
            return
        if message.publisher_id != self.client.instance or message.req < self._applied_req:
            return
        self._applied_req = message.req
        if self._awaiting is not None and message.version >= self._awaiting[0][1]:
            self._awaiting = None
        if self.plan is None or message.epoch != self.plan.epoch \
                or message.admit != self.plan.admit:
            self._admit = frozenset(message.admit)
            self.sources.apply(message, self.curve is not None)
            if self.stream_reads is not None:
                self.stream_reads.keep(set(self.sources.links))
                for link in self.sources.links.values():  # each planned peer's token now
                    self.stream_reads.warm(link.endpoint, functools.partial(_send_via, link),
                                           self.client.sink, message.publisher_id,
                                           time.monotonic())
            log.info("peer plan %d: slot %d of %d stripes, %d sources", message.epoch,
                     message.slot, message.stripes, len(self.sources.links))
        self.plan = message

    def arrived(self, via: Any, size: int, now: float) -> None:
        if isinstance(via, PeerLink):
            self.sources.arrived(via, now)
            self.bytes_from_peers += size
            self.chunks_from_peers += 1

    def refused(self, via: Any, chunk: int, why: str, now: float) -> bool:
        """A chunk from ``via`` failed its checksum: never that peer again for a while;
        its chunks go to the next source (no try counted)."""
        if not isinstance(via, PeerLink):
            return False
        self._fail(via, self._key(), "checksum", why, now, ban=True)
        return True

    # -- ChunkListener: something became servable ---------------------------------------------
    def target_started(self, manifest: wire.Manifest) -> None:
        """Plans follow versions: say hello now; without a place in the plan held, the
        fetch waits up to ``plan_wait`` for the answer (a member that joined last version)."""
        now = time.monotonic()
        target = self.client.target
        if self.nixl is not None and target is not None and target.manifest is manifest \
                and not self.digest:  # (a sliced member's staging is not offered)
            self.nixl.claim(target.buffer, manifest.version)  # before its first byte lands
        self.sources.chunk_size(manifest.chunk_size)
        self._awaiting = ((manifest.publisher_id, manifest.version), now)
        self._hello(now)
        self._prune()
        self._changed()

    def chunk_verified(self, manifest: wire.Manifest, chunk: int, data: memoryview) -> None:
        self._changed()

    def target_completed(self, manifest: wire.Manifest) -> None:
        self._prune()
        self._changed()
        if self.nixl_reads is not None:
            self.nixl_reads.forget_all()

    def target_dropped(self, manifest: wire.Manifest) -> None:
        self._prune(manifest)
        self._changed()
        if self.nixl_reads is not None:  # before the buffer goes back to the pool
            self.nixl_reads.forget_all()

    def _changed(self) -> None:
        self.server.changed()
        if self.stream_port is not None:
            self.stream_port.changed()

    def _prune(self, dropped: wire.Manifest | None = None) -> None:
        """Gathered slices are kept for the versions ``_slice_lookup`` serves only."""
        cache = self.slice_cache
        if cache is None:
            return
        held = []
        target, base = self.client.target, self.client.deltas.base
        if target is not None and target.manifest is not dropped:
            held.append((target.manifest.publisher_id, target.manifest.version))
        if base is not None:
            held.append((base.manifest.publisher_id, base.version))
        cache.keep(held)

    def _lookup(self, publisher_id: str, version: int, chunk: int) -> Served | str:
        client = self.client
        if publisher_id != client.instance or self.digest:
            return GONE  # (a sliced member holds only its plan's bytes of a chunk)
        target = client.target
        if target is not None and target.manifest.version == version:
            if chunk >= target.manifest.num_chunks:
                return GONE
            if not target.has_verified(chunk) or not final_bytes(target):
                return WAIT
            start, size = target.manifest.chunk_span(chunk)
            return Served(target.view[start: start + size], target.buffer)
        base = client.deltas.base
        if base is not None and base.version == version \
                and base.manifest.publisher_id == publisher_id:
            if chunk >= base.manifest.num_chunks:
                return GONE
            start, size = base.manifest.chunk_span(chunk)
            return Served(base.view[start: start + size], base.buffer)
        if any(m is not None and m.version == version for m in (client.queued,
                                                                client.gate.waiting)):
            return WAIT
        return WAIT if version > client.latest_seen else GONE

    def _nixl_lookup(self, publisher_id: str, version: int) -> tuple[NixlOffer | None, str]:
        """This member's offer of ``version`` (peers over NIXL): the version being received
        (with a readiness map) or the staged base; None and why (counted, but ``later``:
        not started here yet, the asker asks again)."""
        offer, why = self._nixl_offer(publisher_id, version)
        if offer is None and why != "later":
            cause = why.split(" ")[0][:32]
            count_bounded(self.nixl_unoffered, cause, 16)
        return offer, why

    def _nixl_offer(self, publisher_id: str, version: int) -> tuple[NixlOffer | None, str]:
        client, nixl = self.client, self.nixl
        if nixl is None:
            return None, "off"
        if self.digest:
            return None, "sliced (a slice member's staging is not offered yet)"
        if publisher_id != client.instance:
            return None, "not_held (another publisher instance)"
        target = client.target
        if target is not None and target.manifest.version == version:
            if isinstance(target, DeltaAssembly | SparseAssembly) or target.fetch_base:
                return None, "delta (bytes not final until rebuilt)"
            return nixl.peer_offer(target.buffer, target.manifest, target.has_verified)
        base = client.deltas.base
        if base is not None and base.version == version \
                and base.manifest.publisher_id == publisher_id and not base.plan:
            return nixl.peer_offer(base.buffer, base.manifest, None)
        if version > client.latest_seen or any(
                m is not None and m.version == version for m in (client.queued,
                                                                client.gate.waiting)):
            return None, "later"
        return None, "not_held"

    def _slice_lookup(self, publisher_id: str, version: int, chunk: int,
                      digest: str) -> Served | str:
        """Plan ``digest``'s verified bytes of ``chunk``, gathered back to back (a copy of
        only those bytes) from the version being received or the staged base."""
        client = self.client
        if publisher_id != client.instance or digest != self.digest:
            return GONE
        target = client.target
        if isinstance(target, SparseAssembly) and target.manifest.version == version \
                and target.plan == digest:
            if chunk not in target.layout.sizes:
                return GONE
            if not target.has_verified(chunk) or not final_bytes(target):
                return WAIT
            return self._gathered((publisher_id, version, digest, chunk), target.layout,
                                  target.view)
        base = client.deltas.base
        if base is not None and base.version == version and base.plan == digest \
                and base.manifest.publisher_id == publisher_id and self._layouts is not None:
            key = (publisher_id, version, digest, chunk)
            kept = None if self.slice_cache is None else self.slice_cache.get(key)
            if kept is not None:
                return Served(kept, None)
            try:
                layout = self._layouts(base.manifest)
            except ProtocolError:
                return GONE
            if chunk not in layout.sizes:
                return GONE
            return self._gathered(key, layout, base.view, looked=True)
        if any(m is not None and m.version == version for m in (client.queued,
                                                                client.gate.waiting)):
            return WAIT
        return WAIT if version > client.latest_seen else GONE

    def _stream_slice_lookup(self, publisher_id: str, version: int, chunk: int,
                             blocks: list[Block]) -> Served | str:
        """A ``slices`` request's chunk on this member's stream port: its span of the
        sparse staging (the version being received, or the staged base) once verified, if
        ``blocks`` (starts from the chunk's first byte) are exactly this plan's there;
        GONE for anything else (another plan's blocks, a chunk outside the plan)."""
        client = self.client
        if publisher_id != client.instance:
            return GONE
        target = client.target
        found: tuple[wire.Manifest, SliceLayout, memoryview, Any] | None = None
        if isinstance(target, SparseAssembly) and target.manifest.version == version \
                and target.plan == self.digest:
            if chunk in target.layout.sizes and _plan_blocks(target.manifest, target.layout,
                                                             chunk) == blocks \
                    and (not target.has_verified(chunk) or not final_bytes(target)):
                return WAIT
            found = (target.manifest, target.layout, target.view, target.buffer)
        base = client.deltas.base
        if found is None and base is not None and base.version == version \
                and base.plan == self.digest and base.manifest.publisher_id == publisher_id \
                and self._layouts is not None:
            try:
                found = (base.manifest, self._layouts(base.manifest), base.view, base.buffer)
            except ProtocolError:
                return GONE
        if found is None:
            if any(m is not None and m.version == version for m in (client.queued,
                                                                    client.gate.waiting)):
                return WAIT
            return WAIT if version > client.latest_seen else GONE
        manifest, layout, view, buffer = found
        if chunk not in layout.sizes or _plan_blocks(manifest, layout, chunk) != blocks:
            return GONE  # not this member's plan there: the asker goes elsewhere at once
        start, size = manifest.chunk_span(chunk)
        return Served(view[start: start + size], buffer)

    def _gathered(self, key: tuple[str, int, str, int], layout: SliceLayout,
                  view: memoryview, *, looked: bool = False) -> Served:
        """The key's chunk's planned bytes out of a flat staging view, back to back: kept
        ones, else a gather (a copy), kept for the next ask. ``looked``: the cache was
        asked already (a miss)."""
        cache = self.slice_cache
        if cache is not None and not looked:
            kept = cache.get(key)
            if kept is not None:
                return Served(kept, None)
        out = layout.gather(key[3], np.frombuffer(view, dtype=np.uint8))
        if cache is None:
            return Served(memoryview(out.data).cast("B"), None)
        plan = self.plan  # more than one other member of the plan may ask for it
        return Served(cache.put(key, out, keep=plan is not None and plan.group > 2), None)

    # -- reporting and closing -----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        plan = self.plan
        streamed = {} if self.stream_reads is None else self.stream_reads.stats()
        return {
            "endpoint": self.endpoint,
            "slot": None if plan is None else plan.slot,
            "plan_epoch": None if plan is None else plan.epoch,
            "group": None if plan is None else plan.group,  # members planned with it, it too
            # over frames and over peers' stream ports (``stream_*_from_peers`` of them)
            "bytes_from_peers": self.bytes_from_peers + streamed.get("stream_bytes_from_peers", 0),
            "chunks_from_peers": self.chunks_from_peers
            + streamed.get("stream_chunks_from_peers", 0),
            "plan": self.digest or None,
            "other_plans": None if plan is None else plan.other_plans,
            "other_plan_chunks": self.other_plan_chunks,
            "disabled": self.disabled,
            **self.sources.stats(),
            **self.server.stats(),
            **({} if self.nixl_reads is None else self.nixl_reads.stats()),
            **streamed,
            # what this member sent over its own stream port (None: it has none)
            "stream_served": None if self.stream_port is None else self.stream_port.stats(),
            "nixl_unoffered": dict(self.nixl_unoffered),
            **self.budget.stats(),
            **(SliceCache(0).stats() if self.slice_cache is None
               else self.slice_cache.stats()),
        }

    def close(self) -> None:
        if self.slice_cache is not None:
            self.client.pool.off_shed(self.slice_cache.shed)
            self.slice_cache.clear()
        if self.nixl_reads is not None:
            self.nixl_reads.forget_all()
        self.sources.close()
        if self.stream_reads is not None:
            self.stream_reads.close()
        if self.stream_port is not None:  # its connections end their buffers' counts
            self.stream_port.close()
        self.server.router.close(linger=0)
        self._close_context()
        self.server.close()  # ZeroMQ has let go of everything: the buffers drain

    def _close_context(self) -> None:
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


def _plan_blocks(manifest: wire.Manifest, layout: SliceLayout, chunk: int) -> list[Block]:
    """The plan's blocks of ``chunk``, their starts counted from the chunk's first byte
    (as a ``slices`` request names them)."""
    low = manifest.chunk_span(chunk)[0]
    return [(start - low, length, stride, rows)
            for start, length, stride, rows in layout.blocks[chunk]]


def _send_via(link: PeerLink, message: Any) -> bool:
    """``message`` on a peer's DEALER now (its current one: a redial replaces it)."""
    return _send_now(link.sock, message)


def _send_now(sock: zmq.Socket, message: Any) -> bool:
    """``message`` on a peer's DEALER if it can go now (False: not connected yet)."""
    try:
        sock.send(wire.encode(message), zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True
