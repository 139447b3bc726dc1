"""``PublisherOptions`` and ``ShardingOptions``: every trainer-side option, declared once.

Why one flat object: the trainer API takes flat keywords (``chunk_size=``,
``collective_timeout=``, ``peer_fanout=``, ...) and the ``publisher:`` YAML section
(``publisher_config.py``) gives the same names, so both are this ``OptionSet``
(``weightpub_wire/option_set.py``): each option is declared once with its bound,
default, unit and doc, and a bad value is the same ``ConfigError`` from either door.
The parts inside want their own typed options; they are derived here
(``collective_options``, ``server_limits``), never declared again.

``ShardedPublisher`` takes these plus ``ShardingOptions`` (where the ranks' shards go).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Self, TypedDict

from pydantic import Field, InstanceOf, field_validator, model_validator

from publisher.collective.collective_sender import CollectiveOptions, check_options
from publisher.deltas.delta_encoder import MAX_ANCHOR_EVERY
from publisher.serving.server import ServerLimits
from publisher.serving.tracker import TrackerLimits
from publisher.store.chunk_sizing import chunk_size_for
from weightpub_wire import protocol as wire
from weightpub_wire.collective_layout import MAX_BUCKET_BYTES
from weightpub_wire.config_file import check_endpoint
from weightpub_wire.option_set import MiB, OptionSet, unit
from weightpub_wire.peer_protocol import MAX_STRIPES

__all__ = ["PublisherKeywords", "PublisherOptions", "ShardedKeywords", "ShardingOptions"]

Backend = Literal["gloo", "nccl", "cuda_ipc"]


class PublisherOptions(OptionSet):
    """A publisher's options (``WeightPublisher``'s docstring says what each one does)."""

    option_owner = "WeightPublisher"

    model_id: str = Field("", description="the model's name, in every manifest")
    keep_versions: int | None = Field(
        None, ge=1, json_schema_extra=unit("versions"),
        description="snapshots held whole, each one version's bytes of host memory counted "
                    "in host_budget_bytes (None: 1, or 2 with delta_anchor_every > 1)")
    chunk_size: int | None = Field(
        None, ge=wire.MIN_CHUNK_SIZE, le=wire.MAX_CHUNK_SIZE,
        json_schema_extra=unit("bytes", yaml="chunk_mib", zero_is_none=True),
        description="bytes per chunk on the wire (None, YAML 0: chosen per version from its "
                    "size, a power of two from 256 KiB to 4 MiB giving at least 64 chunks)")
    heartbeat_interval: float = Field(
        1.0, gt=0, le=3600, json_schema_extra=unit("s"),
        description="heartbeats on PUB; subscribers call the publisher gone after 3 silent "
                    "intervals (at least 3 s)")
    first_version: int = Field(
        1, ge=1, le=(1 << 63) - 1, json_schema_extra=unit("version"),
        description="the first version number (e.g. the trainer step, to stay monotonic "
                    "across restarts)")
    delta_anchor_every: int = Field(
        1, ge=1, le=MAX_ANCHOR_EVERY, json_schema_extra=unit("versions"),
        description="> 1: versions also travel as deltas, a full version every N")
    curve_secret_key_file: str | None = Field(
        None, description="this publisher's zmq certificate: turns on CurveZMQ")
    curve_allowed_clients_dir: str | None = Field(
        None, description="only the client keys in this directory may connect (re-read)")
    insecure: bool = Field(
        False, description="allow a non-loopback bind without CURVE (trusted networks only)")
    peer_fanout: int | None = Field(
        None, ge=0, le=MAX_STRIPES, json_schema_extra=unit("stripes"),
        description="peer sharing: stripes per version, 0 off (None: the limits' tracker "
                    "fanout, 4)")
    peer_members_per_address: int | None = Field(
        None, ge=0, le=1 << 20, json_schema_extra=unit("members"),
        description="peer sharing without CURVE: plaintext members per connecting IP address "
                    "and slice plan (sybil bound; raise it for many replicas behind one NAT "
                    "address; 0: no bound; None: the limits' tracker bound, 4)")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="serve Prometheus /metrics here (0: any port)")
    metrics_host: str = Field("127.0.0.1", description="where /metrics listens")
    collective: Backend | None = Field(
        None, description="also send every version by a group broadcast to the subscribers "
                          "that ask (None: off)")
    collective_bucket_bytes: int = Field(
        64 * MiB, ge=1, le=MAX_BUCKET_BYTES,
        json_schema_extra=unit("bytes", yaml="collective_bucket_mib"),
        description="broadcast bucket, a multiple of the chunk size (of 4 MiB when chunks "
                    "are chosen per version)")
    collective_timeout: float = Field(
        30.0, gt=1.0, le=3600, json_schema_extra=unit("s"),
        description="bounds every rendezvous and collective wait (more than the 1 s "
                    "keepalive)")
    collective_port: int = Field(0, ge=0, le=65535,
                                 description="the rendezvous port (0: any free port)")
    collective_host: str | None = Field(
        None, description="where members reach the rendezvous (default: the endpoint's host)")
    collective_device: str | None = Field(
        None, description="nccl / cuda_ipc: the publisher's GPU, e.g. 'cuda:0'")
    nixl: bool = Field(
        False, description="also offer every version for one-sided NIXL reads: snapshot "
                           "buffers registered once (pip install weightpub[nixl]; off with "
                           "a WARNING where NIXL cannot run); ZeroMQ frames stay the fallback")
    nixl_cut_through: bool = Field(
        False, description="with nixl, a cut-through relay offers each version at once with "
                           "a per-chunk readiness map (registered words a reader READs before "
                           "a chunk), so downstream READs overlap the relay's upstream copy; "
                           "off: the offer follows once the copy is complete")
    stream: bool = Field(
        False, description="also serve chunks on a plain TCP port (announced as the "
                           "manifest's stream_port, same host as the endpoint): sent straight "
                           "from the snapshot with sendmsg; a subscriber with stream=True "
                           "presents a one-time token it got over CURVE; the bytes are NOT "
                           "encrypted; ZeroMQ frames stay the fallback")
    announce_early: bool = Field(
        False, description="announce each version as soon as its layout is known, before its "
                           "snapshot is copied and hashed; the checksums follow over the "
                           "ROUTER (CURVE) as each chunk's hash ends and subscribers stage "
                           "nothing before every one matched. Subscribers that predate it "
                           "refuse the early manifest (naming its checksum_algorithm) and "
                           "take the complete one, announced again once hashed; publish() "
                           "may take longer, the serving running beside the copy. Not with "
                           "deltas, collective or nixl")
    host_budget_bytes: int | None = Field(
        None, ge=1, json_schema_extra=unit("bytes"),
        description="host memory for version snapshots (None: 3/4 of what is available at "
                    "start)")
    limits: InstanceOf[ServerLimits] | None = Field(
        None, json_schema_extra=unit("", python_only=True),
        description="the serving thread's bounds (ServerLimits); peer_fanout and "
                    "peer_members_per_address override its tracker's")

    @model_validator(mode="after")
    def _cross_checks(self) -> Self:
        if self.delta_anchor_every > 1 and self.keep_versions == 1:
            raise ValueError(
                f"keep_versions: 1 with delta_anchor_every {self.delta_anchor_every}: a delta "
                "is encoded against the previous version, kept whole beside the new one, so "
                "deltas need keep_versions >= 2 (one more snapshot of host memory, counted in "
                "host_budget_bytes; leave keep_versions unset for 2)")
        if self.announce_early:
            clash = [name for name, on in (
                ("delta_anchor_every", self.delta_anchor_every > 1),
                ("collective", self.collective is not None), ("nixl", self.nixl)) if on]
            if clash:
                raise ValueError(f"announce_early: not with {', '.join(clash)} (each needs "
                                 "the checksums in the manifest); turn one off")
        collective = self.collective_options
        if collective is not None:  # the collective_* options only shape a path that is on
            check_options(collective, self.chunk_size)
        return self

    @property
    def collective_options(self) -> CollectiveOptions | None:
        """The collective path's options (None: off)."""
        if self.collective is None:
            return None
        host = "0.0.0.0" if self.collective_host == "*" else self.collective_host
        return CollectiveOptions(backend=self.collective, host=host, port=self.collective_port,
                                 bucket_bytes=self.collective_bucket_bytes,
                                 timeout=self.collective_timeout,
                                 device=self.collective_device)

    @property
    def server_limits(self) -> ServerLimits:
        """The serving thread's bounds, its tracker's ``peer_fanout`` and
        ``peer_members_per_address``."""
        limits = self.limits or ServerLimits()
        if self.peer_fanout is None and self.peer_members_per_address is None:
            return limits
        return dataclasses.replace(limits, tracker=self.tracker_limits(limits.tracker))

    def tracker_limits(self, base: TrackerLimits | None = None) -> TrackerLimits:
        """The peer tracker's bounds: ``base`` (default: the limits') with the peer_*
        options that are set."""
        tracker = base or (self.limits or ServerLimits()).tracker
        if self.peer_fanout is not None:
            tracker = dataclasses.replace(tracker, fanout=self.peer_fanout)
        if self.peer_members_per_address is not None:
            tracker = dataclasses.replace(
                tracker, max_members_per_address=self.peer_members_per_address)
        return tracker

    def chunk_size_for(self, total_bytes: int) -> int:
        """The chunk size of a version of ``total_bytes``: ``chunk_size``, or adaptive."""
        return chunk_size_for(self.chunk_size, total_bytes)

    @property
    def versions_kept(self) -> int:
        """``keep_versions``, or its default: 1 (one snapshot, overwritten by the next
        version), 2 with deltas (their base stays whole)."""
        if self.keep_versions is not None:
            return self.keep_versions
        return 2 if self.delta_anchor_every > 1 else 1


