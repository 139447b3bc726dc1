"""The request/reply messages of a publisher's ROUTER (also spoken between peers).

``latest`` (snapshot for late joiners), ``fetch`` / ``error`` (the data path,
credit-bounded; the ``chunk`` reply itself is binary, ``chunk_frame.py``),
``report`` / ``status`` (the back-channel and what ``weightpub status`` prints),
``coll_poll`` / ``coll_rep`` (joining a collective group). Split from
``weightpub_wire.protocol``, which keeps the message union and the codec.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from weightpub_wire.collective_backends import collective_backend
from weightpub_wire.collective_layout import (
    DATA_PATHS,
    MAX_FALLBACK_CAUSES,
    MAX_MEMBERS,
    CollectiveAnnounce,
    GroupStatus,
    IpcHandle,
    Label,
)
from weightpub_wire.errors import ConfigError
from weightpub_wire.manifest import Manifest
from weightpub_wire.message_base import (
    MAX_CHUNKS,
    MAX_CHUNKS_PER_FETCH,
    MAX_REPORTED_RANKS,
    U63,
    U64,
    DataPath,
    ErrorText,
    Interval,
    Name,
    Rank,
    ReceivedFraction,
    Seconds,
    Text,
    Version,
    _FromPublisher,
    _Message,
)
from weightpub_wire.nixl_link import NIXL_PATHS
from weightpub_wire.peer_figures import PeerNixlFigures, PeerStreamFigures
from weightpub_wire.stream_link import STREAM_PATHS

__all__ = [
    "CollectivePoll",
    "CollectiveReply",
    "ErrorReply",
    "FetchRequest",
    "HostMemory",
    "LatestReply",
    "LatestRequest",
    "PendingShards",
    "Report",
    "NixlHolding",
    "ShardGroup",
    "StreamPort",
    "StatusReply",
    "StatusRequest",
]


class LatestRequest(_Message, tag="latest", kw_only=True, frozen=True):
    """Clone-pattern snapshot request: 'what is your newest version, and where is your PUB?'"""

    req: U63


class LatestReply(_FromPublisher, tag="latest_rep", kw_only=True, frozen=True):
    """The newest manifest (or none yet) and the PUB address to subscribe to."""

    req: U63
    pub_endpoint: Text
    heartbeat_interval: Interval
    manifest: Manifest | None = None
    collective: CollectiveAnnounce | None = None


class FetchRequest(_Message, tag="fetch", kw_only=True, frozen=True):
    """Ask for some chunks of one version; the count is the subscriber's credit.

    ``base`` 0 asks for the version's bytes; otherwise for each chunk as a delta
    against that version (the previous link of ``Manifest.delta.chain``).
    ``plan`` (with ``base``, issue 30): a sliced subscriber's registered slice plan; a
    chunk whose delta payload is not shorter than the plan's bytes of it comes as those
    bytes, gathered as a ``slice_fetch`` reply carries them (the reply's size tells the
    two apart: a delta payload sent is shorter). Empty, or a plan not held: deltas only.
    """

    req: U63
    publisher_id: Name
    version: Version
    chunks: Annotated[tuple[Annotated[int, Meta(ge=0, le=MAX_CHUNKS)], ...],
                      Meta(max_length=MAX_CHUNKS_PER_FETCH)]
    base: U63 = 0
    plan: Annotated[str, Meta(max_length=32, pattern="^([0-9a-f]{32})?$")] = ""


ERROR_CODES = ("version_unavailable", "bad_request", "unknown_plan")  # unknown_plan: slices


class ErrorReply(_Message, tag="error", kw_only=True, frozen=True):
    """A request could not be served; ``code`` is machine-readable (``ERROR_CODES``)."""

    req: U63
    code: Annotated[str, Meta(max_length=64)]
    message: ErrorText
    version: U63 = 0

    def __post_init__(self) -> None:
        _Message.__post_init__(self)
        if self.code not in ERROR_CODES:
            raise ValueError(f"code: unknown code {self.code!r}")


class Report(_Message, tag="report", kw_only=True, frozen=True):
    """Back-channel: a subscriber tells the publisher what it staged and applied.

    ``publisher_id`` names the instance whose versions these are: a publisher
    counts a report towards ``wait_for_subscribers`` only for its own instance
    and versions it announced. ``client_key`` is filled in by the publisher (the
    CURVE key the report arrived with), never trusted from the wire.
    ``ranks``: the replica ranks this subscriber stages for (all ranks of a replica
    on one node share one subscription); empty for a subscriber outside vLLM.
    ``applied_version`` is then the version every one of those ranks runs.
    ``received_fraction``: the payload bytes this subscriber received for its applied
    version, as a share of that version (a rank fetching its slices: about 1/TP; node
    staging: about 1.0; a delta: less); None when unknown (an older subscriber, nothing
    applied yet, a version that came by a path it does not count).
    ``peer_nixl``: its peers-over-NIXL counters (``PeerNixlFigures``); None without
    them (an older subscriber, no peer sharing, or the ``nixl`` option not True). An
    older publisher ignores the field (msgspec drops unknown fields).
    ``peer_stream``: its peers-over-the-stream counters (``PeerStreamFigures``); None
    without them (an older subscriber, no peer sharing, or the ``stream`` option off);
    the same bounds and compatibility.
    """

    subscriber_id: Name
    staged_version: U63
    applied_version: U63
    last_error: ErrorText | None = None
    publisher_id: Name | None = None
    client_key: Annotated[str, Meta(max_length=64)] | None = None
    ranks: Annotated[tuple[Rank, ...], Meta(max_length=MAX_REPORTED_RANKS)] = ()
    data_path: DataPath = ""  # how the applied version's bytes reached the node
    received_fraction: ReceivedFraction | None = None  # issue 30: of the applied version
    peer_nixl: PeerNixlFigures | None = None  # issue 31: peers over NIXL, since it started
    peer_stream: PeerStreamFigures | None = None  # peers over the stream, since it started

    def __post_init__(self) -> None:
        _Message.__post_init__(self)
        if self.data_path not in ("", "slices", *DATA_PATHS, *NIXL_PATHS,
                                  *STREAM_PATHS):  # slices: issue 30
            raise ValueError(f"data_path: unknown data path {self.data_path!r}")


class StatusRequest(_Message, tag="status", kw_only=True, frozen=True):
    req: U63


class HostMemory(msgspec.Struct, frozen=True, kw_only=True):
    """A publisher's host memory against its budget (``host_budget_bytes``, 0: none)."""

    budget_bytes: U64 = 0
    held_bytes: U64 = 0  # snapshot buffers: about ``keep_versions`` versions
    keep_versions: U63 = 0
    send_queued_bytes: U64 = 0  # reply scratch: frames ZeroMQ holds, idle send buffers
    #: the last version a failed publish withdrew (0: none) and why (its buffer was the
    #: one the failed copy overwrote: ``keep_versions``)
    withdrawn_version: U63 = 0
    withdrawn_reason: ErrorText = ""
    #: snapshot buffers registered for one-sided NIXL reads (``nixl=True``), and why that
    #: path is off when it was asked for ("" while on or never asked)
    nixl_registered_bytes: U64 = 0
    nixl_off_reason: ErrorText = ""


