"""``WeightSubscriber``: the inference-side API, usable without vLLM.

It runs the protocol state machine (``SyncClient``) on one background thread
and hands out complete, verified versions: blocking (``wait_for_version``),
as an iterator (``versions``), or pushed to a callback (``on_version``, which
runs on the subscriber thread and must return quickly).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Unpack

import zmq

from subscriber_ext.transport.client.nixl_source import NixlPicker
from subscriber_ext.transport.client.shard_slices import ShardSlices
from subscriber_ext.transport.client.slice_source import SliceFetcher
from subscriber_ext.transport.client.stream_source import StreamPicker
from subscriber_ext.transport.client.sync_client import SyncClient, SyncOptions
from subscriber_ext.transport.collective.collective_member import CollectiveMember
from subscriber_ext.transport.staging.assembly import StagedVersion
from subscriber_ext.transport.staging.chunk_listener import ChunkListener
from subscriber_ext.transport.staging.memory_budget import derive_staging_budget
from subscriber_ext.transport.staging.progress import PartialVersion, ProgressFeed
from subscriber_ext.transport.subscriber_options import SubscriberKeywords, SubscriberOptions
from weightpub_wire.buffers import Allocator, BufferPool
from weightpub_wire.endpoints import parse_endpoint
from weightpub_wire.errors import (
    ApplyError,
    ClosedError,
    ConfigError,
    WeightPubError,
    WeightPubTimeout,
)
from weightpub_wire.security import curve_identity, is_local

__all__ = ["WeightSubscriber"]

log = logging.getLogger("weightpub.subscriber")

#: how long ``close()`` waits for the subscriber thread to end. It ends within a
#: poll once poked, unless it is inside a consumer's ``on_version`` callback, which
#: nothing can interrupt; past this wait ``close()`` returns anyway (without
#: ``ctx.term()``, which would block until the callback returns), so a stuck callback
#: never hangs the caller's shutdown. Long enough for a loaded machine's slow poll.
CLOSE_WAIT_SECONDS = 10.0


class WeightSubscriber:
    """Follow a ``WeightPublisher`` at ``endpoint`` and stage each new version.

    The background thread starts at construction. Every blocking call takes a
    timeout and raises ``WeightPubTimeout`` when it runs out. The option keywords
    (typed by ``SubscriberKeywords``) build one ``SubscriberOptions``
    (``transport/subscriber_options.py``, where each is declared once with its bound,
    default and unit; ``docs/options.md``), checked before anything starts; ``options=``
    passes one whole instead (or the ``SyncOptions`` the keywords override). They
    override ``SyncOptions`` fields (``window_bytes``, ``request_timeout``, ...), plus
    ``max_version_bytes`` (refuse larger manifests before allocating) and
    ``subscriber_id`` (in every report).
    ``curve_server_key_file`` (the publisher's public key) turns on CurveZMQ.

    ``staging_budget_bytes`` bounds the host memory of all staged versions alive
    at once (default: half of the memory available at start, see
    ``transport/staging/memory_budget.py``); a version that can never fit is refused before
    anything is allocated, one that fits once you ``release()`` what you hold
    waits. ``allocator`` chooses where staging buffers live (default: private
    host memory; node staging passes shared memory).

    ``collective=True`` lets it join the publisher's collective data path when the
    manifests announce one (gloo; NCCL or CUDA IPC on ``collective_device``): the
    versions then arrive by broadcast into the same staging, verified the same way,
    and any failure of that path fetches the version over ZeroMQ frames.

    ``nixl`` (None: where NIXL imports; True; False) reads versions whose manifests
    offer NIXL one-sided straight into staging (``transport/client/nixl_source.py``),
    verified like frames; whatever it cannot read comes over ZeroMQ frames, the cause
    counted in ``status()["nixl"]``.

    ``stream=True`` fetches the chunks of versions whose manifests announce a
    ``stream_port`` on that plain TCP port (``transport/client/stream_source.py``): a
    one-time token asked over this subscriber's DEALER, the bytes received straight into
    staging and hashed as they land, each chunk verified as a frame is; NOT encrypted.
    Whatever fails comes over ZeroMQ frames, the cause counted in ``status()["stream"]``.

    ``on_progress`` (optional, runs on the subscriber thread, must return quickly)
    sees each version while it arrives: a ``PartialVersion`` whose ``ready()``
    tensors are already verified and final, so work on them can start early; it is
    ``cancelled`` if that reception is given up (``transport/staging/progress.py``).

    ``peer_share=True`` serves the chunks this subscriber has verified to other
    subscribers of the same publisher and fetches from them as the publisher's
    tracker plans (``transport/peers/peering.py``): ``peer_bind`` (where to serve;
    default 127.0.0.1 for a loopback publisher, else every interface, which
    needs CURVE or ``insecure=True``), ``upload_mbit`` (None: no rate bound) and
    ``upload_cpu_share`` (of one core, default 0.25) bound what serving costs.
    With ``stream=True`` too, a whole-version member also serves its chunks on a plain
    TCP port of its own and fetches its planned peers' chunks on theirs (NOT encrypted;
    tokens over the CURVE peer ROUTER; fallbacks counted in
    ``status()["peers"]["stream_fallback_causes"]``; ``docs/peer-stream.md``).
    ``chunk_listener`` (a ``ChunkListener``) hears each version start, each chunk
    verify and each version end (a cut-through relay forwards chunks with it).

    ``slice_plan`` (a ``weightpub_wire.slice_plan.SlicePlan``, issue 30) fetches only
    those bytes of each version (``transport/client/slice_source.py``): the publisher
    is sent the plan once, each version's slices are verified against its per-plan
    checksums, and the version is staged in a full-size sparse buffer (same tensor
    views; bytes outside the plan read as zeros; ``data_path`` "slices", or "nixl" /
    "nixl+zmq" where the manifest offers NIXL: the planned byte ranges are READ
    one-sided and verified against the same sums); the budget
    counts the pages the plan touches. A publisher serving deltas: the last staged
    version (its planned pages, counted in the budget) is the base, and a version
    offering a delta against it comes as the deltas of the touched chunks, applied to
    the planned bytes only and checked against the same sums (``data_path`` still
    "slices", ``versions_delta`` counts it; ``transport/staging/sparse_delta.py``).
    ``status()["slice_plan"]`` shows the plan's share and its fallbacks by cause
    (whole chunks; raw slices instead of a delta). With ``peer_share`` it shares its
    slices with members of the same plan only (``status()["peers"]["plan"]``,
    ``other_plan_chunks``).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        options: SubscriberOptions | SyncOptions | None = None,
        on_version: Callable[[StagedVersion], None] | None = None,
        on_progress: Callable[[PartialVersion], None] | None = None,
        socket_hooks: list[Callable[..., None]] | None = None,
        context: zmq.Context | None = None,
        allocator: Allocator | None = None,
        chunk_listener: ChunkListener | None = None,
        **keywords: Unpack[SubscriberKeywords],
    ) -> None:
        router = parse_endpoint(endpoint)
        opts = self.build_options(options, **keywords)
        base = opts.sync
        hooks = list(socket_hooks or [])
        curve = None
        if opts.curve_server_key_file is not None:
            curve = curve_identity(opts.curve_server_key_file, opts.curve_secret_key_file)
            hooks.append(curve.client_hook())
        elif not is_local(router):
            log.warning("subscribing to %s without CURVE: the weights travel in plaintext "
                        "(checksums catch corruption, not a forger)", endpoint)
        self.endpoint = endpoint
        self.options = opts
        self.subscriber_id = opts.subscriber_id or f"{socket.gethostname()}-{os.getpid()}-" \
                                                   f"{uuid.uuid4().hex[:6]}"
        self._on_version = on_version
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._cond = threading.Condition()
        self._latest: StagedVersion | None = None
        self._delivered = 0  # counts completed versions, for iterators
        self._closed = False
        self._wake_address = f"inproc://weightpub-sub-wake-{uuid.uuid4().hex}"
        self._commands: list[Callable[[SyncClient], None]] = []
        budget = opts.staging_budget_bytes or derive_staging_budget()
        # a manifest offering NIXL: its chunks READ one-sided into staging (first), the
        # rest over ZeroMQ frames; staging buffers registered once, dropped with the pool
        self._nixl = NixlPicker(base.nixl, request_timeout=base.request_timeout,
                                window_bytes=base.window_bytes)
        # pinned where CUDA exists, a node's shared segments too (page-locked exactly,
        # weightpub_wire.buffers.page_locked), so the owner rank copies at full PCIe speed
        pool = BufferPool(max_buffers=2, allocator=self._nixl.allocator(allocator),
                          budget_bytes=budget, max_pinned_bytes=base.limits.max_pinned_bytes)
        # a manifest with a stream port: chunks on that plain TCP socket (first), the rest
        # (and whatever fails there) over ZeroMQ frames; its scratch counted in the budget
        self._stream = StreamPicker(base.stream, router.host, request_timeout=base.request_timeout,
                                    window_bytes=base.window_bytes, pool=pool)
        self._nixl.words.pool = pool  # the words it keeps for peers count in the budget
        self._slices: SliceFetcher | None = None
        shard_slices: ShardSlices | None = None
        if opts.slice_plan is not None:  # only this plan's bytes of each version (issue 30)
            self._slices = SliceFetcher(opts.slice_plan, self._ctx, endpoint, limits=base.limits,
                                        chunks_per_request=base.chunks_per_request,
                                        request_timeout=base.request_timeout, hooks=hooks)
            shard_slices = ShardSlices(self._slices)  # a sharded version: from each rank
        try:
            # NIXL first: a sliced subscriber READs only its planned byte ranges one-sided
            # (verified against the slice sums the slice source asks), then the stream
            # (its planned bytes recv_into'd in place), the rest comes as ZeroMQ slices
            self._client = SyncClient(self._ctx, endpoint, self.subscriber_id, base,
                                      self._deliver, hooks, pool, curve=curve,
                                      listeners=[self._nixl,
                                                 *([chunk_listener] if chunk_listener else [])],
                                      pickers=[self._nixl, self._stream, self._slices,
                                               shard_slices]
                                      if self._slices and shard_slices
                                      else [self._nixl, self._stream],
                                      targets=self._slices, repliers=[self._stream],
                                      peer_nixl=self._nixl)
        except BaseException:  # e.g. a peer_bind the rules refuse: leave nothing running
            self._nixl.close()
            if self._own_context:
                self._ctx.term()
            raise
        if shard_slices is None:  # a sharded trainer's ranks' stream ports (stream=True)
            self._client.shards.stream = self._stream
        if shard_slices is not None:  # a rank refusing this client's key: last_error at once
            shard_slices.on_handshake = self._client.sockets.link_handshake
            shard_slices.stream = self._stream  # each rank's stream port, for its slices
        if base.collective:
            self._client.collective = CollectiveMember(
                self.subscriber_id, endpoint=endpoint, device=base.collective_device,
                run_on_client=self._call, limits=base.limits)
        if on_progress is not None:  # first to hear a chunk: preparing starts at once
            client = self._client
            client.listeners.insert(0, ProgressFeed(on_progress, lambda: client.target))
        self._wake = self._ctx.socket(zmq.PULL)
        self._wake.bind(self._wake_address)
        self._thread = threading.Thread(target=self._run, name="weightpub-subscriber",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def build_options(options: SubscriberOptions | SyncOptions | None = None,
                      **keywords: Unpack[SubscriberKeywords]) -> SubscriberOptions:
        """The constructor's options as one object, checked (``ConfigError``), nothing started.

        ``options`` is a whole ``SubscriberOptions`` (then no keywords), or the
        ``SyncOptions`` base that keywords override.
        """
        if isinstance(options, SubscriberOptions):
            if keywords:
                raise ConfigError(f"WeightSubscriber: {', '.join(sorted(keywords))} given "
                                  "with options=SubscriberOptions (put them in the options)")
            return options
        if options is not None:
            return SubscriberOptions.from_keywords(**{**keywords, "sync": options})
        return SubscriberOptions.from_keywords(**keywords)

    # -- public API ----------------------------------------------------------------------------
    def latest(self) -> StagedVersion | None:
        """The newest complete version, without waiting."""
        with self._cond:
            return self._latest

    def wait_for_version(self, min_version: int | None = None,
                         timeout: float = 30.0) -> StagedVersion:
        """Block until a complete version >= ``min_version`` (any, if None) is staged."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise ClosedError("subscriber is closed")
                staged = self._latest
                if staged is not None and (min_version is None or staged.version >= min_version):
                    return staged
                left = deadline - time.monotonic()
                if left <= 0:
                    have = None if staged is None else staged.version
                    raise WeightPubTimeout(
                        f"no version >= {min_version} from {self.endpoint} within {timeout}s "
                        f"(have {have}; state {self._client.state}; "
                        f"last error {self._client.report.last_error!r})"
                    )
                self._cond.wait(left)

    def versions(self, timeout: float = 60.0) -> Iterator[StagedVersion]:
        """Yield each newly staged version (conflated to the newest) until closed.

        Raises ``WeightPubTimeout`` if nothing new arrives within ``timeout``.
        """
        seen = 0
        while True:
            deadline = time.monotonic() + timeout
            with self._cond:
                while self._delivered == seen and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise WeightPubTimeout(f"no new version within {timeout}s")
                    self._cond.wait(left)
                staged = self._latest
                if self._closed or staged is None:  # None only before the first delivery
                    return
                seen = self._delivered
            yield staged

    def mark_applied(self, version: int, error: str | WeightPubError | None = None) -> None:
        """Tell the publisher (back-channel) that ``version`` is live here.

        ``version`` 0 with an ``error`` reports a version that could not be applied
        (a string becomes an ``ApplyError``).
        """
        problem = ApplyError(error) if isinstance(error, str) else error
        self._call(lambda client: client.mark_applied(version, problem))

    def carry_from(self, old: WeightSubscriber, applied: int | None = None) -> None:
        """This subscription replaces ``old`` (closed first): take over its record of the
        applied version, what it cost and its recently staged versions' costs
        (``ClientReport.adopt``), then ``applied`` (the newest version applied) if newer.
        A rank's slice receiver resubscribing with a new plan calls it."""
        try:
            carry = old._client.report.carried(old._client.instance)
        except RuntimeError as exc:  # its thread outlived close() and changed the record
            log.warning("the replaced subscription's record was not carried over (%s)", exc)
            if applied:
                self.mark_applied(applied)
            return
        self._call(lambda client: client.report.adopt(carry, applied))

    def set_ranks(self, ranks: tuple[int, ...]) -> None:
        """The replica ranks this subscription stages for (in the report to the publisher)."""
        self._call(lambda client: client.set_ranks(tuple(ranks)))

    def status(self) -> dict[str, Any]:
        client = self._client
        target = client.target
        return {
            "subscriber_id": self.subscriber_id,
            "endpoint": self.endpoint,
            "state": client.state,
            "staged_version": client.current_version,
            "applied_version": client.report.applied_version,
            "fetching_version": None if target is None else target.manifest.version,
            "fetching_fraction": None if target is None else round(target.done_fraction, 3),
            "bad_messages": client.report.bad_messages,
            "checksum_failures": client.receiver.checksum_failures,
            # versions announced before their checksums (``announce_early``): how many,
            # the sum replies taken, the chunks whose bytes waited for their sum
            "early_sums": client.early_sums.status(client.receiver.held),
            "failures": dict(client.report.failures),
            "received_bytes": client.receiver.received_bytes,
            "publisher_latest_version": client.latest_seen,
            "ignored_manifests": client.follower.ignored_manifests,
            "handshake_failures": client.sockets.handshake_failures,
            "redials": client.sockets.replies.redials,  # ROUTER connections dialled anew
            # connected anew (by ZeroMQ or a redial): what was asked is asked again at once
            "reconnects": max(0, client.sockets.connections - 1),
            "publisher_id": client.instance,
            "last_error": client.report.last_error,
            # the newest version given up ({"version", "why"}), or None
            "abandoned": client.report.abandoned,
            "abandoned_versions": client.report.abandoned_count,  # versions given up
            **client.deltas.stats(),  # bytes received full vs delta, the delta base
            "refused": None if client.gate.refused is None else
            f"StagingBudgetError: {client.gate.refused}",
            "waiting_for_memory": None if client.gate.waiting is None else
            client.gate.waiting.version,
            "staging_budget_bytes": client.pool.budget_bytes,
            "staging_bytes": client.pool.held_bytes,
            # of those, bytes kept beside the staged versions (a peer server's slices, the
            # stream path's scratch: ``stream.scratch_bytes``; the words a member keeps for peers
            # READing it over NIXL)
            "staging_cache_bytes": client.pool.side_bytes,
            "data_path": client.report.applied_path or None,  # how the applied version came
            # what the applied version cost here: payload bytes by source kind, and their
            # share of the version (None: unknown, e.g. nothing applied yet)
            "applied_received": None if client.report.applied_bytes is None
            else client.report.applied_bytes.status(),
            "collective": None if client.collective is None else client.collective.status(),
            "peers": None if client.peering is None else client.peering.stats(),
            # slice fetches (issue 30): the plan, its share of a version, fallbacks by cause
            "slice_plan": None if self._slices is None else self._slices.status(),
            # the NIXL path: mode, bytes read one-sided, versions fetched over ZeroMQ by cause
            "nixl": self._nixl.status(),
            # the stream path: bytes received there, versions' chunks over frames by cause
            "stream": self._stream.status(),
        }

    def close(self) -> None:
        """Stop the thread and close the sockets; idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._client.collective is not None:
            self._client.collective.close()  # bounded: the next keepalive ends its wait
        self._poke()
        self._thread.join(timeout=CLOSE_WAIT_SECONDS)
        if self._thread.is_alive():
            # stuck in an on_version callback: ctx.term() would wait for it forever; the
            # thread closes its own sockets when the callback returns
            log.warning("subscriber thread still busy after %ss; closing without waiting",
                        CLOSE_WAIT_SECONDS)
            return
        if self._own_context:
            self._ctx.term()

    def __enter__(self) -> WeightSubscriber:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _call(self, command: Callable[[SyncClient], None]) -> None:
        """Run ``command`` on the subscriber thread (the only one touching sockets)."""
        with self._cond:
            self._commands.append(command)
        self._poke()

    def _run_commands(self, client: SyncClient) -> None:
        with self._cond:
            commands, self._commands = self._commands, []
        for command in commands:
            command(client)

    def settle(self) -> None:
        """From an ``on_version`` callback (this subscriber's own thread): run what was
        queued for the thread (``carry_from``'s record) now rather than after the
        callback returns; from any other thread, nothing."""
        if threading.current_thread() is self._thread:
            self._run_commands(self._client)

    def _poke(self) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        try:
            push.connect(self._wake_address)
            push.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the loop also wakes on its own every 100 ms
        finally:
            push.close()

    def _deliver(self, staged: StagedVersion) -> None:
        with self._cond:
            self._latest = staged
            self._delivered += 1
            self._cond.notify_all()
        log.info("staged version %d (%d bytes in %.3fs)", staged.version, staged.total_bytes,
                 staged.fetch_seconds)
        if self._on_version is not None:
            try:
                self._on_version(staged)
            except Exception:  # a consumer bug must not stop the subscriber
                log.exception("on_version callback failed for version %d", staged.version)

    def _survive(self, client: SyncClient, exc: BaseException) -> None:
        log.exception("subscriber loop error (continuing)")
        client.report.error = exc if isinstance(exc, WeightPubError) else WeightPubError(
            f"{type(exc).__name__}: {exc}")
        time.sleep(0.05)

    def _step(self, client: SyncClient, poller: zmq.Poller) -> None:
        wait = client.tick(time.monotonic())
        events = dict(poller.poll(int(wait * 1000)))
        if client.monitor in events:
            client.on_monitor()
        if self._wake in events:
            while self._wake.poll(0):
                self._wake.recv()
            self._run_commands(client)
        for _ in range(256):  # drain, bounded so ticks still run
            if not client.dealer.poll(0):
                break
            client.on_dealer()
        for _ in range(256):  # a flood on SUB cannot starve chunks or ticks
            if not client.sub.poll(0):
                break
            client.on_sub()
        client.on_events(events, time.monotonic())

    def _run(self) -> None:
        client = self._client
        poller = zmq.Poller()
        poller.register(client.dealer, zmq.POLLIN)
        poller.register(client.sub, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        poller.register(client.monitor, zmq.POLLIN)
        client.register(poller)
        try:
            while not self._closed:
                try:
                    self._step(client, poller)
                except zmq.ZMQError as exc:
                    if self._closed:
                        break
                    self._survive(client, exc)
                except Exception as exc:  # one bad event must not stop the subscriber
                    self._survive(client, exc)
        finally:
            client.close()
            self._wake.close(linger=0)