class ShardingOptions(OptionSet):
    """A sharded trainer rank's own options (``ShardedPublisher``; YAML ``sharding:``)."""

    option_owner = "ShardedPublisher"

    coordinator: str = Field(
        description="where the ranks send their shards: rank 0 binds it, the others dial it")
    announce_endpoint: str | None = Field(
        None, description="what replicas dial (rank 0 only: its coordinator serves it)")
    shard_timeout: float = Field(
        30.0, gt=0, le=3600, json_schema_extra=unit("s"),
        description="a version whose shards are not all in this long after its first is "
                    "dropped")
    advertise: str | None = Field(
        None, description="where replicas reach this rank's shard (default: the endpoint as "
                          "bound, a wildcard host replaced by this host's name)")

    _endpoints = field_validator("coordinator")(check_endpoint)

    @field_validator("announce_endpoint", "advertise")
    @classmethod
    def _optional_endpoint(cls, value: str | None) -> str | None:
        return None if value is None else check_endpoint(value)


class PublisherKeywords(TypedDict, total=False):
    """``WeightPublisher``'s option keywords, for type checkers; a test holds it equal to
    ``PublisherOptions``' declaration."""

    model_id: str
    keep_versions: int | None
    chunk_size: int | None
    heartbeat_interval: float
    first_version: int
    delta_anchor_every: int
    curve_secret_key_file: str | None
    curve_allowed_clients_dir: str | None
    insecure: bool
    peer_fanout: int | None
    peer_members_per_address: int | None
    metrics_port: int | None
    metrics_host: str
    collective: Backend | None
    collective_bucket_bytes: int
    collective_timeout: float
    collective_port: int
    collective_host: str | None
    collective_device: str | None
    nixl: bool
    nixl_cut_through: bool
    stream: bool
    announce_early: bool
    host_budget_bytes: int | None
    limits: ServerLimits | None


class ShardedKeywords(PublisherKeywords, total=False):
    """``ShardedPublisher``'s option keywords: the publisher's and ``ShardingOptions``'."""

    coordinator: str
    announce_endpoint: str | None
    shard_timeout: float
    advertise: str | None
