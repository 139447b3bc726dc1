"""``WeightPublisher``: the trainer-side API.

``publish()`` copies the weights once into host memory and returns the new
version number; a preparing thread (``version_preparer.py``) hashes the copy and hands
it to the serving thread, which announces the manifest on PUB and serves chunks on ROUTER.

Versions are strictly increasing within one publisher instance. A restarted
publisher is a new instance (new ``publisher_id``); subscribers follow it once
the endpoint's ROUTER announces it, even if its version numbers restart (no
clocks are compared), so pass ``first_version`` (e.g. the trainer step) to keep
numbers monotonic across restarts.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Unpack

import msgspec
import zmq

from publisher.adapters import AdapterBook, AdapterSpec
from publisher.collective.collective_sender import CollectiveOptions, CollectivePublisher
from publisher.deltas.delta_encoder import DeltaPublisher
from publisher.publisher_config import PublisherConfig, load_publisher_config
from publisher.publisher_metrics import MetricsServer, PublisherCollector, PublisherFigures
from publisher.publisher_options import PublisherKeywords, PublisherOptions
from publisher.serving.front import ServingFront
from publisher.serving.relayed import RelayedVersion, relay_upstream
from publisher.serving.reports import UNAUTHENTICATED_QUORUM, counts_for, reporters
from publisher.serving.server import StatusExtras
from publisher.serving.stream_server import StreamServer
from publisher.sources.streamed_copy import plan_version
from publisher.sources.streamed_plan import PublishSource
from publisher.store.host_budget import BUDGET_NAME, HostBudget, derive_host_budget
from publisher.store.nixl_export import NixlExport, RegisteringAllocator
from publisher.store.snapshot import Snapshot
from publisher.store.sum_feed import SumFeed
from publisher.store.version_store import PublishedVersion, VersionStore
from publisher.version_preparer import EarlyHooks, VersionPreparer
from weightpub_wire import protocol as wire
from weightpub_wire.adapters import AdapterInfo
from weightpub_wire.buffers import BufferPool, byte_view
from weightpub_wire.collective_layout import GroupStatus
from weightpub_wire.endpoints import Endpoint
from weightpub_wire.errors import ClosedError, ConfigError, VersionUnavailable, WeightPubTimeout
from weightpub_wire.nixl_link import NixlOffer
from weightpub_wire.security import is_local

__all__ = ["WeightPublisher"]

log = logging.getLogger("weightpub.publisher")


class WeightPublisher:
    """Publish versioned weights to any number of subscribers over ZeroMQ.

    ``endpoint`` is the one address subscribers are given, e.g.
    ``tcp://0.0.0.0:5555`` (port 0 picks a free port; read ``.endpoint``).
    ``curve_secret_key_file`` turns on CurveZMQ encryption; with ``curve_allowed_clients_dir``
    only clients whose public keys are there may connect (re-read while running: removing a
    key file revokes it). Binding a non-loopback address without CURVE raises
    ``ConfigError`` unless ``insecure=True``.
    ``metrics_port`` serves Prometheus metrics on ``metrics_host`` (loopback by default).
    ``delta_anchor_every`` > 1 also serves versions as deltas against the previous one
    (``publisher.deltas.delta_encoder``), with a full anchor version every that many versions.
    ``limits`` overrides the serving thread's bounds (``ServerLimits``).
    ``chunk_size`` (bytes, each chunk checksummed and fetched alone) is by default
    chosen per version from its size: a power of two from 256 KiB to 4 MiB giving at
    least 64 chunks (``publisher.store.chunk_sizing``: peers forward whole chunks, so a
    small version in big chunks pays a long tail); set it to fix one for every version.
    ``host_budget_bytes`` bounds the host memory of the version snapshots (kept, being
    sent, pooled); default: 3/4 of the memory available at start (``publisher.store.host_budget``).
    ``keep_versions`` is how many snapshots are held whole, each one version's bytes of
    host memory: by default 1 (2 with deltas), and each new version is copied over the
    oldest one held, which is served chunk by chunk until overwritten
    (``publisher.store.version_store``); more lets subscribers slower than the trainer
    finish an older one.

    ``collective`` (``"gloo"`` on CPUs, ``"nccl"`` on GPUs, ``"cuda_ipc"`` for a replica
    on this process's GPU, or None) also serves every version by a collective broadcast
    in packed buckets of ``collective_bucket_bytes`` to the subscribers that ask to join
    (``publisher.collective.collective_sender``); manifests announce it, ZeroMQ frames
    stay the fallback.
    Its rendezvous binds ``collective_host`` (default: the endpoint's host) on
    ``collective_port`` (0: any free port); ``collective_timeout`` bounds every
    rendezvous and collective wait; ``collective_device`` is the GPU (nccl, cuda_ipc).

    ``nixl=True`` also offers every version for one-sided NIXL reads (UCX: RDMA, NVLink,
    shared memory, TCP; ``pip install weightpub[nixl]``): each snapshot buffer is
    registered once, the manifest carries the offer, replicas READ the chunks and verify
    them as they do frames (``publisher.store.nixl_export``); where NIXL cannot run the
    option is off with a WARNING (``nixl_status()``) and ZeroMQ frames serve.

    ``stream=True`` also serves chunks on a plain TCP port at the endpoint's host
    (``Manifest.stream_port``; ``publisher.serving.stream_server``): a subscriber with
    ``stream=True`` gets a one-time token over its CURVE connection, presents it there,
    and receives each chunk by ``sendmsg`` straight from the snapshot. Not encrypted
    (opt-in on both sides); every chunk is still checked against the manifest.

    ``peer_fanout`` (default 4; 0: off) is the number of stripes the tracker splits a
    version into for subscribers started with ``peer_share=True`` (``publisher.serving.tracker``):
    the trainer sends each chunk once, to the stripe's root, and the subscribers pass it on.

    These keywords build one ``PublisherOptions`` (``publisher.publisher_options``: each
    option declared there once, with its bound, default and unit), checked before
    anything starts; ``options=`` passes one whole instead (the YAML
    path does). ``socket_hooks`` and ``context`` are not options: they are objects
    of this process.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        options: PublisherOptions | None = None,
        socket_hooks: list[Callable[..., None]] | None = None,
        context: zmq.Context | None = None,
        **keywords: Unpack[PublisherKeywords],
    ) -> None:
        if options is None:
            options = PublisherOptions.from_keywords(**keywords)
        elif keywords:
            raise ConfigError(f"WeightPublisher: {', '.join(sorted(keywords))} given with "
                              "options= (put them in the options)")
        # checks the endpoint, the key file and the allow-list before anything is opened
        self._front = ServingFront(endpoint,
                                   curve_secret_key_file=options.curve_secret_key_file,
                                   curve_allowed_clients_dir=options.curve_allowed_clients_dir,
                                   insecure=options.insecure, socket_hooks=socket_hooks or ())
        self.options = options
        self.model_id = options.model_id
        #: the chunk size set by the user, or None: each version's follows its size
        #: (``publisher.store.chunk_sizing``; ``manifest(v).chunk_size`` is the one used)
        self.chunk_size: int | None = options.chunk_size
        self.publisher_id = uuid.uuid4().hex
        self.started_at = time.time()
        self._next_version = options.first_version
        #: one-sided NIXL reads of the snapshot buffers (``nixl=True``): registered as the
        #: pool makes them, deregistered as it drops them (``publisher.store.nixl_export``)
        self._nixl = NixlExport() if options.nixl else None
        self._pool = BufferPool(max_buffers=2, budget_name=BUDGET_NAME,
                                allocator=None if self._nixl is None
                                else RegisteringAllocator(self._nixl),
                                budget_bytes=options.host_budget_bytes or derive_host_budget(),
                                outside=self._scratch_bytes)
        self._store = VersionStore(options.versions_kept, self._pool)
        # every snapshot is checked against host_budget_bytes before it is allocated
        self._budget = HostBudget(self._pool, keep_versions=options.versions_kept,
                                  held=self._store.versions, recycle=self._store.recycle,
                                  retiring=self._store.retiring, scratch=self._scratch_bytes,
                                  drop_idle_scratch=self._drop_idle_scratch)
        self._deltas = DeltaPublisher(options.delta_anchor_every)
        collective = options.collective_options
        self._collective = None if collective is None else \
            self._start_collective(collective, self._front.router)
        try:
            # with CURVE a ZAP handler always runs: it enforces the allow-list and gives every
            # request its client's key (User-Id), which reports are filed under
            self._server = self._front.start(
                self._store, publisher_id=self.publisher_id, started_at=self.started_at,
                heartbeat_interval=options.heartbeat_interval, limits=options.server_limits,
                context=context, deltas=self._deltas, collective=self._collective,
                status_extras=self._status_extras, budget_room=self._budget_room)
        except BaseException:
            self._deltas.close()
            if self._collective is not None:
                self._collective.close()
            if self._nixl is not None:
                self._nixl.close()
            raise
        #: the plain-TCP stream port (``stream=True``), tokens handed out by the server
        self._stream: StreamServer | None = None
        if options.stream:
            self._stream = self._start_stream()
        self._announced = threading.Condition()
        self._announced_version = 0
        self._last_snapshot: tuple[int, Snapshot] | None = None  # the newest publish()'s
        #: the last version a failed publish withdrew, and why (``status``, issue 28.7)
        self.withdrawn: tuple[int, str] | None = None
        self._publish_lock = threading.Lock()
        self._closed = False
        # copies and hashes each snapshot; its thread calls _announce with the checksums
        # (announce_early: _announce_early at once, _sums_done once every sum is in)
        self._preparer = VersionPreparer(self._announce, EarlyHooks(
            self._announce_early, self._sums_done) if options.announce_early else None)
        #: LoRA adapters served (``publish(..., adapter=)``); None until the first, and
        #: a publisher serves either adapters or model weights (one version stream)
        self._adapters: AdapterBook | None = None
        self._adapters_of: dict[int, tuple[AdapterInfo, ...]] = {}  # until announced
        self._versions_published = 0
        self.metrics: MetricsServer | None = None
        if options.metrics_port is not None:
            try:
                self.metrics = MetricsServer(PublisherCollector(self._figures),
                                             options.metrics_port, options.metrics_host)
            except BaseException:
                self.close()
                raise
        log.info("publisher %s serving on %s (PUB %s)", self.publisher_id[:8],
                 self.endpoint, self._server.pub_endpoint)

    def _start_collective(self, options: CollectiveOptions,
                          router: Endpoint) -> CollectivePublisher:
        """The collective path; its rendezvous binds the endpoint's host unless told."""
        host = options.host or (router.host if router.scheme == "tcp" else "127.0.0.1")
        collective = CollectivePublisher(
            dataclasses.replace(options, host="0.0.0.0" if host == "*" else host),
            publisher_id=self.publisher_id, started_at=self.started_at,
            chunk_size=self.chunk_size)
        if not is_local(router) or options.host is not None:
            log.warning("collective path %s: gloo/NCCL traffic and its rendezvous are "
                        "neither encrypted nor authenticated (only join requests pass "
                        "CURVE); use it on a trusted fabric", options.backend)
        return collective

    def _start_stream(self) -> StreamServer | None:
        router = self._front.router
        if router.scheme != "tcp":
            log.warning("stream: off (the endpoint %s is not tcp://)", router)
            return None
        try:
            allow = self._front.allow_list
            stream = StreamServer(self._store, router.host,
                                  allowed=None if allow is None else allow.allowed)
        except OSError as exc:
            log.warning("stream: off (could not listen at %s: %s)", router.host, exc)
            return None
        self._server.stream = stream
        if not is_local(router):
            log.warning("stream: chunks on port %d travel unencrypted (only the token "
                        "passes CURVE); use it on a trusted network", stream.port)
        return stream

    # -- public API ----------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: str | os.PathLike[str] | PublisherConfig) -> WeightPublisher:
        """Start a publisher from a ``publisher:`` YAML file (path) or a ``PublisherConfig``."""
        if not isinstance(config, PublisherConfig):
            config = load_publisher_config(config)
        return cls(config.endpoint, options=config.options())

    @property
    def endpoint(self) -> str:
        """The bound ROUTER address (with the real port when bound to port 0)."""
        return self._front.endpoint

    @property
    def latest_version(self) -> int:
        """The newest version announced to subscribers (0 before the first)."""
        return self._announced_version

    def publish(self, weights: PublishSource, *, version: int | None = None,
                adapter: AdapterSpec | None = None) -> int:
        """Snapshot ``weights`` and return its version once the caller may modify them.

        ``adapter``: ``weights`` are a LoRA adapter (a PEFT model or its PEFT-named A/B
        tensors; ``publisher.adapters``) published under ``adapter.name``; the version
        holds every adapter published so far, each its newest tensors, and replicas serve
        them by name or merge them (``subscriber_ext.vllm_ext.lora``). A publisher serves
        either adapters or model weights, never both (``ConfigError``).

        Accepts a ``torch.nn.Module``, a mapping name -> tensor, or an iterable of
        (name, tensor); CPU or CUDA tensors; or a vLLM ``WeightSource`` (``ModuleSource``).
        Sharded weights (DTensors) and ``WeightSource``s are gathered, copied and dropped
        one layer group at a time; every other rank calls ``gather_full_tensors`` meanwhile
        (``publisher.sources.streamed_copy``).
        A snapshot that cannot fit ``host_budget_bytes`` beside the versions held raises
        ``StagingBudgetError`` (naming the budget and the bytes) before it is allocated;
        the versions published before stay served.
        """
        self._check_open()
        with self._publish_lock:
            if version is not None and version < self._next_version:
                raise ValueError(f"version {version} is not newer than {self._next_version - 1}")
            number = self._next_version if version is None else version
            weights = self._adapter_version(number, weights, adapter)
            # reply scratch kept idle since the last version would sit beside this snapshot
            # (up to the subscribers' windows); the next version's replies make it anew
            self._drop_idle_scratch()
            self._reuse_oldest()
            snapshot, pairs = plan_version(weights, self._pool,
                                           lambda nbytes: self._budget.admit(number, nbytes))
            snapshot.claim = functools.partial(self._store.claims(snapshot.buffer).claim,
                                               version=number)
            self._next_version = number + 1
            self._last_snapshot = (number, snapshot)
            try:
                self._preparer.copy_and_hash(number, snapshot, pairs,
                                             self.options.chunk_size_for(snapshot.total_bytes))
            except BaseException as exc:
                snapshot.failed = True  # subscribers get "version unavailable"
                kept, dropped = self._store.drop_lent(snapshot.buffer)
                if dropped:  # keep_versions buffers: the one it lent is half overwritten
                    self.withdrawn = (dropped[-1], (
                        f"publish of version {number} failed midway ({type(exc).__name__}: "
                        f"{exc}) over its buffer (keep_versions={self._store.keep}: the "
                        "snapshot overwrites the oldest version held)")[:4096])
                    log.warning("version %s withdrawn: %s", dropped, self.withdrawn[1])
                if kept:  # no byte was copied, so nothing of it was announced either:
                    log.warning("publish of version %d failed before it overwrote version "
                                "%s, which stays served", number, kept)
                elif not self._store.discard(number):  # the buffer is the kept one's
                    self._store.give_back(snapshot.buffer)
                raise
        return number

    def _adapter_version(self, number: int, weights: PublishSource,
                         adapter: AdapterSpec | None) -> PublishSource:
        """An adapter publish: the version's tensors (every adapter's); remembers the
        adapters for the manifest. Refuses mixing adapters and model weights."""
        if adapter is None:
            if self._adapters is not None:
                raise ConfigError("publish: this publisher serves LoRA adapters "
                                  f"({self._adapters.names}); publish model weights from "
                                  "another publisher, or pass adapter=")
            return weights
        if self._adapters is None:
            if self._last_snapshot is not None:
                raise ConfigError("publish: this publisher serves model weights; publish "
                                  "adapters from another publisher")
            self._adapters = AdapterBook()
        tensors, infos = self._adapters.version(adapter, weights)
        self._adapters_of[number] = infos
        while len(self._adapters_of) > 64:  # bounded, whatever never gets announced
            self._adapters_of.pop(next(iter(self._adapters_of)))
        return tensors

    def _reuse_oldest(self, wait_s: float = 10.0) -> None:
        """With ``keep_versions`` held, hand the oldest one's buffer to the next snapshot.

        The previous ``publish()``'s version is waited for (bounded) until it is in the
        store: its hashes may still be ending, and the version to lend is the oldest of
        the ones held once it is there (``announce_early``: once its sums are all in,
        since they may be hashed from that buffer).
        """
        last = self._last_snapshot
        if last is not None:
            number, snapshot = last
            deadline = time.monotonic() + wait_s
            with self._announced:
                while ((held := self._store.get(number)) is None or held.manifest.sums_follow) \
                        and not snapshot.failed and not self._closed \
                        and time.monotonic() < deadline:
                    self._announced.wait(0.05)
        self._store.make_room()

    def relay_version(self, upstream: wire.Manifest, *,
                      version: int | None = None) -> RelayedVersion:
        """Announce an upstream version now and serve each chunk once it is written in.

        For a cut-through relay (``weightpub.relay``): the manifest keeps the upstream's
        tensors, chunking and checksums, under this instance's id and the number
        ``version`` (default: the upstream's). The caller copies each verified chunk in
        with ``RelayedVersion.write_chunk`` and calls ``fail()`` if it never will; until
        then subscribers' fetches of a missing chunk wait for it (or time out). With
        ``delta_anchor_every`` > 1 the deltas are encoded chunk by chunk as chunks arrive.
        """
        self._check_open()
        if upstream.sums_follow:
            raise ValueError(f"version {upstream.version}: its checksums follow the manifest "
                             "(announce_early upstream): relay it once they are in")
        with self._publish_lock:
            number = upstream.version if version is None else version
            if number < self._next_version:
                raise ValueError(f"version {number} is not newer than {self._next_version - 1}")
            self._reuse_oldest()
            total = upstream.total_bytes
            self._budget.admit(number, total)
            snapshot = Snapshot(entries=list(upstream.tensors), buffer=self._pool.take(total),
                                total_bytes=total)
            self._next_version = number + 1
            relayed = relay_upstream(upstream, number, snapshot, self._store, self._deltas,
                                     publisher_id=self.publisher_id, started_at=self.started_at,
                                     model_id=self.model_id,
                                     stream_port=None if self._stream is None
                                     else self._stream.port)
            early = self._early_offer(relayed)
            self._announced_now(relayed.published)
        if self._nixl is not None and not early:  # the offer follows once the copy is done
            relayed.when_done(self._relay_offer, self._relay_unoffered)
        return relayed

    def _early_offer(self, relayed: RelayedVersion) -> bool:
        """``nixl_cut_through``: offer the relayed version now with a readiness map (the
        buffer's registered words, one per chunk, each set to the version's number after
        that chunk's bytes are in: ``RelayedVersion.on_written``). False when not asked
        for, or the words or the offer could not be made (the offer then follows the
        copy as without it)."""
        nixl, published = self._nixl, relayed.published
        if nixl is None or not self.options.nixl_cut_through or not nixl.on:
            return False
        words = nixl.ready_words(published.buffer)
        manifest = published.manifest
        if words is None or manifest.num_chunks > len(words):
            return False
        number = manifest.version

        def written(chunk: int) -> None:
            words[chunk] = number

        relayed.on_written = written
        offer = nixl.offer(published.buffer, manifest.total_bytes, claims=published.claims,
                           version=number, ready=words, chunk_size=manifest.chunk_size)
        if offer is None:
            relayed.on_written = None
            return False
        published.manifest = msgspec.structs.replace(manifest, nixl=offer)
        return True

    def wait_announced(self, version: int, timeout: float = 30.0) -> None:
        """Block until ``version`` has been hashed and announced (useful in scripts/tests)."""
        deadline = time.monotonic() + timeout
        with self._announced:
            while self._announced_version < version:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise WeightPubTimeout(f"version {version} not announced within {timeout}s")
                self._announced.wait(left)

    def manifest(self, version: int | None = None) -> wire.Manifest:
        """The manifest of ``version`` (default: the newest announced one).

        Raises ``VersionUnavailable`` when this publisher does not hold it (never
        published, still being hashed, or evicted after ``keep_versions`` newer ones).
        """
        self._check_open()
        held = self._store.latest() if version is None else self._store.get(version)
        if held is None or held.failed:
            raise VersionUnavailable(
                f"version {version if version is not None else 'latest'} is not held by "
                f"publisher {self.publisher_id[:8]} (held: {list(self._store.versions())})")
        return held.manifest

    def data_stats(self) -> dict[str, float]:
        """Chunk payload bytes sent (full vs delta), the delta encoder's work so far, and
        the host budget (``host_budget_bytes``) with the bytes its snapshot buffers hold
        (``keep_versions`` snapshots, plus one while a kept one is pinned) and the
        reply scratch queued in ZeroMQ."""
        held = self._deltas.held()
        return {
            "bytes_sent_full": self._server.served_bytes,
            "bytes_sent_delta": self._server.delta_serving.bytes_sent,
            "delta_versions_encoded": self._deltas.encoded_versions,
            "delta_encode_cpu_seconds": round(self._deltas.cpu_seconds, 4),
            "deltas_held": held[0],
            "delta_bytes_held": held[1],
            "bytes_sent_collective": 0 if self._collective is None
            else self._collective.bytes_sent,
            "host_budget_bytes": self._budget.budget_bytes,
            "host_held_bytes": self._pool.held_bytes,
            # snapshots held whole: host_held_bytes is about this many versions
            "keep_versions": self._store.keep,
            # chunk frames' scratch ZeroMQ still holds (bounded by max_total_queued_bytes)
            "send_queued_bytes": 0 if self._server.peers is None
            else self._server.peers.total_queued,
            # all reply scratch: queued frames and idle send buffers kept for reuse (dropped
            # when the next version is published)
            "reply_scratch_bytes": self._scratch_bytes(),
            # slice fetches (issue 30): planned bytes sent, plans held and what they hold
            "bytes_sent_slices": self._server.slice_serving.bytes_sent,
            "slice_plans": self._server.slice_serving.plans,
            "slice_held_bytes": self._server.slice_serving.held,
            # snapshot buffers registered for NIXL reads (``nixl=True``) and the offers made
            "nixl_registered_bytes": 0 if self._nixl is None else self._nixl.registered_bytes,
            "nixl_offers": 0 if self._nixl is None else self._nixl.offers,
            "nixl_off": 0 if self._nixl is None or not self._nixl.off_reason else 1,
            # the plain-TCP stream port (``stream=True``): chunk bytes sent there
            "bytes_sent_stream": 0 if self._stream is None else self._stream.bytes_sent,
        }

    def _scratch_bytes(self) -> int:
        """Reply scratch alive (counted in ``host_budget_bytes``); 0 before serving. Slice
        plans and their checksums count here too (``slice_serving.py``), and the stream
        port's slice gathers being sent (``stream_server.py``)."""
        server = getattr(self, "_server", None)
        peers = None if server is None else server.peers
        slices = 0 if server is None else server.slice_serving.held
        stream = getattr(self, "_stream", None)
        gathers = 0 if stream is None else stream.scratch_bytes
        return slices + gathers + (0 if peers is None else peers.scratch_bytes)

    def _drop_idle_scratch(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None and server.peers is not None:
            server.peers.scratch.drop_idle()

    def _budget_room(self) -> int:
        """The host budget the snapshots leave to reply scratch."""
        return self._budget.budget_bytes - self._pool.held_bytes

    def _status_extras(self) -> StatusExtras:
        """The host memory a status reply shows (``weightpub status``), read on the serving
        thread."""
        peers = self._server.peers
        return StatusExtras(memory=wire.HostMemory(
            budget_bytes=self._budget.budget_bytes, held_bytes=self._pool.held_bytes,
            keep_versions=self._store.keep,
            send_queued_bytes=0 if peers is None else peers.scratch_bytes,
            withdrawn_version=0 if self.withdrawn is None else self.withdrawn[0],
            withdrawn_reason="" if self.withdrawn is None else self.withdrawn[1],
            nixl_registered_bytes=0 if self._nixl is None else self._nixl.registered_bytes,
            nixl_off_reason="" if self._nixl is None else self._nixl.off_reason),
            nixl=None if self._nixl is None else self._nixl.wire_status())

    def nixl_status(self) -> dict[str, object] | None:
        """The NIXL path (``nixl=True``): on, why off, bytes registered, offers; else None."""
        return None if self._nixl is None else self._nixl.status()

    def stream_status(self) -> dict[str, object] | None:
        """The stream port (``stream=True``): port, connections open, accepted, refused,
        turned away and cut; bytes and chunks sent; tokens issued and denied; else None."""
        return None if self._stream is None else self._stream.status()

    def collective_status(self) -> GroupStatus | None:
        """The collective path's group (backend, epoch, members, rounds), or None."""
        return None if self._collective is None else self._collective.status()

    def fleet(self) -> list[wire.Report]:
        """The last report of each subscriber seen recently (staged/applied version, error;
        for a replica its ``ranks``, ``data_path`` and ``received_fraction``: the share of
        its applied version it pulled, about 1/TP for a rank fetching its own slices).

        With CURVE each report's ``client_key`` is the key its connection authenticated
        with, and a subscriber id belongs to the key that first reported it while its row
        lives; without CURVE anyone who reaches the endpoint can add rows (bounded).
        """
        return self._server.fleet()

    def peer_nixl_totals(self) -> wire.PeerNixlFigures | None:
        """The fleet's peers-over-NIXL counters (issue 31), summed over the reports seen
        recently (each row's own in ``fleet()``): bytes and chunks members READ from
        peers, offers they made, questions they answered None by cause; None when no
        report carries them."""
        return wire.peer_total(r.peer_nixl for r in self.fleet())

    def peer_stream_totals(self) -> wire.PeerStreamFigures | None:
        """The fleet's peers-over-the-stream counters (``docs/peer-stream.md``), summed
        the same way: bytes and chunks members received on peers' stream ports, what
        their own ports sent, chunks given back to frames by cause; None when no report
        carries them."""
        return wire.peer_total(r.peer_stream for r in self.fleet())

    def wait_for_subscribers(self, version: int, count: int, *, applied: bool = True,
                             timeout: float = 60.0,
                             distinct_keys: bool = True) -> list[wire.Report]:
        """Block until ``count`` subscribers report ``version`` (or newer) applied/staged.

        Only reports about this instance's versions count, and none above the newest
        version it announced (a forged "applied 2**63-1" is not a quorum). Under CURVE
        the quorum counts distinct authenticated client keys, so one key over many
        connections or ids counts once (``distinct_keys=False``: count subscriber ids, for
        a fleet that shares one key, trusting every holder of it). Without CURVE any host
        that reaches the endpoint can satisfy it with reports under invented ids (logged
        as a warning at first use). Returns the reports that count.
        """
        if not self._front.curve and not getattr(self, "_quorum_warned", False):
            self._quorum_warned = True
            log.warning(UNAUTHENTICATED_QUORUM)
        deadline = time.monotonic() + timeout
        while True:
            announced = self._announced_version
            done = [r for r in self.fleet()
                    if counts_for(r, publisher_id=self.publisher_id, announced=announced,
                                  version=version, applied=applied)]
            got = reporters(done) if distinct_keys else len(done)
            if got >= count:
                return done
            if time.monotonic() >= deadline:
                what = "subscribers (distinct keys)" if distinct_keys and any(
                    r.client_key for r in done) else "subscribers"
                raise WeightPubTimeout(
                    f"{got}/{count} {what} reached version {version} in {timeout}s"
                )
            time.sleep(0.02)

    def _figures(self) -> PublisherFigures:
        delta_bytes = self._server.delta_serving.bytes_sent
        return PublisherFigures(latest_version=self._announced_version,
                                versions_published=self._versions_published,
                                served_bytes=self._server.served_bytes + delta_bytes,
                                served_delta_bytes=delta_bytes, fleet=self.fleet(),
                                stream=None if self._stream is None else self._stream.status(),
                                nixl=None if self._nixl is None else self._nixl.status())

    def close(self) -> None:
        """Stop threads and close sockets; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.metrics is not None:
            self.metrics.close()
        self._preparer.close()  # announces what is queued (10 s at most), stops the hashers
        self._deltas.close()
        if self._collective is not None:
            self._collective.close()  # bounded by collective_timeout
        if self._stream is not None:
            self._stream.close()
        self._front.close()  # the serving thread, the ZAP handler, our own context
        self._store.clear()
        if self._nixl is not None:  # nothing serves from the buffers any more
            self._nixl.close()
        with self._announced:
            self._announced.notify_all()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("publisher is closed")

    def _manifest(self, number: int, snapshot: Snapshot, chunk_size: int, created_at: float,
                  **fields: Any) -> wire.Manifest:
        """Version ``number``'s manifest: what every announcement of it carries, plus
        ``fields`` (checksums, and the data paths or the early-sums mark)."""
        return wire.Manifest(
            publisher_id=self.publisher_id, started_at=self.started_at, version=number,
            created_at=created_at, model_id=self.model_id, chunk_size=chunk_size,
            total_bytes=snapshot.total_bytes, tensors=tuple(snapshot.entries),
            adapters=self._adapters_of.pop(number, None),
            stream_port=None if self._stream is None else self._stream.port, **fields,
        )

    def _announce(self, number: int, snapshot: Snapshot, chunk_size: int,
                  checksums: tuple[int, ...], created_at: float) -> None:
        if snapshot.failed:
            return
        view = byte_view(snapshot.buffer, snapshot.total_bytes)
        previous = self._store.latest()
        delta = self._deltas.plan(number, snapshot.entries, snapshot.total_bytes,
                                  chunk_size, checksums, previous)
        manifest = self._manifest(
            number, snapshot, chunk_size, created_at,
            checksums=checksums, delta=delta, deltas_follow=self._deltas.enabled,
            collective=None if self._collective is None else self._collective.announce(),
            nixl=self._nixl_offer(snapshot, number),
        )
        published = PublishedVersion(manifest=manifest, buffer=snapshot.buffer, view=view,
                                     snapshot=snapshot)
        self._store.add(published)
        self._deltas.start(published, previous)  # in the background, after the announcement
        self._announced_now(published)

    def _announce_early(self, number: int, snapshot: Snapshot, chunk_size: int,
                        feed: SumFeed, created_at: float) -> None:
        """``announce_early``: the manifest as soon as the layout is known, its checksums
        zeros under ``SUMS_FOLLOW``; the serving thread hands the sums on from ``feed``."""
        if snapshot.failed:
            return
        num_chunks = -(-snapshot.total_bytes // chunk_size)
        manifest = self._manifest(
            number, snapshot, chunk_size, created_at, checksums=(0,) * num_chunks,
            checksum_algorithm=wire.SUMS_FOLLOW, sums_follow=True,
        )
        published = PublishedVersion(manifest=manifest, buffer=snapshot.buffer,
                                     view=byte_view(snapshot.buffer, snapshot.total_bytes),
                                     snapshot=snapshot, sums=feed)
        self._store.add(published)
        self._announced_now(published)

    def _sums_done(self, number: int, snapshot: Snapshot, checksums: tuple[int, ...]) -> None:
        """Every sum of an early version is in: its manifest becomes the complete one and
        is announced again (late joiners and subscribers that predate early sums take it)."""
        published = self._store.get(number)
        if published is None or published.snapshot is not snapshot or snapshot.failed:
            return
        published.manifest = published.manifest.with_sums(checksums)
        self._front.announce()
        with self._announced:
            self._announced.notify_all()  # a publish() waiting in _reuse_oldest

    def _nixl_offer(self, snapshot: Snapshot, number: int,
                    wait_s: float = 60.0) -> NixlOffer | None:
        """The version's NIXL offer, once its copy is done (None: off, or not in time).

        A one-sided reader is not held back per chunk as frames are (the server sends
        a chunk once it is copied), and hashes may end before the copy: the offer goes
        out with the manifest only when every byte is final, else a fast reader would
        read stale bytes and refetch them as frames (checksum)."""
        if self._nixl is None:
            return None
        if not self._nixl.on:
            self._nixl.unoffer("off")
            return None
        deadline = time.monotonic() + wait_s
        while snapshot.copied_bytes < snapshot.total_bytes:
            if snapshot.failed or self._closed or time.monotonic() > deadline:
                self._nixl.unoffer("copy")
                return None
            time.sleep(0.001)
        return self._nixl.offer(snapshot.buffer, snapshot.total_bytes,
                                claims=self._store.claims(snapshot.buffer), version=number)

    def _relay_offer(self, relayed: RelayedVersion) -> None:
        """A relayed version whose copy is complete (``RelayedVersion.on_complete``, on the
        relay's upstream thread): its manifest gains the NIXL offer of the relay's buffer
        and is announced again. Downstream subscribers that took the version before get
        it as frames (a subscriber keeps the manifest it started with); later ones READ."""
        published = relayed.published
        if self._nixl is None or self._closed or relayed.failed:
            return
        if self._store.get(published.manifest.version) is not published:
            self._nixl.unoffer("copy")  # superseded or evicted before it was complete
            return
        offer = self._nixl.offer(published.buffer, published.manifest.total_bytes,
                                 claims=published.claims, version=published.manifest.version)
        if offer is None:
            return  # counted by ``offer`` (off, unregistered)
        published.manifest = msgspec.structs.replace(published.manifest, nixl=offer)
        self._front.announce()

    def _relay_unoffered(self, relayed: RelayedVersion) -> None:
        """A relayed version failed before its copy was complete: never offered."""
        if self._nixl is not None:
            self._nixl.unoffer("copy" if self._nixl.on else "off")

    def _announced_now(self, published: PublishedVersion) -> None:
        number = published.manifest.version
        self._front.announce()
        if self._collective is not None:
            self._collective.announced(published)  # its own thread broadcasts it
        with self._announced:
            self._announced_version = number
            self._versions_published += 1
            self._announced.notify_all()
        log.debug("announced version %d (%d bytes, %d chunks)", number,
                  published.manifest.total_bytes, published.manifest.num_chunks)
