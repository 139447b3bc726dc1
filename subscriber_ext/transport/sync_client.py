"""The subscriber's protocol state machine, driven by one thread that owns the sockets.

States (ZeroMQ Guide "Clone" client)::

    INITIAL --latest request--> SYNCING --latest reply--> ACTIVE
       ^                                                     |
       +------------- publisher silent for ttl --------------+  (re-sync; DEALER reconnects)

In ACTIVE it subscribes to manifests/heartbeats, pulls chunks of the newest
version with a bounded number in flight (credit), receives each chunk
straight into the staging buffer, verifies it, and re-requests what timed
out or failed its checksum. Versions are conflated: a newer manifest replaces
a target that is less than half received.

Which publisher instance to follow is decided by the ROUTER this client
dialled, never by clocks: a manifest or heartbeat from another instance only
makes the client ask that ROUTER for its latest version, and it switches when
the reply names the new instance (a restarted publisher). Manifests it ignores
are counted and named in ``last_error``. A CURVE refusal is read off a socket
monitor and reported as a ``TransportError`` naming the cause.

Before a version's buffer is allocated, the staging budget decides
(``budget_gate.py``): start, wait for held buffers to come back, or refuse
(``StagingBudgetError`` in ``last_error`` and the report).

With a collective member (``collective.py``) attached, a version the publisher
will broadcast to this node's group is not fetched here unless that round fails;
the member hands the assembled version back through ``deliver``.

With ``SyncOptions.peers`` (``peer_share=True``) a ``Peering`` (``peering.py``)
serves verified chunks to other subscribers and routes each chunk to a peer or
to the publisher; requests to peers live in the same table, marked with their
source, and a failing peer only moves its chunks to the next source.
``ChunkListener``s (``listener.py``) hear each version start, each chunk verify
and each version end.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from subscriber_ext.transport.budget_gate import BudgetGate
from subscriber_ext.transport.delta import DeltaAssembly, DeltaState
from subscriber_ext.transport.listener import ChunkListener, final_bytes
from subscriber_ext.transport.peering import Peering, PeerOptions
from subscriber_ext.transport.progress import ProgressFeed
from subscriber_ext.transport.staging import Assembly, StagedVersion
from weightpub_wire import protocol as wire
from weightpub_wire.buffers import BufferPool
from weightpub_wire.endpoints import resolve_pub_endpoint
from weightpub_wire.errors import (
    ChecksumError,
    ProtocolError,
    TransportError,
    VersionUnavailable,
    WeightPubError,
    WeightPubTimeout,
)
from weightpub_wire.monitor import describe_handshake_failure, open_monitor, read_events
from weightpub_wire.peer_protocol import PEER_REPLIES, PeerPlan
from weightpub_wire.ratelog import RateLimitedLog
from weightpub_wire.security import CurveIdentity
from weightpub_wire.sockets import configure_socket, connect

__all__ = ["SyncClient", "SyncOptions"]

log = logging.getLogger("weightpub.subscriber")


@dataclass(frozen=True, slots=True)
class SyncOptions:
    request_timeout: float = 5.0
    window_bytes: int = 64 << 20
    chunks_per_request: int = 4
    max_chunk_retries: int = 5
    switch_below_fraction: float = 0.5
    report_interval: float = 2.0
    limits: wire.Limits = field(default_factory=wire.Limits)
    collective: bool = False  # join the publisher's collective path if it announces one
    collective_device: str | None = None  # nccl / cuda_ipc: this node's GPU ("cuda:0")
    peers: PeerOptions | None = None  # peer sharing (``peer_share=True``), peering.py


@dataclass(slots=True)
class _Request:
    chunks: set[int]
    sent_at: float
    source: Any = None  # the peer asked (a ``sources.PeerLink``); None: the publisher


class SyncClient:
    """Plain-class protocol logic; ``WeightSubscriber`` runs it on a thread."""

    def __init__(self, ctx: zmq.Context, endpoint: str, subscriber_id: str, options: SyncOptions,
                 on_complete: Callable[[StagedVersion], None],
                 socket_hooks: list[Callable[..., None]] | None = None,
                 pool: BufferPool | None = None, curve: CurveIdentity | None = None,
                 listeners: list[ChunkListener] | None = None) -> None:
        self.endpoint = endpoint
        self.subscriber_id = subscriber_id
        self.options = options
        self.on_complete = on_complete
        self.pool = pool or BufferPool(max_buffers=2,
                                       max_pinned_bytes=options.limits.max_pinned_bytes)
        self.ranks: tuple[int, ...] = ()  # replica ranks served (reported to the publisher)
        self.state = "INITIAL"
        self.instance: str | None = None  # the publisher_id followed (confirmed by the ROUTER)
        self.current_version = 0
        self.applied_version = 0
        self.applied_path = ""  # data path of the applied version (for the report)
        self.staged_paths: OrderedDict[int, str] = OrderedDict()  # newest few versions
        self.collective: Any = None  # a ``CollectiveMember`` when the option is on
        self.error: WeightPubError | None = None  # the newest problem, as our exception
        self.bad_messages = 0
        self.checksum_failures = 0
        self.received_bytes = 0  # data-path bytes accepted into staging
        self.latest_seen = 0  # newest version the current publisher instance announced
        self.failures: dict[str, int] = {}  # problems by error class (a fixed, small set)
        self.ignored_manifests = 0
        self.handshake_failures = 0
        self.warn = RateLimitedLog(log)
        self.target: Assembly | None = None
        self.deltas = DeltaState()  # the base held for deltas, bytes by path
        self.gate = BudgetGate(self.pool, self.deltas)  # the staging budget
        self.queued: wire.Manifest | None = None
        self.progress: ProgressFeed | None = None  # tensors final before the version is
        self._ids = itertools.count(1)
        self._requests: dict[int, _Request] = {}
        self._retries: dict[int, int] = {}
        self._failed: dict[tuple[str, int], tuple[int, float]] = {}
        self._latest_req = 0
        self._latest_sent = 0.0
        self._last_heard = 0.0
        self._ttl = 3.0
        self._pub_endpoint = ""
        self._next_report = 0.0
        self._report_dirty = True
        self._hooks = socket_hooks or []
        self.dealer = ctx.socket(zmq.DEALER)
        self.sub = ctx.socket(zmq.SUB)
        for sock in (self.dealer, self.sub):
            configure_socket(sock, heartbeat_interval=1.0)
            for hook in self._hooks:
                hook(sock, server=False)
        self.dealer.setsockopt(zmq.IMMEDIATE, 1)
        self.dealer.setsockopt(zmq.RCVHWM, 0)
        # a refused or silent handshake is given up (and reported) after request_timeout
        self.dealer.setsockopt(zmq.HANDSHAKE_IVL, max(1000, int(options.request_timeout * 1000)))
        # no frame larger than a chunk (or a control message) is ever accepted off the wire
        self.dealer.setsockopt(zmq.MAXMSGSIZE, max(wire.MAX_CHUNK_SIZE,
                                                   options.limits.max_control_bytes))
        self.sub.setsockopt(zmq.MAXMSGSIZE, options.limits.max_control_bytes)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.monitor = open_monitor(self.dealer, zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                    | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        connect(self.dealer, endpoint)
        self.listeners: list[ChunkListener] = []
        self.peering: Peering | None = None
        if options.peers is not None:
            try:
                self.peering = Peering(self, options.peers, curve)
                self.deltas.keep_newest = True  # what peers ask for after it staged
            except BaseException:
                self.close()
                raise
            self.listeners.append(self.peering)
        self.listeners += listeners or []

    @property
    def last_error(self) -> str | None:
        """``"<ErrorClass>: <what>"`` of the newest problem, or None."""
        if self.error is None:
            return None
        return f"{type(self.error).__name__}: {self.error}"[: wire.MAX_ERROR_CHARS]

    def close(self) -> None:
        if self.peering is not None:
            self.peering.close()
        if self.target is not None:
            self.target.abandon()
            self.target = None
        self.deltas.drop_base()
        self.monitor.close(linger=0)
        self.dealer.close(linger=0)
        self.sub.close(linger=0)

    def on_monitor(self) -> None:
        """Handshake events of the DEALER: a refusal becomes ``last_error`` at once."""
        for event in read_events(self.monitor):
            if event.event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if isinstance(self.error, TransportError):
                    self.error = None  # the refusal is over (e.g. the key was allowed)
                    self._report_dirty = True
                continue
            why = describe_handshake_failure(event, client=True)
            if why is not None:
                self.handshake_failures += 1
                self.error = TransportError(why)
                self._report_dirty = True
                self.warn.warning("handshake", why)

    # -- time-driven work ----------------------------------------------------------------------
    def tick(self, now: float) -> float:
        """Do whatever is due; return seconds until something is due again."""
        if self.state != "ACTIVE" or now - self._last_heard > self._ttl:
            if self.state == "ACTIVE":
                log.warning("publisher silent for %.1fs; re-syncing", now - self._last_heard)
                self.state = "SYNCING"
            if now - self._latest_sent >= min(1.0, self.options.request_timeout):
                self._request_latest(now)
        self._expire_requests(now)
        wait = 0.1 if self.peering is None else min(0.1, self.peering.tick(now))
        self._top_up(now)
        if self.collective is not None:
            self.collective.tick(self, now)
        waiting = self.gate.take_waiting() if self.target is None else None
        if waiting is not None:
            self.consider(waiting)  # a released buffer may have made room
        if now >= self._next_report or self._report_dirty:
            self._send_report(now)
        self.warn.tick()
        return wait

    def _request_latest(self, now: float) -> None:
        self._latest_req = next(self._ids)
        if self._send(wire.LatestRequest(req=self._latest_req)):
            self._latest_sent = now
            if self.state == "INITIAL":
                self.state = "SYNCING"

    def _send(self, message: wire.Message) -> bool:
        return self.send(message)

    def send(self, message: Any) -> bool:
        """One control message to the publisher; False when not connected yet."""
        try:
            self.dealer.send(wire.encode(message), zmq.NOBLOCK)
            return True
        except zmq.Again:  # not connected yet (IMMEDIATE): retried on a later tick
            return False

    # -- requests, also for peering.py ---------------------------------------------------------
    def next_request_id(self) -> int:
        return next(self._ids)

    def track_request(self, req: int, chunks: tuple[int, ...], now: float, source: Any) -> None:
        self._requests[req] = _Request(set(chunks), now, source)

    def peer_in_flight(self) -> dict[Any, int]:
        counts: dict[Any, int] = {}
        for request in self._requests.values():
            if request.source is not None:
                counts[request.source] = counts.get(request.source, 0) + len(request.chunks)
        return counts

    def peer_requests(self, source: Any) -> set[int]:
        return {req for req, r in self._requests.items() if r.source is source}

    def drop_requests(self, source: Any) -> None:
        """Forget what ``source`` was asked: its chunks are asked of the next source."""
        for req in self.peer_requests(source):
            del self._requests[req]

    def _notify(self, event: str, manifest: wire.Manifest) -> None:
        for listener in self.listeners:
            try:
                getattr(listener, event)(manifest)
            except Exception:  # a listener's bug must not stop the transfer
                log.exception("chunk listener %s failed", event)

    def _send_report(self, now: float) -> None:
        report = wire.Report(subscriber_id=self.subscriber_id,
                             staged_version=self.current_version,
                             applied_version=self.applied_version, last_error=self.last_error,
                             publisher_id=self.instance,
                             ranks=self.ranks[: wire.MAX_REPORTED_RANKS],
                             data_path=self.applied_path)
        if self._send(report):
            self._report_dirty = False
            self._next_report = now + self.options.report_interval

    def set_ranks(self, ranks: tuple[int, ...]) -> None:
        self.ranks = tuple(sorted(ranks))
        self._report_dirty = True

    def mark_applied(self, version: int, error: WeightPubError | None = None) -> None:
        """``version`` 0 leaves the applied version as it is (e.g. to report an error)."""
        if version:
            self.applied_version = version
            self.applied_path = self.staged_paths.get(version, self.applied_path)
        if error is not None:
            self.error = error
        self._report_dirty = True

    def deliver(self, assembly: Assembly) -> None:
        """A version assembled and verified by another data path (a collective round):
        stage it exactly like a fetched one. An older fetch in progress gives way."""
        if assembly.manifest.version <= self.current_version:
            assembly.abandon()
            return
        if self.target is not None and self.target.manifest.version <= assembly.manifest.version:
            self._drop_target()
        self._complete(assembly)

    def yield_target(self, version: int) -> bool:
        """Give up an ongoing fetch older than ``version`` (a broadcast brings a newer one);
        False when the fetch in progress is of ``version`` or newer."""
        if self.target is None:
            return True
        if self.target.manifest.version >= version:
            return False
        self._drop_target()
        return True

    # -- fetching ------------------------------------------------------------------------------
    def _credit(self) -> int:
        if self.target is None:
            return 0
        chunks = self.options.window_bytes // self.target.manifest.chunk_size
        return max(1, min(chunks, wire.MAX_CHUNKS_IN_FLIGHT))

    def _in_flight(self) -> int:
        return sum(len(r.chunks) for r in self._requests.values() if r.source is None)

    def _top_up(self, now: float) -> None:
        target = self.target
        if target is None:
            return
        asked = set().union(*(r.chunks for r in self._requests.values())) if self._requests \
            else set()
        room = self._credit() - self._in_flight()
        if self.peering is not None:  # what peers serve is asked of them, the rest of us
            todo = [c for c in target.order if c in target.missing and c not in asked]
            todo = self.peering.route(target, todo, now) if todo else todo
        else:
            todo = target.next_chunks(asked, room) if room > 0 else []
        while todo and room > 0:
            batch = todo[: min(room, self.options.chunks_per_request)]
            todo = todo[len(batch):]
            req = next(self._ids)
            request = wire.FetchRequest(req=req, publisher_id=target.manifest.publisher_id,
                                        version=target.fetch_version, chunks=tuple(batch),
                                        base=target.fetch_base)
            if not self._send(request):
                return
            self._requests[req] = _Request(set(batch), now)
            room -= len(batch)

    def _expire_requests(self, now: float) -> None:
        for req, request in list(self._requests.items()):
            if request.source is not None or now - request.sent_at < self.options.request_timeout:
                continue  # peers' requests: peering.py gives up on a peer that stalls
            del self._requests[req]
            for chunk in request.chunks:
                if self._count_retry(chunk, "timed out", WeightPubTimeout):
                    return

    def _count_retry(self, chunk: int, why: str, error: type[WeightPubError]) -> bool:
        """Count one more try of a chunk; abandon the version when it has failed too often."""
        tries = self._retries.get(chunk, 0) + 1
        self._retries[chunk] = tries
        if tries <= self.options.max_chunk_retries or self.target is None:
            return False
        self._fail_target(error(f"chunk {chunk} of version {self.target.manifest.version} "
                                f"{why} {tries} times"))
        return True

    def _count_failure(self, error: WeightPubError) -> None:
        name = type(error).__name__
        self.failures[name] = self.failures.get(name, 0) + 1

    def _fail_target(self, why: WeightPubError) -> None:
        """Give a version up; it is retried only after a growing back-off (1 s .. 30 s)."""
        self._count_failure(why)
        self.warn.warning("abandon", f"abandoning version: {type(why).__name__}: {why}")
        if self.target is not None:
            key = (self.target.manifest.publisher_id, self.target.manifest.version)
            count = self._failed.get(key, (0, 0.0))[0] + 1
            self._failed[key] = (count, time.monotonic() + min(30.0, 2.0 ** (count - 1)))
        self.error = why
        self._report_dirty = True
        self._drop_target()
        self._latest_sent = 0.0  # re-ask for the newest version right away
        self.state = "SYNCING"

    def _drop_target(self) -> None:
        if self.target is not None:
            if self.progress is not None:
                self.progress.cancel(self.target)
            self._notify("target_dropped", self.target.manifest)
            self.target.abandon()
        self.target = None
        self._requests.clear()
        self._retries.clear()

    # -- choosing what to fetch ----------------------------------------------------------------
    def consider(self, manifest: wire.Manifest, *, confirmed: bool = False) -> None:
        """Decide whether a manifest becomes the target (conflation, publisher restarts).

        ``confirmed``: it came in a ``latest`` reply from the ROUTER this client dialled,
        which is the only thing that may make it follow another publisher instance.
        """
        if manifest.publisher_id != self.instance:
            if not confirmed:
                self._unknown_instance(manifest.publisher_id, f"manifest v{manifest.version}")
                return
            self._follow(manifest.publisher_id)
        self.latest_seen = max(self.latest_seen, manifest.version)
        if manifest.version <= max(self.current_version,
                                   self.gate.waiting.version if self.gate.waiting else 0):
            return
        if self.gate.is_refused(manifest):
            return  # does not fit the budget; it never will
        backoff = self._failed.get((manifest.publisher_id, manifest.version))
        if backoff is not None and time.monotonic() < backoff[1]:
            return  # failed recently; a newer version or the back-off expiring retries it
        if self.collective is not None and self.collective.defer(self, manifest):
            return  # this node's group will receive it (fetched here only if that fails)
        if self.target is not None:
            if manifest.version <= self.target.manifest.version:
                return
            if self.target.done_fraction >= self.options.switch_below_fraction:
                if self.queued is None or manifest.version > self.queued.version:
                    self.queued = manifest
                return
            log.info("conflating: version %d replaces %d (%.0f%% received)", manifest.version,
                     self.target.manifest.version, 100 * self.target.done_fraction)
            self._drop_target()
        self._start(manifest)

    def _start(self, manifest: wire.Manifest) -> None:
        if not self.gate.admit(manifest):
            if self.gate.is_refused(manifest):  # never fits: say so; the live weights stay
                self.error = self.gate.refused
                self._report_dirty = True
            return
        target = self.deltas.assembly_for(manifest, self.pool) or Assembly(manifest, self.pool)
        self.target = target
        self._requests.clear()
        self._retries.clear()
        if self.progress is not None:
            self.progress.begin(target)
        self._notify("target_started", manifest)
        if not target.missing:
            self._complete(target)
        else:
            self._top_up(time.monotonic())

    def _complete(self, target: Assembly) -> None:
        manifest = target.manifest
        self._failed.pop((manifest.publisher_id, manifest.version), None)
        try:
            staged = target.finish()
        except Exception as exc:  # never stay stuck behind a version that cannot be staged
            error = exc if isinstance(exc, WeightPubError) else WeightPubError(
                f"version {manifest.version} cannot be staged: {exc}")
            self._fail_target(error)
            return
        if self.target is target:
            self.target = None
            self._requests.clear()
            self._retries.clear()
            if self.progress is not None:
                self.progress.complete(target, staged)
        self.deltas.completed(target, staged)
        self.current_version = staged.version
        self.staged_paths[staged.version] = staged.data_path
        while len(self.staged_paths) > 16:
            self.staged_paths.popitem(last=False)
        self._notify("target_completed", manifest)
        refused = self.gate.staged()  # a newer version fits: the refusal is history
        if refused is not None and self.error is refused:
            self.error = None
        self._report_dirty = True
        self.on_complete(staged)
        queued, self.queued = self.queued, None
        if queued is not None:
            self.consider(queued)

    def _delta_failed(self, target: DeltaAssembly, why: WeightPubError) -> None:
        """A delta that is not served, does not decode or does not verify: fetch in full."""
        self._bad(type(why)(f"{why}; fetching version {target.manifest.version} in full"))
        self.deltas.refuse(target)
        self._drop_target()
        self._start(target.manifest)

    # -- incoming messages ---------------------------------------------------------------------
    def on_sub(self) -> None:
        frame = self.sub.recv(copy=False)
        try:
            message = wire.decode(frame.buffer, expect=(wire.Manifest, wire.Heartbeat),
                                  limits=self.options.limits)
        except ProtocolError as exc:
            self._bad(ProtocolError(f"bad PUB message: {exc}"))
            return
        if isinstance(message, wire.Heartbeat):
            self._on_heartbeat(message)
        elif isinstance(message, wire.Manifest):
            self.consider(message)

    def _follow(self, publisher_id: str) -> None:
        """Switch to the instance the ROUTER named (first contact, or a restart)."""
        if self.instance is not None:
            log.warning("publisher restarted (new instance %s); following it", publisher_id[:16])
            self._drop_target()
            self.queued = None
        self.instance = publisher_id
        self.current_version = 0
        self.latest_seen = 0
        if self.collective is not None:
            self.collective.follow(publisher_id)
        self.gate.take_waiting()  # a version of the old instance no longer waits
        self.applied_version = 0  # an applied version of the old instance means nothing here
        self._report_dirty = True

    def _unknown_instance(self, publisher_id: str, what: str) -> None:
        """Something from an instance the ROUTER has not confirmed: ignore it, ask the ROUTER."""
        self.ignored_manifests += what.startswith("manifest")
        self._report_dirty = True
        self.error = ProtocolError(
            f"ignored {what} of publisher instance {publisher_id[:32]} (following "
            f"{(self.instance or 'none')[:32]}); asking {self.endpoint} which one is current")
        self.warn.warning("instance", str(self.error))
        if time.monotonic() - self._latest_sent > 1.0:
            self._request_latest(time.monotonic())

    def _on_heartbeat(self, beat: wire.Heartbeat) -> None:
        if beat.publisher_id != self.instance:
            self._unknown_instance(beat.publisher_id, "heartbeat")
            return
        self._last_heard = time.monotonic()
        self._ttl = max(3.0, 3 * beat.interval)
        self.latest_seen = max(self.latest_seen, beat.latest_version)
        behind = beat.latest_version > max(
            self.current_version, self.target.manifest.version if self.target else 0,
            self.gate.held_back(self.instance))
        if behind and time.monotonic() - self._latest_sent > 0.5:
            self._request_latest(time.monotonic())  # we missed a manifest: repair

    def on_dealer(self) -> None:
        first = self.dealer.recv(copy=False)
        more = self.dealer.getsockopt(zmq.RCVMORE)
        try:
            message = wire.decode(first.buffer, limits=self.options.limits,
                                  expect=(wire.ChunkHeader, wire.LatestReply, wire.ErrorReply,
                                          wire.CollectiveReply, *PEER_REPLIES))
        except ProtocolError as exc:
            self._discard_rest(more)
            self._bad(ProtocolError(f"bad reply: {exc}"))
            return
        self._last_heard = time.monotonic()
        if isinstance(message, wire.ChunkHeader):
            self._on_chunk(message, more)
            return
        self._discard_rest(more)
        if isinstance(message, (PeerPlan, wire.ErrorReply)) and self.peering is not None \
                and self.peering.owns(message):
            self.peering.on_reply(message)
        elif isinstance(message, wire.LatestReply):
            self._on_latest(message)
        elif isinstance(message, wire.ErrorReply):
            self._on_error(message)
        elif isinstance(message, wire.CollectiveReply) and self.collective is not None:
            self.collective.on_reply(self, message)

    def _discard_rest(self, more: int, sock: zmq.Socket | None = None) -> None:
        sock = self.dealer if sock is None else sock
        while more:
            sock.recv(copy=False)
            more = int(sock.getsockopt(zmq.RCVMORE))

    discard_rest = _discard_rest

    def _bad(self, why: WeightPubError) -> None:
        self._count_failure(why)
        self.bad_messages += 1
        self.error = why
        self._report_dirty = True
        self.warn.warning(type(why).__name__, str(why))

    def _on_latest(self, reply: wire.LatestReply) -> None:
        if reply.req != self._latest_req:
            return  # an answer to an older question: the newest one decides
        try:
            pub = resolve_pub_endpoint(self.endpoint, reply.pub_endpoint)
        except ProtocolError as exc:
            self._bad(exc)
            return
        if pub != self._pub_endpoint:
            if self._pub_endpoint:
                self.sub.disconnect(self._pub_endpoint)
            self.sub.connect(pub)
            self._pub_endpoint = pub
        self._ttl = max(3.0, 3 * reply.heartbeat_interval)
        self._last_heard = time.monotonic()
        self.state = "ACTIVE"
        if reply.publisher_id != self.instance:
            self._follow(reply.publisher_id)
        if self.collective is not None:
            self.collective.announce(reply.collective)
        if reply.manifest is not None:
            if reply.manifest.publisher_id != reply.publisher_id:
                self._bad(ProtocolError("latest_rep.manifest.publisher_id: differs from the "
                                        "replying instance"))
                return
            self.consider(reply.manifest, confirmed=True)

    def _on_error(self, error: wire.ErrorReply) -> None:
        if error.req not in self._requests:
            return  # a reply to a request we already gave up on
        del self._requests[error.req]
        if isinstance(self.target, DeltaAssembly) and error.version == self.target.fetch_version:
            self._delta_failed(self.target, ProtocolError(f"delta: {error.message}"))
        elif self.target is not None and error.version == self.target.manifest.version:
            kind = VersionUnavailable if error.code == "version_unavailable" else ProtocolError
            self._fail_target(kind(f"publisher: {error.message}"))

    def _on_chunk(self, header: wire.ChunkHeader, more: int,
                  sock: zmq.Socket | None = None) -> None:
        sock = self.dealer if sock is None else sock
        target = self.target
        request = self._requests.get(header.req)
        source = None if request is None else request.source
        if not (
            more and target is not None and request is not None
            and sock is (self.dealer if source is None else source.sock)
            and header.version == target.fetch_version and header.chunk in request.chunks
            and target.accepts(header.chunk, header.size)
        ):
            self._discard_rest(more, sock)
            return  # stale (conflated / timed out) or not ours
        if header.chunk not in target.missing:  # already here from another source
            self._discard_rest(more, sock)
            self._chunk_done(header, request)
            return
        size = sock.recv_into(target.chunk_target(header.chunk))
        self.received_bytes += size
        extra = int(sock.getsockopt(zmq.RCVMORE))
        self._chunk_done(header, request)
        if size != header.size or extra:
            self._discard_rest(extra, sock)
            why = f"chunk {header.chunk}: {size} bytes received, header said {header.size}"
            if source is not None and self.peering is not None:
                self.peering.chunk_failed(source, "truncated", why, time.monotonic())
                return
            self._bad(ProtocolError(why))
            self._count_retry(header.chunk, "arrived truncated", ProtocolError)
            return
        self.deltas.count(target, size)
        final = final_bytes(target)
        if not target.verify(header.chunk, size):
            self.checksum_failures += 1
            if isinstance(target, DeltaAssembly):
                self._delta_failed(target, target.error or ChecksumError("delta chunk refused"))
                return
            why = f"chunk {header.chunk} of version {header.version}: checksum mismatch"
            if source is not None and self.peering is not None:
                self.peering.chunk_failed(source, "checksum", why, time.monotonic())
                return
            self._bad(ChecksumError(f"{why}, refetching"))
            self._count_retry(header.chunk, "failed its checksum", ChecksumError)
            return
        if self.progress is not None:
            self.progress.verified(target, header.chunk)
        if source is not None and self.peering is not None:
            self.peering.arrived(source, size, time.monotonic())
        if final and self.listeners:
            start, span = target.manifest.chunk_span(header.chunk)
            data = target.view[start: start + span]
            for listener in self.listeners:
                try:
                    listener.chunk_verified(target.manifest, header.chunk, data)
                except Exception:
                    log.exception("chunk listener failed")
        if not target.missing:
            self._complete(target)
        else:
            self._top_up(time.monotonic())

    on_chunk = _on_chunk

    def _chunk_done(self, header: wire.ChunkHeader, request: _Request) -> None:
        request.chunks.discard(header.chunk)
        if not request.chunks:
            del self._requests[header.req]
