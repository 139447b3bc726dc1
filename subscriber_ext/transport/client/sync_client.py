"""The subscriber's protocol state machine, driven by one thread that owns the sockets.

In ACTIVE (``instance_following.py`` draws the states) it subscribes to
manifests/heartbeats, pulls chunks of the newest version with a bounded number
in flight (credit), receives each chunk straight into the staging buffer,
verifies it, and re-requests what timed out or failed its checksum. Versions
are conflated: a newer manifest replaces a target that is less than half
received.

``SyncClient`` holds the target's life (start, complete, fail, drop), the
dispatch of incoming frames, and composes its parts, each owning its own state:
``ClientSockets`` (``client_sockets.py``: socket options; a CURVE refusal becomes
``last_error`` at once; a DEALER that stopped answering is dialled anew),
``InstanceFollower`` (``instance_following.py``: which publisher instance to
follow: the ROUTER this client dialled decides, never clocks), ``VersionChoice``
(``version_choice.py``: which manifest becomes the target), ``FetchCredit``
(``fetch_credit.py`` over ``request_table.py``: credit, requests in flight,
timeouts, tries), ``ChunkReceiver`` (``chunk_replies.py``: one chunk frame),
``ClientReport`` (``client_report.py``: ``last_error`` and the back-channel
report), and ``BudgetGate`` (``budget_gate.py``: before a version's buffer is
allocated: start, wait for held buffers, or refuse with ``StagingBudgetError``).

With a collective member (``collective_member.py``) attached, a version the
publisher will broadcast to this node's group is not fetched here unless that
round fails; the member hands the assembled version back through ``deliver``.
Chunks are asked of ``ChunkSource``s only (``staging/chunk_source.py``), picked
once per version (``source_choice.py``): ``pickers``, the trainer ranks of a sharded
manifest (``shard_links.py``), then the publisher (``publisher_source.py``); with
``peer_share=True`` a ``Peering`` (``peering.py``) is asked first and serves
verified chunks to other subscribers. ``ChunkListener``s (``chunk_listener.py``)
hear each version start, chunk verify and end (the peer server, a relay, ...).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from subscriber_ext.transport.client.chunk_replies import ChunkReceiver, discard_rest, within
from subscriber_ext.transport.client.client_report import ClientReport, VersionBytes
from subscriber_ext.transport.client.client_sockets import ClientSockets
from subscriber_ext.transport.client.early_sums import EarlySums
from subscriber_ext.transport.client.fetch_credit import FetchCredit
from subscriber_ext.transport.client.instance_following import InstanceFollower
from subscriber_ext.transport.client.peer_stream_source import PeerStreams
from subscriber_ext.transport.client.publisher_source import PublisherSource
from subscriber_ext.transport.client.shard_links import ShardLinks
from subscriber_ext.transport.client.source_choice import SourceChoice
from subscriber_ext.transport.client.sync_options import SyncOptions
from subscriber_ext.transport.client.version_choice import VersionChoice
from subscriber_ext.transport.peers.peer_nixl import NixlHost
from subscriber_ext.transport.peers.peering import Peering
from subscriber_ext.transport.staging.assembly import Assembly, StagedVersion, TargetMaker
from subscriber_ext.transport.staging.budget_gate import BudgetGate
from subscriber_ext.transport.staging.chunk_listener import ChunkListener
from subscriber_ext.transport.staging.chunk_source import ChunkSource, SourcePicker, SourceSink
from subscriber_ext.transport.staging.delta_assembly import DeltaState
from subscriber_ext.transport.staging.request_table import RequestTable, VersionBackoff
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.buffers import BufferPool
from weightpub_wire.errors import (
    ProtocolError,
    StagingBudgetError,
    VersionUnavailable,
    WeightPubError,
)
from weightpub_wire.peer_protocol import PEER_REPLIES, PeerPlan
from weightpub_wire.security import CurveIdentity

__all__ = ["SyncClient", "SyncOptions"]

log = logging.getLogger("weightpub.subscriber")


class SyncClient:
    """Plain-class protocol logic; ``WeightSubscriber`` runs it on a thread."""

    def __init__(self, ctx: zmq.Context, endpoint: str, subscriber_id: str, options: SyncOptions,
                 on_complete: Callable[[StagedVersion], None],
                 socket_hooks: list[Callable[..., None]] | None = None,
                 pool: BufferPool | None = None, curve: CurveIdentity | None = None,
                 listeners: list[ChunkListener] | None = None,
                 pickers: Sequence[SourcePicker] = (),
                 targets: TargetMaker | None = None,
                 repliers: Sequence[Any] = (), peer_nixl: NixlHost | None = None) -> None:
        """``peer_nixl``: the NIXL reader peers READ through (peers over NIXL);
        ``pickers``: chunk sources of other kinds, asked first (chunk_source.py);
        ``targets``: makes each target instead of a whole ``Assembly`` and sizes it for
        the budget (a slice plan's ``SparseAssembly``); its staged versions are delta bases
        only if it rebuilds from them (``TargetMaker.delta_plan``); ``repliers``: parts
        that ask the publisher over this client's DEALER (``SourceSink.send``) and take
        their replies: ``reply_types`` (decoded too), ``owns(message)``,
        ``on_reply(message)`` (a stream source's token)."""
        self.endpoint = endpoint
        self.subscriber_id = subscriber_id
        self.options = options
        self.on_complete = on_complete
        self.pool = pool or BufferPool(max_buffers=2,
                                       max_pinned_bytes=options.limits.max_pinned_bytes)
        self.collective: Any = None  # a ``CollectiveMember`` when the option is on
        self.target: Assembly | None = None  # the version being fetched
        self.targets = targets
        self.deltas = DeltaState()  # the base held for deltas, bytes by path
        self.deltas.no_bases = targets is not None and targets.delta_plan is None
        self.gate = BudgetGate(self.pool, self.deltas,  # the staging budget
                               size=None if targets is None else targets.staged_bytes)
        self.requests = RequestTable()  # in flight (also peers', for peering.py); tries
        self.backoff = VersionBackoff()  # versions given up recently
        self.listeners: list[ChunkListener] = []
        self.repliers = list(repliers)
        self._reply_types = tuple(t for r in self.repliers for t in r.reply_types)
        self.report = ClientReport(subscriber_id, options.report_interval)
        self.sockets = ClientSockets(ctx, endpoint, options.request_timeout, options.limits,
                                     socket_hooks or [], self.report)
        self.follower = InstanceFollower(self.sockets, self.report, self.requests.next_id,
                                         self._switched)
        self.choice = VersionChoice(self, self.follower, self.gate, self.backoff,
                                    switch_below_fraction=options.switch_below_fraction,
                                    defer=self._defer)
        self.peering: Peering | None = None
        if options.peers is not None:
            try:
                # peers over the stream (stream=True): a peer's chunks on its stream port
                streams = PeerStreams(request_timeout=options.request_timeout,
                                      window_bytes=options.window_bytes, pool=self.pool) \
                    if options.stream else None
                self.peering = Peering(self, options.peers, curve, peer_nixl, streams)
                self.deltas.keep_newest = True  # what peers ask for after it staged
            except BaseException:
                self.close()
                raise
            self.listeners.append(self.peering)
        self.listeners += listeners or []
        # where chunks come from: picked once per version (source_choice.py)
        self.sink = SourceSink(self.requests, chunk=lambda h, f, s, v: self.on_chunk(h, f, s, v),
                               error=lambda reply: self._on_error(reply),
                               bad=lambda exc: self.report.bad(exc),
                               discard_rest=self.discard_rest,
                               give_up=lambda why: self._fail_target(why),
                               in_place=self._in_place, send=self.send)
        self.publisher_source = PublisherSource(
            self.requests, self.send, chunks_per_request=options.chunks_per_request,
            request_timeout=options.request_timeout)
        self.shards = ShardLinks(ctx, limits=options.limits, hooks=socket_hooks or [],
                                 chunks_per_request=options.chunks_per_request,
                                 request_timeout=options.request_timeout,
                                 on_handshake=self.sockets.link_handshake)
        self.sources = SourceChoice([*pickers, self.shards], self.publisher_source, self.sink,
                                    firsts=[self.peering] if self.peering is not None else [])
        self.credit = FetchCredit(self.requests, self.sources, target=lambda: self.target,
                                  give_up=self._fail_target, window_bytes=options.window_bytes,
                                  max_chunk_retries=options.max_chunk_retries)
        self.receiver = ChunkReceiver(self.credit, self.report, self.deltas, self.listeners,
                                      target=lambda: self.target,
                                      complete=self.complete_target,
                                      delta_failed=self._delta_failed)
        # a manifest announced before its checksums: they follow over the DEALER
        self.early_sums = EarlySums(self.send, self.requests.next_id,
                                    target=lambda: self.target,
                                    arrived=self.receiver.sums_arrived,
                                    give_up=lambda why: self._fail_target(why),
                                    bad=lambda exc: self.report.bad(exc),
                                    request_timeout=options.request_timeout,
                                    max_tries=max(1, options.max_chunk_retries))
        self.repliers.append(self.early_sums)
        self._reply_types = (*self._reply_types, *self.early_sums.reply_types)

    # -- the parts' state, as peering.py and collective_member.py see it ----------------------
    @property
    def dealer(self) -> zmq.Socket:
        return self.sockets.dealer

    @property
    def sub(self) -> zmq.Socket:
        return self.sockets.sub

    @property
    def monitor(self) -> zmq.Socket:
        return self.sockets.monitor

    @property
    def state(self) -> str:
        return self.follower.state

    @property
    def instance(self) -> str | None:
        return self.follower.instance

    @property
    def latest_seen(self) -> int:
        return self.follower.latest_seen

    @property
    def current_version(self) -> int:
        return self.choice.current_version

    @property
    def queued(self) -> wire.Manifest | None:
        return self.choice.queued

    def close(self) -> None:
        if self.peering is not None:
            self.peering.close()
        if getattr(self, "sources", None) is not None:
            self.sources.close()
        if self.target is not None:
            self.target.abandon()
            self.target = None
        self.deltas.drop_base()
        self.sockets.close()

    def register(self, poller: zmq.Poller) -> None:  # the sources' own sockets
        self.sources.register(poller)

    def on_events(self, events: dict[Any, int], now: float) -> None:  # replies, handshakes
        self.sources.on_events(events, now)

    def on_monitor(self) -> None:
        """Handshake events of the DEALER: a refusal becomes ``last_error`` at once; after
        a new connection, what the old one had asked of the publisher is asked again now
        (its answers went to an identity the ROUTER has dropped), not after
        ``request_timeout``."""
        if self.sockets.on_handshake_events():
            self.requests.drop(None)
            self.credit.top_up(time.monotonic())

    # -- time-driven work ----------------------------------------------------------------------
    def tick(self, now: float) -> float:
        """Do whatever is due; return seconds until something is due again."""
        self.follower.tick(now, self.options.request_timeout)
        self.sockets.watch_replies(now, asking=self.requests.in_flight() > 0
                                   or self.follower.state != "ACTIVE")
        self.credit.expire(now)
        self.early_sums.tick(now)
        wait = min([0.1, *(source.tick(now) for source in self.sources.live())])
        self.credit.top_up(now)
        if self.collective is not None:
            self.collective.tick(self, now)
        waiting = self.gate.take_waiting() if self.target is None else None
        if waiting is not None:
            self.consider(waiting)  # a released buffer may have made room
        if self.report.due(now):
            peers = None if self.peering is None else self.peering.stats()
            if self.send(self.report.message(self.current_version, self.instance, peers)):
                self.report.sent(now)
        self.report.warn.tick()
        return wait

    def send(self, message: Any) -> bool:
        """One control message to the publisher; False when not connected yet."""
        return self.sockets.send(message)

    def _notify(self, event: str, manifest: wire.Manifest) -> None:
        for listener in self.listeners:
            hook = getattr(listener, event, None)  # target_refused is optional
            if hook is None:
                continue
            try:
                hook(manifest)
            except Exception:  # a listener's bug must not stop the transfer
                log.exception("chunk listener %s failed", event)

    def set_ranks(self, ranks: tuple[int, ...]) -> None:
        self.report.set_ranks(ranks)

    def mark_applied(self, version: int, error: WeightPubError | None = None) -> None:
        """``version`` 0 leaves the applied version as it is (e.g. to report an error)."""
        self.report.mark_applied(version, error)

    # -- choosing what to fetch (version_choice.py) --------------------------------------------
    def consider(self, manifest: wire.Manifest, *, confirmed: bool = False) -> None:
        """Decide whether a manifest becomes the target (conflation, publisher restarts);
        ``confirmed``: from a ``latest`` reply, the only way to follow another instance."""
        self.choice.consider(manifest, confirmed=confirmed)

    def deliver(self, assembly: Assembly) -> None:
        """A version assembled by another data path (a collective round): stage it."""
        self.choice.deliver(assembly)

    def sums_from(self, manifest: wire.Manifest) -> None:
        """The complete manifest of the target whose sums follow (announced again once
        hashed, on PUB or in a ``latest`` reply): every sum at once, if it is the same
        version in every other field."""
        target = self.target
        if target is None or target.sums_in or \
                target.manifest.with_sums(manifest.checksums) != manifest:
            return
        self.receiver.sums_arrived(target, tuple(range(manifest.num_chunks)),
                                   manifest.checksums)

    def yield_target(self, version: int) -> bool:
        """Give up a fetch older than ``version``; False when it is that one or newer."""
        return self.choice.yield_target(version)

    def _defer(self, manifest: wire.Manifest) -> bool:
        return self.collective is not None and bool(self.collective.defer(self, manifest))

    def _switched(self, publisher_id: str, restarted: bool) -> None:
        """The follower moved to another publisher instance: the old one's versions,
        its waiting version and its collective group mean nothing here."""
        self.choice.switched(restarted)
        if self.collective is not None:
            self.collective.follow(publisher_id)
        self.gate.take_waiting()  # a version of the old instance no longer waits
        self.report.new_instance(publisher_id)

    # -- the target's life ---------------------------------------------------------------------
    def start_target(self, manifest: wire.Manifest) -> None:
        if manifest.sums_follow and self.targets is not None:
            return  # a sliced target waits for the complete manifest (announced once hashed)
        if not self.gate.admit(manifest):
            refused = self.gate.refused
            if refused is not None and self.gate.is_refused(manifest):
                self.report.problem(refused)  # never fits: say so; the live weights stay
            return
        try:
            if self.targets is not None:
                target = self.targets.assembly(
                    manifest, self.pool, self.deltas.start_for(manifest, self.targets.delta_plan))
            else:
                target = self.deltas.assembly_for(manifest, self.pool) or \
                    Assembly(manifest, self.pool)
        except (ProtocolError, StagingBudgetError) as exc:  # e.g. a slice plan of another
            # model: say so, stage nothing; tried again after the back-off
            self.report.problem(type(exc)(f"version {manifest.version}: {exc}"))
            self.backoff.record(manifest.publisher_id, manifest.version, time.monotonic())
            self._notify("target_refused", manifest)  # a listener may replan (slice_receiver)
            return
        self.target = target
        self.requests.clear()
        self._notify("target_started", manifest)
        if target.done and target.sums_in:
            self.complete_target(target)
        else:
            self.early_sums.tick(time.monotonic())  # sums that follow: asked at once
            self.credit.top_up(time.monotonic())

    def complete_target(self, target: Assembly) -> None:
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
        manifest = target.manifest  # an early one is complete now (``Assembly.finish``)
        self.deltas.completed(target, staged)
        self.choice.staged(staged.version)
        self.report.staged(staged.version, staged.data_path,
                           VersionBytes(staged.version, manifest.total_bytes,
                                        dict(target.received_by)))
        self._notify("target_completed", manifest)
        refused = self.gate.staged()  # a newer version fits: the refusal is history
        if refused is not None:
            self.report.resolved(refused)
        self.on_complete(staged)
        queued = self.choice.take_queued()
        if queued is not None:
            self.consider(queued)

    def drop_target(self) -> None:
        if self.target is not None:
            self._notify("target_dropped", self.target.manifest)
            self.target.abandon()
        self.target = None
        self.requests.clear()

    def _fail_target(self, why: WeightPubError) -> None:
        """Give a version up; it is retried only after a growing back-off (1 s .. 30 s)."""
        self.report.warn.warning("abandon", f"abandoning version: {type(why).__name__}: {why}")
        if self.target is not None:
            self.backoff.record(self.target.manifest.publisher_id, self.target.manifest.version,
                                time.monotonic())
        self.report.abandon(None if self.target is None else self.target.manifest.version, why)
        self.drop_target()
        self.follower.resync()  # re-ask for the newest version right away

    def _delta_failed(self, target: Assembly, why: WeightPubError) -> None:
        """A delta that is not served, does not decode or does not verify: fetch in full
        (a sliced target: as raw slices)."""
        how = "as raw slices" if target.plan is not None else "in full"
        self.report.bad(type(why)(f"{why}; fetching version {target.manifest.version} {how}"))
        self.deltas.refuse(target)
        self.drop_target()
        self.start_target(target.manifest)

    # -- incoming messages ---------------------------------------------------------------------
    def on_sub(self) -> None:
        frame = self.sockets.sub.recv(copy=False)
        try:
            message = wire.decode(frame.buffer, expect=(wire.Manifest, wire.Heartbeat),
                                  limits=self.options.limits)
        except ProtocolError as exc:
            self.report.bad(within("bad PUB message", exc))
            return
        if isinstance(message, wire.Heartbeat):
            target = self.target
            have = max(self.current_version, target.manifest.version if target else 0,
                       self.gate.held_back(self.instance))
            self.follower.on_heartbeat(message, have)
        elif isinstance(message, wire.Manifest):
            self.consider(message)

    def on_dealer(self) -> None:
        try:  # a chunk (one frame: header and payload) or a control reply
            message = self.sockets.read_reply(self.options.limits, expect=(
                wire.LatestReply, wire.ErrorReply, wire.CollectiveReply, *PEER_REPLIES,
                *self._reply_types))
        except ProtocolError as exc:
            self.report.bad(within("bad reply", exc))
            return
        self.follower.heard(time.monotonic())
        if message is None:  # a chunk header: its payload is the next message
            return
        if isinstance(message, tuple):
            self.on_chunk(*message)
            return
        for replier in self.repliers:
            if replier.owns(message):
                replier.on_reply(message)
                return
        if isinstance(message, (PeerPlan, wire.ErrorReply)) and self.peering is not None \
                and self.peering.owns(message):
            self.peering.on_reply(message)
        elif isinstance(message, wire.LatestReply):
            self._on_latest(message)
        elif isinstance(message, wire.ErrorReply):
            self._on_error(message)
        elif isinstance(message, wire.CollectiveReply) and self.collective is not None:
            self.collective.on_reply(self, message)

    def _in_place(self, req: int, version: int, chunk: int, source: ChunkSource, via: Any,
                  digest: int | None = None) -> bool | None:
        return self.receiver.in_place(req, version, chunk, source, via, digest)

    def discard_rest(self, more: int, sock: zmq.Socket | None = None) -> None:
        discard_rest(self.sockets.dealer if sock is None else sock, more)

    def _on_latest(self, reply: wire.LatestReply) -> None:
        if not self.follower.on_latest(reply):
            return
        if self.collective is not None:
            self.collective.announce(reply.collective)
        if reply.manifest is not None:
            if reply.manifest.publisher_id != reply.publisher_id:
                self.report.bad(ProtocolError("latest_rep.manifest.publisher_id: differs from "
                                              "the replying instance"))
                return
            self.consider(reply.manifest, confirmed=True)

    def _on_error(self, error: wire.ErrorReply) -> None:
        if error.req not in self.requests:
            return  # a reply to a request we already gave up on
        self.requests.forget(error.req)
        if self.target is not None and self.target.fetch_base and \
                error.version == self.target.fetch_version:
            self._delta_failed(self.target, ProtocolError(f"delta: {error.message}"))
        elif self.target is not None and error.version == self.target.manifest.version:
            kind = VersionUnavailable if error.code == "version_unavailable" else ProtocolError
            self._fail_target(kind(f"publisher: {error.message}"))

    def on_chunk(self, header: chunk_frame.ChunkHeader, frame: zmq.Frame,
                 source: ChunkSource | None = None, via: Any = None) -> None:
        """A chunk frame ``source`` (None: the publisher) delivered through ``via``
        (chunk_replies.py); tests wrap this attribute to pace or drop."""
        self.receiver.receive(header, frame, source or self.publisher_source, via)
