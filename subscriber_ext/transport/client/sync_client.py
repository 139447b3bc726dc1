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

This module holds the target's life (start, complete, fail, drop) and the
dispatch of incoming frames. Its parts: ``instance_following.py`` (which
publisher instance to follow: the ROUTER this client dialled decides, never
clocks), ``version_choice.py`` (which manifest becomes the target),
``fetch_credit.py`` and ``request_table.py`` (credit, requests in flight,
timeouts, back-off), ``chunk_replies.py``
(one chunk frame), ``client_sockets.py`` (socket options; a CURVE refusal becomes
``last_error`` at once), ``budget_gate.py`` (before a version's buffer is
allocated: start, wait for held buffers, or refuse with ``StagingBudgetError``).

With a collective member (``collective.py``) attached, a version the publisher
will broadcast to this node's group is not fetched here unless that round fails;
the member hands the assembled version back through ``deliver``. With
``SyncOptions.peers`` (``peer_share=True``) a ``Peering`` (``peering.py``) serves
verified chunks to other subscribers and routes each chunk to a peer or to the
publisher; a failing peer only moves its chunks to the next source.
``ChunkListener``s (``listener.py``) hear each version start, chunk verify and end:
the one observer mechanism (the peer server, a ``ProgressFeed``, a relay).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from subscriber_ext.transport.client import client_sockets as sockets
from subscriber_ext.transport.client import instance_following
from subscriber_ext.transport.client.chunk_replies import (
    discard_rest,
    parse_chunk,
    receive_chunk,
    within,
)
from subscriber_ext.transport.client.fetch_credit import expire_requests, top_up
from subscriber_ext.transport.client.reply_watch import ReplyWatch
from subscriber_ext.transport.client.version_choice import consider, deliver, yield_target
from subscriber_ext.transport.peers.peering import Peering, PeerOptions
from subscriber_ext.transport.staging.assembly import Assembly, StagedVersion
from subscriber_ext.transport.staging.budget_gate import BudgetGate
from subscriber_ext.transport.staging.chunk_listener import ChunkListener
from subscriber_ext.transport.staging.delta_assembly import DeltaAssembly, DeltaState
from subscriber_ext.transport.staging.request_table import RequestTable, VersionBackoff
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.buffers import BufferPool
from weightpub_wire.errors import ProtocolError, VersionUnavailable, WeightPubError
from weightpub_wire.peer_protocol import PEER_REPLIES, PeerPlan
from weightpub_wire.ratelog import RateLimitedLog
from weightpub_wire.security import CurveIdentity

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
        self.requests = RequestTable()  # in flight (also peers', for peering.py); tries
        self.backoff = VersionBackoff()  # versions given up recently
        self.replies = ReplyWatch()  # a DEALER that stopped answering (reply_watch.py)
        self._latest_req = 0
        self._latest_sent = 0.0
        self._last_heard = 0.0
        self._ttl = 3.0
        self._pub_endpoint = ""
        self._next_report = 0.0
        self._report_dirty = True
        self._hooks = socket_hooks or []
        self.dealer, self.sub, self.monitor = sockets.open_client_sockets(
            ctx, endpoint, options.request_timeout, options.limits, self._hooks)
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
        sockets.on_handshake_events(self)

    # -- time-driven work ----------------------------------------------------------------------
    def tick(self, now: float) -> float:
        """Do whatever is due; return seconds until something is due again."""
        if self.state != "ACTIVE" or now - self._last_heard > self._ttl:
            if self.state == "ACTIVE":
                log.warning("publisher silent for %.1fs; re-syncing", now - self._last_heard)
                self.state = "SYNCING"
                sockets.redial_sub(self)  # a SUB connection ended by a protocol error
            if now - self._latest_sent >= min(1.0, self.options.request_timeout):
                instance_following.request_latest(self, now)
        sockets.watch_replies(self, now)
        expire_requests(self, now)
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

    def send(self, message: Any) -> bool:
        """One control message to the publisher; False when not connected yet."""
        try:
            self.dealer.send(wire.encode(message), zmq.NOBLOCK)
            self.replies.sent(time.monotonic(), queued=True)
            return True
        except zmq.Again:  # no pipe (ended by a protocol error) or full: retried later
            self.replies.sent(time.monotonic(), queued=False)
            return False

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
        if self.send(report):
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
        """A version assembled by another data path (a collective round): stage it."""
        deliver(self, assembly)

    def yield_target(self, version: int) -> bool:
        """Give up a fetch older than ``version``; False when it is that one or newer."""
        return yield_target(self, version)

    # -- fetching (request_table.py asks and times out) ----------------------------------------
    def _top_up(self, now: float) -> None:
        top_up(self, now)

    def _count_retry(self, chunk: int, why: str, error: type[WeightPubError]) -> bool:
        """Count one more try of a chunk; abandon the version when it has failed too often."""
        tries = self.requests.count_try(chunk)
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
            self.backoff.record(self.target.manifest.publisher_id, self.target.manifest.version)
        self.error = why
        self._report_dirty = True
        self._drop_target()
        self._latest_sent = 0.0  # re-ask for the newest version right away
        self.state = "SYNCING"

    def _drop_target(self) -> None:
        if self.target is not None:
            self._notify("target_dropped", self.target.manifest)
            self.target.abandon()
        self.target = None
        self.requests.clear()

    # -- choosing what to fetch (version_choice.py) --------------------------------------------
    def consider(self, manifest: wire.Manifest, *, confirmed: bool = False) -> None:
        """Decide whether a manifest becomes the target (conflation, publisher restarts);
        ``confirmed``: from a ``latest`` reply, the only way to follow another instance."""
        consider(self, manifest, confirmed=confirmed)

    def _start(self, manifest: wire.Manifest) -> None:
        if not self.gate.admit(manifest):
            if self.gate.is_refused(manifest):  # never fits: say so; the live weights stay
                self.error = self.gate.refused
                self._report_dirty = True
            return
        target = self.deltas.assembly_for(manifest, self.pool) or Assembly(manifest, self.pool)
        self.target = target
        self.requests.clear()
        self._notify("target_started", manifest)
        if not target.missing:
            self._complete(target)
        else:
            self._top_up(time.monotonic())

    def _complete(self, target: Assembly) -> None:
        manifest = target.manifest
        self.backoff.forget(manifest.publisher_id, manifest.version)
        try:
            staged = target.finish()
        except Exception as exc:  # never stay stuck behind a version that cannot be staged
            error = exc if isinstance(exc, WeightPubError) else WeightPubError(
                f"version {manifest.version} cannot be staged: {exc}")
            self._fail_target(error)
            return
        if self.target is target:
            self.target = None
            self.requests.clear()
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
            self._bad(within("bad PUB message", exc))
            return
        if isinstance(message, wire.Heartbeat):
            instance_following.on_heartbeat(self, message)
        elif isinstance(message, wire.Manifest):
            self.consider(message)

    def on_dealer(self) -> None:
        first = self.dealer.recv(copy=False)
        more = int(self.dealer.getsockopt(zmq.RCVMORE))
        self.replies.heard(time.monotonic())
        try:
            if chunk_frame.is_chunk(first.buffer):  # one frame: header and payload
                header = parse_chunk(first, more)
                self._last_heard = time.monotonic()
                self._on_chunk(header, first)
                return
            message = wire.decode(first.buffer, limits=self.options.limits,
                                  expect=(wire.LatestReply, wire.ErrorReply,
                                          wire.CollectiveReply, *PEER_REPLIES))
        except ProtocolError as exc:
            self._discard_rest(more)
            self._bad(within("bad reply", exc))
            return
        self._last_heard = time.monotonic()
        self._discard_rest(more)
        if isinstance(message, (PeerPlan, wire.ErrorReply)) and self.peering is not None \
                and self.peering.owns(message):
            self.peering.on_reply(message)
        elif isinstance(message, wire.LatestReply):
            instance_following.on_latest(self, message)
        elif isinstance(message, wire.ErrorReply):
            self._on_error(message)
        elif isinstance(message, wire.CollectiveReply) and self.collective is not None:
            self.collective.on_reply(self, message)

    def _discard_rest(self, more: int, sock: zmq.Socket | None = None) -> None:
        discard_rest(self.dealer if sock is None else sock, more)

    discard_rest = _discard_rest

    def _bad(self, why: WeightPubError) -> None:
        self._count_failure(why)
        self.bad_messages += 1
        self.error = why
        self._report_dirty = True
        self.warn.warning(type(why).__name__, str(why))

    def _on_error(self, error: wire.ErrorReply) -> None:
        if error.req not in self.requests:
            return  # a reply to a request we already gave up on
        self.requests.forget(error.req)
        if isinstance(self.target, DeltaAssembly) and error.version == self.target.fetch_version:
            self._delta_failed(self.target, ProtocolError(f"delta: {error.message}"))
        elif self.target is not None and error.version == self.target.manifest.version:
            kind = VersionUnavailable if error.code == "version_unavailable" else ProtocolError
            self._fail_target(kind(f"publisher: {error.message}"))

    def _on_chunk(self, header: chunk_frame.ChunkHeader, frame: zmq.Frame,
                  sock: zmq.Socket | None = None) -> None:
        """A chunk frame (chunk_replies.py); tests wrap this attribute to pace or drop."""
        receive_chunk(self, header, frame, self.dealer if sock is None else sock)

    on_chunk = _on_chunk
