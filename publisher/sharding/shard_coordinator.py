"""``ShardCoordinator``: announces a sharded trainer's version once every rank's shard is in.

Every rank of a ``ShardedPublisher`` serves its own shard and tells the
coordinator (a ``ShardSubmit`` on a DEALER to ``collect_endpoint``) its layout,
checksums and where it serves. Once all ``world_size`` ranks submitted version
V, the coordinator lays the shards end to end (rank order, each chunk-aligned),
and announces one manifest whose ``shards`` say which rank serves which chunks;
subscribers dial ``endpoint`` as for any publisher (latest, heartbeats, reports)
and fetch the chunks from the ranks. It holds no weight bytes. With deltas
(ranks with ``delta_anchor_every`` > 1) the union offers the bases every rank
serves its deltas from, with the same layout (``publisher.sharding.shard_deltas``).

All or nothing: a version whose shards are not all in within ``shard_timeout``
of its first one is dropped (counted in ``dropped_versions``), and so is one whose
ranks name one address twice; replicas keep the last complete one. A rank that
restarts (a new instance, perhaps a new port) is simply in the next version's
manifest. Versions announced normally increase; a complete version *below* the
announced one is announced too, in its place (a WARNING): no announced version, a
forged ``2**62`` included, locks the ranks' own sequence out (issue 28.2; what is
left to a stranger is in ``docs/RELIABILITY.md``). Versions still collecting below
a newly announced one are dropped.

Bounded by what it holds decoded (issue 28.3): at most ``MAX_PENDING_VERSIONS``
versions collect at once and their submits hold at most ``max_pending_bytes`` as
decoded objects (``shard_submit.decoded_bytes``: 3-13x the frame); a new version
past either drops the oldest pending one, and a submit that does not fit even then
is refused (a WARNING, counted), so a rank far ahead or a stray peer costs old
versions, never memory. A frame is at most ``max_pending_bytes / 16`` (ZeroMQ's
``MAXMSGSIZE``), so decoding one cannot exceed the bound either; what ZeroMQ holds
for messages not yet read (a multipart message that never ends included) is
bounded per connection and over all of them by the publisher's own
``ConnectionGuard`` (the connection is cut). Once pending submits are dropped,
expired or announced, the heap they freed is given back to the OS
(``weightpub_wire.heap_trim``). A submit that breaks the coordinator's own code is
refused and counted; the collecting thread lives on.

CURVE (``curve_secret_key_file``: the trainer's key pair, the one every rank
serves with): the subscribers' ROUTER and PUB are CURVE servers with that key
and ``curve_allowed_clients_dir`` admits subscribers, exactly as a
``WeightPublisher``'s; the collect ROUTER is a CURVE server with the same key that
admits only that key (its own ZAP domain, ``COLLECT_ZAP_DOMAIN``): a rank is
whoever holds the trainer's secret key, and an allow-listed subscriber cannot
submit a shard. A refused rank is counted (``refused_handshakes``) and named in
``last_error``. Without CURVE a non-loopback bind needs ``insecure=True``. The
coordinator's ZAP handler is its context's only one: give it a context of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
import zmq

from publisher.serving.connections import ConnectionGuard, GuardLimits
from publisher.serving.front import ServingFront
from publisher.serving.reports import counts_for, reporters
from publisher.serving.server import ServerLimits, StatusExtras, TrackerLimits
from publisher.sharding.shard_deltas import ShardDeltas, shard_layout
from publisher.store.version_store import PublishedVersion, VersionStore
from weightpub_wire import protocol as wire
from weightpub_wire.allow_list import KeySet
from weightpub_wire.buffers import BufferPool
from weightpub_wire.endpoints import parse_endpoint
from weightpub_wire.errors import ConfigError, ProtocolError, WeightPubTimeout
from weightpub_wire.heap_trim import trim_heap
from weightpub_wire.security import load_key_file
from weightpub_wire.shard_submit import (
    DECODED_PER_FRAME_BYTE,
    ShardSubmit,
    decode_submit,
    decoded_bytes,
)
from weightpub_wire.sockets import bind, configure_socket

__all__ = ["SHARD_PAD", "ShardCoordinator"]

log = logging.getLogger("weightpub.publisher")

#: the name of a rank's zero tail that makes its shard a whole number of chunks
SHARD_PAD = "__weightpub_shard_pad__"
MAX_SUBMIT_BYTES = 256 << 20
#: the collect ROUTER's ZAP domain: under CURVE it admits only the trainer's own key
COLLECT_ZAP_DOMAIN = "weightpub-shard-collect"
#: versions collecting at once: a trainer has one, two while a slow rank catches up
MAX_PENDING_VERSIONS = 4
DEFAULT_MAX_PENDING_BYTES = 512 << 20
#: complete submits ZeroMQ queues per connection before the collecting thread reads them
COLLECT_RCVHWM = 4
#: pending bytes freed since the last trim that make the heap worth trimming
TRIM_AFTER_BYTES = 16 << 20


@dataclass(slots=True)
class _Pending:
    first_at: float
    shards: dict[int, ShardSubmit] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)  # each rank's submit, decoded bytes

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())


class ShardCoordinator:
    """Rank 0's side (or any process's): collects shards, announces complete versions."""

    def __init__(self, endpoint: str, collect_endpoint: str, world_size: int, *,
                 shard_timeout: float = 30.0, heartbeat_interval: float = 1.0,
                 insecure: bool = False, model_id: str = "",
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                 peer_fanout: int | None = None,
                 peer_members_per_address: int | None = None,
                 curve_secret_key_file: str | None = None,
                 curve_allowed_clients_dir: str | None = None,
                 context: zmq.Context | None = None) -> None:
        """``max_pending_bytes``: what the submits of versions still collecting may hold,
        decoded (``shard_submit.decoded_bytes``); a submit's frame is at most 1/16 of it
        (and 256 MiB), what ZeroMQ holds unread at most all of it.
        ``peer_fanout``: as ``WeightPublisher``'s (default 4; 0: off): the tracker runs
        here, peer-sharing subscribers say hello here and fetch from each other what the
        plan says, the rest from the ranks; ``peer_members_per_address``: as
        ``WeightPublisher``'s (default 4). ``curve_*``: see the module docstring."""
        if world_size < 1:
            raise ConfigError(f"world_size: {world_size} must be >= 1")
        if shard_timeout <= 0:
            raise ConfigError(f"shard_timeout: {shard_timeout} must be > 0")
        try:
            tracker = TrackerLimits()
            if peer_fanout is not None:
                tracker = dataclasses.replace(tracker, fanout=peer_fanout)
            if peer_members_per_address is not None:
                tracker = dataclasses.replace(
                    tracker, max_members_per_address=peer_members_per_address)
        except ValueError as exc:
            raise ConfigError(str(exc).replace("max_members_per_address:",  # our names
                                               "peer_members_per_address:")
                              .replace("fanout:", "peer_fanout:", 1)) from None
        if max_pending_bytes < 1 << 20:
            raise ConfigError(f"max_pending_bytes: {max_pending_bytes} must be >= 1 MiB")
        # the subscribers' side, as a WeightPublisher's; checked before anything is opened
        self._front = ServingFront(endpoint, curve_secret_key_file=curve_secret_key_file,
                                   curve_allowed_clients_dir=curve_allowed_clients_dir,
                                   insecure=insecure, also_binds=[collect_endpoint])
        collect = parse_endpoint(collect_endpoint)
        curve = self._front.curve
        self.world_size = world_size
        self.shard_timeout = shard_timeout
        self.model_id = model_id
        self.max_pending_bytes = max_pending_bytes
        self.publisher_id = uuid.uuid4().hex
        self.started_at = time.time()
        self.dropped_versions = 0
        self.refused_submits = 0
        self.refused_handshakes = 0  # collect connections without the trainer's key (CURVE)
        self.cut_connections = 0  # collect connections that held too many unread bytes
        self.trimmed_bytes = 0  # resident bytes the heap trims gave back
        self._freed_since_trim = 0
        self.last_error = ""
        self._pending: dict[int, _Pending] = {}
        self._deltas = ShardDeltas()  # announced unions' digests: the bases deltas start from
        self._announced = 0
        self._cond = threading.Condition()
        self._store = VersionStore(1, BufferPool(max_buffers=1))
        self._server = self._front.start(
            self._store, publisher_id=self.publisher_id, started_at=self.started_at,
            heartbeat_interval=heartbeat_interval, limits=ServerLimits(tracker=tracker),
            context=context, zap_domains=None if curve_secret_key_file is None else
            self._collect_keys(curve_secret_key_file), status_extras=self._status_extras)
        assert self._front.ctx is not None
        self._collect = self._front.ctx.socket(zmq.ROUTER)
        guard: ConnectionGuard | None = None
        try:
            configure_socket(self._collect, heartbeat_interval=heartbeat_interval, pings=False)
            for hook in self._front.hooks:
                hook(self._collect, server=True)
            if curve:
                self._collect.setsockopt_string(zmq.ZAP_DOMAIN, COLLECT_ZAP_DOMAIN)
            self._collect.setsockopt(zmq.MAXMSGSIZE, self._max_submit)
            self._collect.setsockopt(zmq.RCVHWM, COLLECT_RCVHWM)
            # watched before bound, so a rank connecting at once cannot escape the guard
            # (the collecting thread takes both over; Thread.start is the memory barrier)
            guard = ConnectionGuard({"collect": self._collect}, self._guard_limits)
            self.collect_endpoint = bind(self._collect, str(collect))
        except BaseException:
            if guard is not None:
                guard.close()
            self._collect.close(linger=0)
            self._front.close()
            raise
        self._guard = guard
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="weightpub-shard-collect",
                                        daemon=True)
        self._thread.start()
        log.info("shard coordinator %s: subscribers dial %s, %d ranks submit to %s",
                 self.publisher_id[:8], self.endpoint, world_size, self.collect_endpoint)

    def _collect_keys(self, secret_key_file: str) -> dict[str, KeySet]:
        """ZAP for the collect socket: the trainer's own public key only (subscribers go by
        the front's allow-list, any key without one)."""
        public, _ = load_key_file(secret_key_file, need_secret=True)
        trainer = KeySet([public], f"the trainer's key ({secret_key_file})",
                         on_refused=self._refused_handshake)
        return {COLLECT_ZAP_DOMAIN: trainer}

    def _refused_handshake(self, why: str) -> None:
        self.refused_handshakes += 1
        self.last_error = f"{why}: only ranks holding it may submit shards"

    @property
    def endpoint(self) -> str:
        """The address subscribers are given (the real port when bound to port 0)."""
        return self._front.endpoint

    @property
    def latest_version(self) -> int:
        return self._announced

    @property
    def pending_bytes(self) -> int:
        """Decoded bytes the submits of versions still collecting hold."""
        return sum(pending.nbytes for pending in list(self._pending.values()))

    @property
    def _max_submit(self) -> int:
        """A submit's largest frame: decoded, it still fits ``max_pending_bytes``."""
        return min(MAX_SUBMIT_BYTES, self.max_pending_bytes // DECODED_PER_FRAME_BYTE)

    @property
    def _guard_limits(self) -> GuardLimits:
        """Unread bytes ZeroMQ may hold: a few frames per connection, the bound in all."""
        return GuardLimits(max_held_bytes=(COLLECT_RCVHWM + 1) * self._max_submit + (1 << 20),
                           max_connections=4 * self.world_size + 64,
                           max_total_held_bytes=self.max_pending_bytes)

    def manifest(self) -> wire.Manifest | None:
        latest = self._store.latest()
        return None if latest is None else latest.manifest

    def group_status(self) -> wire.ShardGroup:
        """Which ranks' shards of each collecting version are in (``weightpub status``)."""
        now = time.monotonic()
        pending = sorted(list(self._pending.items()))[-16:]
        return wire.ShardGroup(
            world_size=self.world_size, dropped_versions=self.dropped_versions,
            refused_submits=self.refused_submits, last_error=self.last_error[:4096],
            pending=tuple(wire.PendingShards(version, tuple(sorted(p.shards)),
                                             max(0.0, now - p.first_at))
                          for version, p in pending))

    def _status_extras(self) -> StatusExtras:
        return StatusExtras(shard_group=self.group_status())

    def wait_announced(self, version: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._announced < version:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise WeightPubTimeout(f"version {version} not announced within {timeout}s"
                                           f" ({self.last_error or 'shards missing'})")
                self._cond.wait(left)

    def fleet(self) -> list[wire.Report]:
        return self._front.fleet()

    def wait_for_subscribers(self, version: int, count: int, *, applied: bool = True,
                             timeout: float = 60.0) -> list[wire.Report]:
        """Block until ``count`` subscribers report ``version`` (or newer); unauthenticated."""
        deadline = time.monotonic() + timeout
        while True:
            done = [r for r in self.fleet()
                    if counts_for(r, publisher_id=self.publisher_id, announced=self._announced,
                                  version=version, applied=applied)]
            if reporters(done) >= count:
                return done
            if time.monotonic() >= deadline:
                raise WeightPubTimeout(f"{reporters(done)}/{count} subscribers reached "
                                       f"version {version} in {timeout}s")
            time.sleep(0.02)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._thread.join(timeout=5)  # closes the collect socket
        self._front.close()  # the serving thread, the ZAP handler, our own context
        self._store.clear()
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> ShardCoordinator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the collecting thread -----------------------------------------------------------------
    def _run(self) -> None:
        sock, guard = self._collect, self._guard
        poller = zmq.Poller()
        for polled in (sock, *guard.monitors):
            poller.register(polled, zmq.POLLIN)
        try:
            while not self._closed:
                events = dict(poller.poll(50))
                guard.on_events(events)
                if sock in events:
                    for _ in range(64):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        fd = _property(frames[-1], zmq.SRCFD)
                        guard.delivered(fd if isinstance(fd, int) else None)
                        self._on_frames(frames)
                        del frames  # freed before the next one is read
                now = time.monotonic()
                guard.check(now)
                self.cut_connections = guard.cut_count
                self._expire(now)
                self._trim()
        finally:
            guard.close()
            sock.close(linger=0)

    def _trim(self) -> None:
        """Give the heap back once pending submits freed enough of it (they are many small
        objects: glibc and pymalloc keep much of it otherwise)."""
        if self._freed_since_trim >= TRIM_AFTER_BYTES:
            self._freed_since_trim = 0
            self.trimmed_bytes += trim_heap()

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        try:
            if len(frames) != 2:
                raise ProtocolError(f"{len(frames)} frames, expected 2")
            submit = decode_submit(frames[1].buffer, self._max_submit)
        except ProtocolError as exc:
            self._refuse(f"refused a shard: {exc}")
            return
        try:
            self.submitted(submit, time.monotonic())
        except Exception as exc:  # a bug must cost this submit, not the collecting thread
            log.exception("shard coordinator: rank %d's shard of version %d failed",
                          submit.rank, submit.version)
            self._pending.pop(submit.version, None)
            self._refuse(f"rank {submit.rank}'s shard of version {submit.version} failed: "
                         f"{type(exc).__name__}: {exc}")

    def _refuse(self, why: str) -> None:
        self.refused_submits += 1
        self.last_error = why
        log.warning("shard coordinator: %s", why)

    def submitted(self, submit: ShardSubmit, now: float, *, nbytes: int | None = None) -> None:
        """One rank's shard of a version (``nbytes``: what it holds, by default
        ``decoded_bytes``); announces the version when it completes it."""
        if submit.world_size != self.world_size or not 0 <= submit.rank < self.world_size:
            self._refuse(f"rank {submit.rank} says world_size {submit.world_size}, the "
                         f"group has {self.world_size}")
            return
        if submit.version == self._announced:
            self._refuse(f"rank {submit.rank}'s version {submit.version} is already announced")
            return
        if nbytes is None:
            nbytes = decoded_bytes(submit)
        if nbytes > self.max_pending_bytes:
            self._refuse(f"rank {submit.rank}'s shard of version {submit.version} holds "
                         f"{nbytes} bytes decoded, more than max_pending_bytes "
                         f"{self.max_pending_bytes}")
            return
        earlier = self._pending.get(submit.version)
        if earlier is not None:
            self._freed(earlier.sizes.pop(submit.rank, 0))  # replaced below: its room is free
        if not self._make_room(submit.version, nbytes):
            self._refuse(f"rank {submit.rank}'s shard of version {submit.version} "
                         f"({nbytes} bytes decoded) does not fit beside the "
                         f"{self.pending_bytes} bytes its version's other shards hold "
                         f"(max_pending_bytes {self.max_pending_bytes})")
            return
        pending = self._pending.setdefault(submit.version, _Pending(now))
        pending.shards[submit.rank] = submit  # a restarted rank's later shard replaces it
        pending.sizes[submit.rank] = nbytes
        if len(pending.shards) == self.world_size:
            del self._pending[submit.version]
            self._freed(pending.nbytes)
            try:
                manifest = self._union(submit.version, pending.shards)
            except (ValueError, ProtocolError) as exc:
                self._drop(submit.version, f"shards do not fit together: {exc}")
                return
            if submit.version < self._announced:
                log.warning("shard coordinator: every rank's shard of version %d is in, below "
                            "the announced %d: that one is withdrawn (a forged or replayed "
                            "version, or the trainer went back)", submit.version, self._announced)
            self._announce(manifest)
            self._deltas.announced(manifest, [pending.shards[r] for r in range(self.world_size)])

    def _make_room(self, version: int, nbytes: int) -> bool:
        """Drop the oldest other pending versions until ``version``'s submit fits the bounds;
        False if it does not fit even then."""
        def over() -> bool:
            versions = len(self._pending) + (version not in self._pending)
            return (versions > MAX_PENDING_VERSIONS
                    or self.pending_bytes + nbytes > self.max_pending_bytes)

        while over():
            others = [v for v in self._pending if v != version]
            if not others:
                return False  # this version's own shards alone fill the bound
            oldest = min(others)
            self._drop(oldest, f"more than {MAX_PENDING_VERSIONS} versions or "
                               f"{self.max_pending_bytes} bytes of shards were pending; "
                               f"version {version} came in")
        return True

    def _expire(self, now: float) -> None:
        for version, pending in list(self._pending.items()):
            if version == self._announced:
                self._drop(version, f"version {self._announced} was announced first")
            elif now - pending.first_at > self.shard_timeout:
                missing = sorted(set(range(self.world_size)) - set(pending.shards))
                hint = "" if not self._front.curve else \
                    " (under CURVE a rank needs the trainer's curve_secret_key_file)"
                self._drop(version, f"ranks {missing} sent no shard within "
                                    f"{self.shard_timeout}s{hint}")

    def _drop(self, version: int, why: str) -> None:
        dropped = self._pending.pop(version, None)
        if dropped is not None:
            self._freed(dropped.nbytes)
        self.dropped_versions += 1
        self.last_error = f"version {version} dropped: {why}"
        log.warning("shard coordinator: %s", self.last_error)

    def _freed(self, nbytes: int) -> None:
        self._freed_since_trim += nbytes

    def _union(self, version: int, shards: dict[int, ShardSubmit]) -> wire.Manifest:
        chunk_size = shards[0].chunk_size
        tensors: list[wire.TensorEntry] = []
        checksums: list[int] = []
        sources: list[wire.ShardSource] = []
        offset = 0
        if sorted(shards) != list(range(self.world_size)):
            raise ValueError(f"shards of ranks {sorted(shards)}, expected 0..{self.world_size - 1}")
        serving: dict[str, int] = {}
        for rank in range(self.world_size):
            shard = shards[rank]
            other = serving.setdefault(shard.endpoint, rank)
            if other != rank:  # one DEALER per address: a subscriber would ask one range only
                raise ValueError(f"ranks {other} and {rank} both say they serve at "
                                 f"{shard.endpoint!r}: each rank needs an address of its own "
                                 "that subscribers reach")
            if shard.chunk_size != chunk_size:
                raise ValueError(f"rank {rank}'s chunk_size {shard.chunk_size} differs from "
                                 f"rank 0's {chunk_size}")
            sources.append(wire.ShardSource(rank=rank, endpoint=shard.endpoint,
                                            publisher_id=shard.publisher_id,
                                            first_chunk=offset // chunk_size,
                                            num_chunks=len(shard.checksums),
                                            nixl=shard.nixl, stream_port=shard.stream_port))
            tensors += [wire.TensorEntry(name=e.name, dtype=e.dtype, shape=e.shape,
                                         offset=e.offset + offset, nbytes=e.nbytes)
                        for e in shard.tensors if e.name != SHARD_PAD]
            checksums += shard.checksums
            offset += shard.total_bytes
        tensors.sort(key=lambda e: e.offset)
        delta, deltas_follow = self._deltas.chain_for(
            [shards[rank] for rank in range(self.world_size)], shard_layout(sources))
        # duplicate names across ranks, bounds: the manifest's own checks say which
        return wire.Manifest(publisher_id=self.publisher_id, started_at=self.started_at,
                             version=version, created_at=time.time(),
                             model_id=self.model_id or shards[0].model_id,
                             chunk_size=chunk_size, total_bytes=offset, tensors=tuple(tensors),
                             checksums=tuple(checksums), shards=tuple(sources), delta=delta,
                             deltas_follow=deltas_follow)

    def _announce(self, manifest: wire.Manifest) -> None:
        empty = torch.empty(64, dtype=torch.uint8)  # the bytes live on the ranks
        self._store.add(PublishedVersion(manifest=manifest, buffer=empty, view=memoryview(b"")))
        self._front.announce()
        with self._cond:
            self._announced = manifest.version
            self._cond.notify_all()
        for version in [v for v in self._pending if v < manifest.version]:
            self._drop(version, f"version {manifest.version} was announced first")
        log.info("shard coordinator: announced version %d (%d bytes from %d ranks)",
                 manifest.version, manifest.total_bytes, len(manifest.shards or ()))


def _property(frame: zmq.Frame, name: str | int) -> object:
    """A frame's metadata (``SRCFD``), or None if unset."""
    try:
        return frame.get(name)
    except zmq.ZMQError:
        return None