class NixlHolding(msgspec.Struct, frozen=True, kw_only=True):
    """A publisher's or relay's NIXL offers (``nixl=True``, issue 31): counters since start."""

    on: bool = False  # offering now (False: off, the reason in ``HostMemory.nixl_off_reason``)
    registrations: U63 = 0  # snapshot buffers registered (each pool buffer once)
    registered_bytes: U64 = 0
    offers: U63 = 0  # manifests that carried an offer
    #: versions announced without an offer, by cause (off, unregistered, copy)
    unoffered: Annotated[tuple[tuple[Annotated[str, Meta(max_length=32)], U63], ...],
                         Meta(max_length=16)] = ()
    #: buffers whose claims words or readiness map UCX refused to register, by kind
    #: (claims, ready): their offers went without them (once per buffer)
    words_refused: Annotated[tuple[tuple[Annotated[str, Meta(max_length=32)], U63], ...],
                             Meta(max_length=16)] = ()


class StreamPort(msgspec.Struct, frozen=True, kw_only=True):
    """A publisher's plain-TCP stream port (``stream=True``, issue 29): counters since start."""

    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    connections: U63 = 0  # open now
    accepted: U63 = 0  # connections that presented a good token
    refused: U63 = 0  # a bad, used or expired token
    turned_away: U63 = 0  # past ``max_connections``
    cut: U63 = 0  # stalled, bad requests, a revoked key
    bytes_sent: U64 = 0  # chunk bytes sent on the port
    chunks_sent: U64 = 0
    tokens_issued: U63 = 0  # handed out over the ROUTER
    tokens_denied: U63 = 0  # asked for while too many were outstanding
    slice_bytes_sent: U64 = 0  # of ``bytes_sent``: a sliced subscriber's planned bytes
    slice_bytes_gathered: U64 = 0  # of those: short strided rows copied before sending


class PendingShards(msgspec.Struct, frozen=True):
    """A sharded version still collecting: the ranks whose shard is in, for how long."""

    version: Version
    ranks_in: Annotated[tuple[Rank, ...], Meta(max_length=1 << 16)]  # MAX_SHARDS
    waiting_seconds: Seconds


