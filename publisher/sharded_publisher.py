"""``ShardedPublisher``: every trainer rank publishes its own shard; one version is the union.

Each rank runs an ordinary ``WeightPublisher`` for the tensors it holds (its
own endpoint, snapshot, credit, checksums), laid out from offset 0 and padded
with zeros to a whole number of chunks (``SHARD_PAD``, left out of the union),
so the shard is one chunk-aligned region of the union and its chunk ``i`` is
the union's chunk ``first_chunk + i``. Once a shard is hashed the rank tells the
coordinator (``publisher.sharding.shard_coordinator``) its layout and checksums over
ZeroMQ; the coordinator announces the version when every rank's shard is in.
Subscribers fetch each chunk from the rank that holds it
(``subscriber_ext/transport/client/shard_links.py``). No rank holds more than
its shard (plus the snapshot copy ``WeightPublisher`` always makes).

Split: tensors are whole within a rank. For a plain or pipeline split each rank
passes its own named tensors (names must not repeat across ranks). FSDP/FSDP2
(DTensors, or a vLLM ``WeightSource``): every rank passes the same whole model,
at the same time; each walks the layer groups in the same order (each gather is
a collective all ranks join) and keeps only the tensors it owns
(``streamed_plan.plan_shard``: largest first to the least loaded rank, the
same split on every rank from global names, shapes and dtypes). FSDP2's
``Shard(0)`` DTensors (1-D mesh of these ranks) and ``Replicate`` ones go to
their owner only, so a rank receives about its shard per version and holds its
shard plus the tensor being gathered; other DTensors (HSDP's 2-D meshes, TP,
``Shard(1)``) and a ``WeightSource`` are gathered whole on every rank and
dropped at once where not owned (the whole model crosses every rank's link).

Deltas (``delta_anchor_every`` > 1, best the same on every rank: the union offers
only what all of them serve; ``keep_versions`` >= 2, its default then): each
rank encodes its own shard against its previous one (its own ``DeltaPublisher``)
and serves those deltas; its submit says which bases it serves them from, and
the coordinator offers only the bases every rank serves with the shard layout
unchanged (``publisher.sharding.shard_deltas``). A rank that restarted has none: the
next version goes out in full.

NIXL (``nixl=True`` on a rank): the rank's own ``WeightPublisher`` registers its
snapshot buffers with the rank's own NIXL agent (once, reused version after
version, released on close: ``publisher.store.nixl_export``) and its manifest carries
an offer; the submit passes that offer to the coordinator, which puts it in the
rank's ``ShardSource.nixl``. A subscriber READs each rank's range from that rank's
agent, and a rank without an offer (or whose READs fail) serves its range as
frames, counted per rank (``subscriber_ext/transport/client/nixl_source.py``). The
offer names registered memory: it travels on the collect socket (CURVE, the
trainer's key) and the coordinator's PUB/ROUTER (CURVE), never elsewhere.

Stream (``stream=True`` on a rank): the rank's own ``WeightPublisher`` serves its
shard's chunks on a plain TCP port of its own (``publisher.serving.stream_server``),
announced in the rank's ``ShardSource.stream_port``; a subscriber with
``stream=True`` asks that rank for a one-time token over its DEALER to the rank and
receives the range there, falling back to frames per rank
(``subscriber_ext/transport/client/shard_links.py``).

Peers: the coordinator runs the tracker (rank 0's ``peer_fanout``); a
``peer_share=True`` subscriber asks its peers for the stripes the plan gives
them, in the union's chunk numbering, and the ranks for the rest, falling back
to the ranks for whatever a peer fails to deliver.

Security: one trainer key pair. With ``curve_secret_key_file`` (the same file
on every rank; ``weightpub keys create trainer``) every rank's shard ROUTER and
the coordinator's ROUTER/PUB are CURVE servers with that key, so a subscriber's
one ``curve_server_key_file`` (the trainer's public key) authenticates the
coordinator and every rank, and the manifest needs no per-rank keys. The ranks
submit as CURVE clients with that same key pair, and the coordinator's collect
socket admits only it: a rank is whoever holds the trainer's secret key, never
an allow-listed subscriber. Why one pair rather than a key per rank: every
rank already decides the bytes of its shard, so a rank's key is worth as much
as the trainer's; one pair is one file to deploy and nothing to list or copy
into manifests. ``curve_allowed_clients_dir`` (each rank's own, usually the same
directory on every host) admits subscribers to the coordinator and to that
rank's shard: a subscriber needs every rank's admission (a refused rank is
named in its ``last_error``). Without CURVE a non-loopback bind needs
``insecure=True``, as for any publisher.

Versions: pass ``version=`` (e.g. the trainer step) on every rank, the same
number for the same weights; without it each rank counts from ``first_version``,
which only agrees while no rank restarts.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from typing import Any, Unpack

import torch
import zmq

from publisher.publisher_config import PublisherConfig, load_publisher_config
from publisher.publisher_options import PublisherOptions, ShardedKeywords, ShardingOptions
from publisher.sharding.shard_coordinator import SHARD_PAD, ShardCoordinator
from publisher.sources.streamed_plan import PublishSource, StreamedPairs, plan_shard
from publisher.store.snapshot import named_tensors, plan_layout
from publisher.weight_publisher import WeightPublisher
from weightpub_wire.endpoints import is_wildcard, parse_endpoint
from weightpub_wire.errors import ConfigError, WeightPubError
from weightpub_wire.security import CurveIdentity, load_key_file
from weightpub_wire.shard_submit import ShardSubmit, encode_submit
from weightpub_wire.sockets import configure_socket, connect

__all__ = ["DEFAULT_SHARD_CHUNK", "ShardedPublisher"]

log = logging.getLogger("weightpub.publisher")

DEFAULT_SHARD_CHUNK = 1 << 20  # every rank's chunk size must agree: no adaptive sizing


class ShardedPublisher:
    """One trainer rank's publisher of its shard.

    ``endpoint``: where this rank serves its shard's chunks (port 0: any free port).
    ``coordinator``: the address every rank submits its shards to (rank 0's
    ``coordinator`` binds it). On rank 0, ``announce_endpoint`` is what subscribers
    dial; it starts the ``ShardCoordinator`` there. ``shard_timeout``: a version whose
    shards are not all in that long after its first is dropped. ``advertise``: the
    address subscribers reach this rank's shard at (default: ``endpoint`` as bound, its
    host replaced by this host's name when it is a wildcard); these four are
    ``ShardingOptions`` (``sharding=`` passes them whole). The other keywords are
    ``WeightPublisher``'s (``PublisherOptions``, or ``options=`` whole), for this rank's
    shard; ``chunk_size`` must be the same on every rank (default 1 MiB);
    ``delta_anchor_every`` best too (deltas of this rank's shard, see the module
    docstring). ``peer_fanout`` (default 4; 0: off) is rank 0's, for the coordinator's
    tracker (other ranks ignore it): subscribers started with ``peer_share=True`` fetch
    from each other the stripes the plan gives them and the rest from the ranks, so each
    chunk leaves its rank about once.
    ``curve_secret_key_file`` / ``curve_allowed_clients_dir``: the trainer's key pair (the
    same on every rank) and this rank's subscriber allow-list, see the module docstring.
    """

    def __init__(self, endpoint: str, *, rank: int, world_size: int,
                 context: zmq.Context | None = None, options: PublisherOptions | None = None,
                 sharding: ShardingOptions | None = None,
                 **keywords: Unpack[ShardedKeywords]) -> None:
        given: dict[str, Any] = dict(keywords)
        own = {name: given.pop(name) for name in list(given)
               if name in ShardingOptions.model_fields}
        if sharding is None:
            sharding = ShardingOptions.from_keywords(**own)
        elif own:
            raise ConfigError(f"ShardedPublisher: {', '.join(sorted(own))} given with "
                              "sharding= (put them in the options)")
        if options is None:
            options = PublisherOptions.from_keywords(**given)
        elif given:
            raise ConfigError(f"ShardedPublisher: {', '.join(sorted(given))} given with "
                              "options= (put them in the options)")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank: {rank} is not in [0, world_size {world_size})")
        announce_endpoint, coordinator = sharding.announce_endpoint, sharding.coordinator
        if (rank == 0) != (announce_endpoint is not None):
            raise ConfigError("announce_endpoint: rank 0 (only) announces the union; give it "
                              "there" if rank == 0 else
                              f"announce_endpoint: only rank 0 announces (this is rank {rank})")
        if options.collective is not None:
            raise ConfigError("collective: not supported with sharded publishing yet (the "
                              "union is served by the ranks' own ROUTERs)")
        if options.announce_early:
            raise ConfigError("announce_early: not supported with sharded publishing (the "
                              "coordinator announces the union once every rank's checksums "
                              "are in)")
        # every rank's chunk size must agree: adaptive sizing would differ between shards;
        # subscribers say hello to the coordinator (rank 0's peer_fanout), not to a rank
        shard_options = options.replace(chunk_size=options.chunk_size or DEFAULT_SHARD_CHUNK,
                                        peer_fanout=0)
        self.rank = rank
        self.world_size = world_size
        self.options = options
        self.sharding = sharding
        self.chunk_size = shard_options.chunk_size or DEFAULT_SHARD_CHUNK
        self.coordinator: ShardCoordinator | None = None
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._closed = False
        self._failed: list[str] = []
        self._shard: WeightPublisher | None = None
        try:
            if announce_endpoint is not None:
                self.coordinator = ShardCoordinator(
                    announce_endpoint, coordinator, world_size,
                    shard_timeout=sharding.shard_timeout, insecure=options.insecure,
                    model_id=options.model_id, peer_fanout=options.peer_fanout,
                    peer_members_per_address=options.peer_members_per_address,
                    curve_secret_key_file=options.curve_secret_key_file,
                    curve_allowed_clients_dir=options.curve_allowed_clients_dir,
                    heartbeat_interval=options.heartbeat_interval)
                # (its own context: one ZAP handler per context, and the shard's runs here)
                coordinator = _dialable(self.coordinator.collect_endpoint)
            self._shard = WeightPublisher(endpoint, context=self._ctx, options=shard_options)
            self.endpoint = sharding.advertise or _dialable(self._shard.endpoint)
            self._dealer = self._ctx.socket(zmq.DEALER)
            configure_socket(self._dealer, heartbeat_interval=1.0)
            secret_key_file = options.curve_secret_key_file
            if secret_key_file is not None:  # a rank is a holder of the trainer's key pair
                public, secret = load_key_file(secret_key_file, need_secret=True)
                CurveIdentity(public, public, secret or b"").client_hook()(self._dealer,
                                                                           server=False)
            self._dealer.setsockopt(zmq.SNDHWM, 64)
            connect(self._dealer, coordinator)
        except BaseException:
            self._release()
            raise
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._thread = threading.Thread(target=self._submit_loop, daemon=True,
                                        name="weightpub-shard-submit")
        self._thread.start()

    @classmethod
    def from_config(cls, config: str | os.PathLike[str] | PublisherConfig, *,
                    rank: int | None = None, world_size: int | None = None,
                    ) -> ShardedPublisher:
        """This rank's publisher from a ``publisher:`` YAML file (or ``PublisherConfig``)
        with a ``sharding:`` section, the same file on every rank. ``rank`` and
        ``world_size`` default to ``RANK`` and ``WORLD_SIZE`` (torchrun sets them)."""
        if not isinstance(config, PublisherConfig):
            config = load_publisher_config(config)
        sharding = config.sharding
        if sharding is None:
            raise ConfigError("publisher.sharding: missing (where the ranks' shards go and "
                              "what replicas dial); without it use WeightPublisher.from_config")
        rank = _from_env("RANK") if rank is None else rank
        world_size = _from_env("WORLD_SIZE") if world_size is None else world_size
        return cls(config.endpoint, rank=rank, world_size=world_size,
                   options=config.options(), sharding=sharding.options(rank))

    @property
    def latest_version(self) -> int:
        """The newest version of this rank's shard announced (hashed)."""
        return self.shard.latest_version

    @property
    def shard(self) -> WeightPublisher:
        """This rank's own publisher (its data stats, its manifest)."""
        assert self._shard is not None
        return self._shard

    def publish(self, weights: PublishSource, *, version: int | None = None) -> int:
        """Snapshot this rank's tensors as its shard of ``version``; returns the number.

        ``weights``: this rank's own tensors, or (DTensors, a ``WeightSource``) the
        whole sharded model, passed on every rank at once: see the module docstring.
        Returns once the caller may modify the tensors; the shard is submitted to the
        coordinator once hashed (in the background).
        """
        planned = plan_shard(weights, self.rank, self.world_size)
        pairs = planned if isinstance(planned, StreamedPairs) else named_tensors(planned)
        try:
            if self._closed:
                raise WeightPubError("sharded publisher is closed")
            if any(name == SHARD_PAD for name, _ in pairs):
                raise ConfigError(f"weights: {SHARD_PAD!r} is a reserved name")
            _, total = plan_layout(pairs)
            pad = -total % self.chunk_size
            if pad or not total:
                pad = pad or self.chunk_size  # an empty shard still fills one chunk
                padding = (SHARD_PAD, torch.zeros(pad, dtype=torch.uint8))
                pairs = pairs.followed_by([padding]) if isinstance(pairs, StreamedPairs) \
                    else [*pairs, padding]
            number = self.shard.publish(pairs, version=version)
        except BaseException:
            if isinstance(pairs, StreamedPairs) and not pairs.started:
                pairs.drain()  # the other ranks are in these gathers: join them, then raise
            raise
        self._queue.put(number)
        return number

    def wait_submitted(self, version: int, timeout: float = 30.0) -> None:
        """Block until this rank's shard of ``version`` is hashed (then it is sent)."""
        self.shard.wait_announced(version, timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self.shard.close()  # announces what it holds queued; a submit waiting on it ends
        self._thread.join(timeout=15)
        self._dealer.close(linger=0)
        self._release()

    def _release(self) -> None:
        if self._shard is not None:
            self._shard.close()
        if self.coordinator is not None:
            self.coordinator.close()
        if self._own_context:
            self._ctx.term()

    def __enter__(self) -> ShardedPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the submitting thread -----------------------------------------------------------------
    def _submit_loop(self) -> None:
        while (number := self._queue.get()) is not None:
            try:
                self.shard.wait_announced(number, timeout=600.0)
                manifest = self.shard.manifest(number)
            except WeightPubError as exc:  # overtaken or failed: the union drops it
                log.warning("rank %d: shard of version %d not submitted: %s",
                            self.rank, number, exc)
                continue
            submit = ShardSubmit(rank=self.rank, world_size=self.world_size, version=number,
                                 publisher_id=manifest.publisher_id, endpoint=self.endpoint,
                                 chunk_size=manifest.chunk_size,
                                 total_bytes=manifest.total_bytes, tensors=manifest.tensors,
                                 checksums=manifest.checksums, model_id=manifest.model_id,
                                 delta=manifest.delta, deltas_follow=manifest.deltas_follow,
                                 nixl=manifest.nixl, stream_port=manifest.stream_port)
            try:
                self._dealer.send(encode_submit(submit), flags=zmq.NOBLOCK)
            except zmq.Again:
                log.warning("rank %d: coordinator unreachable, shard of version %d dropped",
                            self.rank, number)


def _from_env(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.isdigit():
        raise ConfigError(f"{name.lower()}: not given and ${name} is {value!r} (torchrun sets "
                          "it; or pass it)")
    return int(value)


def _dialable(bound: str) -> str:
    """A bound address as others dial it: a wildcard host becomes this host's name."""
    endpoint = parse_endpoint(bound)
    if is_wildcard(endpoint):
        return f"tcp://{socket.gethostname()}:{endpoint.port}"
    return bound