class ShardGroup(msgspec.Struct, frozen=True, kw_only=True):
    """A shard coordinator's group: why a sharded version is (not yet) announced."""

    world_size: U63
    pending: Annotated[tuple[PendingShards, ...], Meta(max_length=16)] = ()
    dropped_versions: U63 = 0
    refused_submits: U63 = 0
    last_error: ErrorText = ""


class StatusReply(_FromPublisher, tag="status_rep", kw_only=True, frozen=True):
    """The publisher's view: versions held, the last report of each subscriber, and the
    chunk payload bytes sent so far (full versions and deltas: what deltas save); its host
    memory; a shard coordinator's group (``shard_group``)."""

    req: U63
    latest_version: U63
    versions: Annotated[tuple[U63, ...], Meta(max_length=4096)]
    subscribers: Annotated[tuple[Report, ...], Meta(max_length=100_000)]
    bytes_sent_full: U64 = 0
    bytes_sent_delta: U64 = 0
    collective: GroupStatus | None = None  # the collective path's group, if announced
    memory: HostMemory | None = None
    shard_group: ShardGroup | None = None
    #: slice fetches (issue 30): planned bytes sent, plans registered, bytes those hold
    bytes_sent_slices: U64 = 0
    slice_plans: U63 = 0
    slice_held_bytes: U64 = 0
    #: the plain-TCP stream port (``stream=True``), None when off
    stream: StreamPort | None = None
    #: the NIXL offers (``nixl=True``), None when off
    nixl: NixlHolding | None = None
    #: the fleet's peers-over-NIXL and peers-over-the-stream counters, each summed over
    #: every row seen recently (not only the ``subscribers`` carried): ``peer_total``;
    #: None when no report has them
    peer_nixl: PeerNixlFigures | None = None
    peer_stream: PeerStreamFigures | None = None

POLL_STATES = ("free", "joining", "member", "leaving")
REPLY_STATES = ("off", "idle", "waiting", "forming", "active", "refused")


class CollectivePoll(_Message, tag="coll_poll", kw_only=True, frozen=True):
    """A subscriber that may use the collective path: where it stands, what it wants.

    ``state``: ``free`` (wants a group, its receiver is idle; ``epoch`` is the last
    one it was in), ``joining``/``member`` (of ``epoch``), ``leaving`` (closing).
    Sent every few hundred ms while the path is announced; a member that stops
    polling is dropped from the next group. ``ipc_done``: the newest version
    a ``cuda_ipc`` member has finished copying (the publisher may free older ones).
    """

    req: U63
    subscriber_id: Name
    state: Annotated[str, Meta(max_length=16)]
    epoch: U63 = 0
    backend: Annotated[str, Meta(max_length=16)]
    device_uuid: Annotated[str, Meta(max_length=64)] = ""
    ipc_done: U63 = 0
    #: (cause, count): versions this node fetched over ZeroMQ instead (``FALLBACK_CAUSES``)
    fallbacks: Annotated[tuple[tuple[Label, U63], ...],
                         Meta(max_length=MAX_FALLBACK_CAUSES)] = ()

    def __post_init__(self) -> None:
        _Message.__post_init__(self)
        if self.state not in POLL_STATES:
            raise ValueError(f"state: unknown state {self.state!r}")
        try:
            collective_backend(self.backend)
        except ConfigError as exc:
            raise ValueError(f"backend: {exc}") from None


class CollectiveReply(_FromPublisher, tag="coll_rep", kw_only=True, frozen=True):
    """The publisher's answer to a poll: the group epoch and this subscriber's rank in it.

    ``rank`` 0 means "not in this epoch's group" (the publisher itself is rank 0);
    ``state`` says why (``waiting`` for the next re-form, ``refused`` with ``reason``,
    ``off`` when no collective path is served). ``ipc``: the newest version's
    device buffer, for a ``cuda_ipc`` subscriber.
    """

    req: U63
    state: Annotated[str, Meta(max_length=16)]
    epoch: U63 = 0
    rank: Annotated[int, Meta(ge=0, le=MAX_MEMBERS)] = 0
    world_size: Annotated[int, Meta(ge=0, le=MAX_MEMBERS + 1)] = 0
    reason: Text = ""
    ipc: IpcHandle | None = None

    def __post_init__(self) -> None:
        _Message.__post_init__(self)
        if self.state not in REPLY_STATES:
            raise ValueError(f"state: unknown state {self.state!r}")
        if self.rank and self.rank >= self.world_size:
            raise ValueError(f"rank: {self.rank} is not below world_size {self.world_size}")
