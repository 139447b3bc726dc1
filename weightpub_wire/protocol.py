"""The weightpub wire protocol: what the bytes mean (not how they move).

Every control message is ONE msgpack frame holding a map with ``"t"`` (the
message type) and ``"p"`` (the protocol version). Bulk data is raw bytes.

Sockets and frames::

    PUB    -> SUB     [ {t: "manifest" | "heartbeat"} ]
    DEALER -> ROUTER  [ {t: "latest" | "fetch" | "status" | "report" | "coll_poll"
                         | "peer_hello"} ]
    ROUTER -> DEALER  [ {t: "latest_rep" | "status_rep" | "error" | "coll_rep"
                         | "peer_plan"} ]
                    | [ {t: "chunk", req, version, chunk, size}, <size raw bytes> ]

A publisher with a collective data path announces it in manifests and ``latest``
replies (``collective``); ``coll_poll`` / ``coll_rep`` are how a subscriber asks to
join its group and learns its rank (``weightpub_wire.collective``).

A fetch that names a ``base`` gets each chunk as a delta payload instead
(``weightpub_wire.delta_codec``); manifests of such versions carry ``delta``.
Peer sharing (``peer_hello`` / ``peer_plan``) is in ``weightpub_wire.peer_protocol``;
peers serve each other with the same ``fetch`` / ``chunk`` / ``error`` frames.

A version's tensors are laid out back to back (each offset aligned to
``TENSOR_ALIGN``) in one flat byte buffer of ``total_bytes``; the buffer is
cut into ``ceil(total_bytes / chunk_size)`` chunks, each with an xxh3-64
checksum. A subscriber can therefore preallocate the whole version from the
manifest and receive every chunk straight into place.

Each message is a ``msgspec.Struct``: decoding validates types, ranges and
lengths while it reads (an oversized list is refused at its header, before any
element is built), then ``__post_init__`` checks what spans fields. Every
violation raises ``ProtocolError`` naming the field
(``manifest.tensors[3].nbytes: ...``). Limits that depend on the receiver
(memory, its own caps) are checked by ``Manifest.check(limits)``. Never pickle.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from weightpub_wire.collective import (
    BACKENDS,
    DATA_PATHS,
    MAX_MEMBERS,
    CollectiveAnnounce,
    GroupStatus,
    IpcHandle,
)
from weightpub_wire.dtypes import DTYPE_BY_NAME, itemsize
from weightpub_wire.errors import ProtocolError

__all__ = [
    "CHECKSUM_ALGORITHM",
    "DEFAULT_LIMITS",
    "MAX_CHUNKS_IN_FLIGHT",
    "MAX_CHUNK_SIZE",
    "MAX_CONTROL_BYTES",
    "MIN_CHUNK_SIZE",
    "PROTOCOL_VERSION",
    "TENSOR_ALIGN",
    "ChunkHeader",
    "CollectiveAnnounce",
    "CollectivePoll",
    "CollectiveReply",
    "DeltaBase",
    "DeltaInfo",
    "ErrorReply",
    "FetchRequest",
    "GroupStatus",
    "Heartbeat",
    "IpcHandle",
    "LatestReply",
    "LatestRequest",
    "Limits",
    "Manifest",
    "Message",
    "Report",
    "StatusReply",
    "StatusRequest",
    "TensorEntry",
    "decode",
    "decode_as",
    "encode",
]

PROTOCOL_VERSION = 2
CHECKSUM_ALGORITHM = "xxh3_64"
TENSOR_ALIGN = 64
MAX_CONTROL_BYTES = 256 << 20
MAX_ERROR_CHARS = 4096

# -- field types: every bound is checked while decoding ----------------------------------------
U63 = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
U64 = Annotated[int, Meta(ge=0)]  # msgpack holds at most 2**64 - 1
Version = Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]
Seconds = Annotated[float, Meta(ge=0.0, le=1e12)]  # wall-clock timestamps; finite
Interval = Annotated[float, Meta(gt=0.0, le=3600.0)]
# names are printed in logs and status tables: no C0/C1 control characters (terminal escapes)
Name = Annotated[str, Meta(min_length=1, max_length=1024, pattern="^[^\x00-\x1f\x7f-\x9f]+$")]
Text = Annotated[str, Meta(max_length=1024)]
ErrorText = Annotated[str, Meta(max_length=MAX_ERROR_CHARS)]
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 1 << 30
ChunkSize = Annotated[int, Meta(ge=MIN_CHUNK_SIZE, le=MAX_CHUNK_SIZE)]
Shape = Annotated[tuple[Annotated[int, Meta(ge=0, le=1 << 50)], ...], Meta(max_length=16)]
MAX_ELEMENTS = 1 << 56  # even an empty tensor's other dims must not overflow int64 numel
MAX_TENSORS = 1_000_000
MAX_CHUNKS = 10_000_000
MAX_CHUNKS_PER_FETCH = 4096
MAX_DELTA_CHAIN = 64
MAX_CHUNKS_IN_FLIGHT = 1024  # a subscriber's credit, whatever its window (publishers rely on it)
MAX_REPORTED_RANKS = 1024  # ranks of one replica on one node that one subscriber serves
Rank = Annotated[int, Meta(ge=0, le=1 << 20)]
DataPath = Annotated[str, Meta(max_length=16)]


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def _pinned_default() -> int:
    return _physical_memory() // 4


@dataclass(frozen=True, slots=True)
class Limits:
    """Receiver-side bounds, checked before anything a peer asked for is allocated.

    By default a version may not exceed this machine's physical memory: a
    subscriber stages whole versions in host RAM. ``max_control_bytes`` bounds
    one control frame (ZeroMQ refuses bigger frames before reading them, and
    ``decode`` before parsing); ``max_pinned_bytes`` bounds one page-locked
    staging buffer on CUDA machines (larger versions are staged in pageable memory).
    """

    max_total_bytes: int = field(default_factory=_physical_memory)
    max_tensors: int = MAX_TENSORS
    max_chunks_per_fetch: int = MAX_CHUNKS_PER_FETCH
    max_control_bytes: int = 64 << 20
    max_pinned_bytes: int = field(default_factory=_pinned_default)


DEFAULT_LIMITS = Limits()


class _Message(msgspec.Struct, frozen=True, tag_field="t", kw_only=True):
    """Common frame: ``t`` (the tag, set by each subclass) and ``p`` (protocol version)."""

    p: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if self.p != PROTOCOL_VERSION:
            raise ValueError(f"p: protocol version {self.p}, this side speaks {PROTOCOL_VERSION}")


class _FromPublisher(_Message, kw_only=True, frozen=True):
    """Sent by a publisher instance: which one, and when it says it started.

    ``started_at`` is the sender's wall clock, for people reading status; nothing
    orders instances by it (clocks of two hosts need not agree). A subscriber
    follows a new ``publisher_id`` only when the ROUTER it dialled confirms it in
    a ``latest`` reply.
    """

    publisher_id: Name
    started_at: Seconds


class TensorEntry(msgspec.Struct, frozen=True):
    """One tensor of a version: where its bytes sit in the version's flat buffer."""

    name: Name
    dtype: Annotated[str, Meta(max_length=32)]
    shape: Shape
    offset: U63
    nbytes: U63

    def __post_init__(self) -> None:
        if math.prod(d for d in self.shape if d) > MAX_ELEMENTS:
            raise ValueError(f"shape: {list(self.shape)} has too many elements")
        dtype = DTYPE_BY_NAME.get(self.dtype)
        if dtype is None:
            allowed = ", ".join(sorted(DTYPE_BY_NAME))
            raise ValueError(f"dtype: unsupported dtype {self.dtype!r} (allowed: {allowed})")
        size = itemsize(dtype)
        expected = math.prod(self.shape) * size
        if self.nbytes != expected:
            raise ValueError(
                f"nbytes: {self.nbytes} does not match shape {list(self.shape)} x {self.dtype} "
                f"({expected} bytes) for tensor {self.name!r}"
            )
        if self.offset % size:
            raise ValueError(f"offset: {self.offset} is not aligned to {size} bytes")


class DeltaBase(msgspec.Struct, frozen=True):
    """A version a delta starts from: its number and ``delta_codec.version_digest``."""

    version: Version
    digest: U64


class DeltaInfo(msgspec.Struct, frozen=True):
    """The version is also served as deltas (``FetchRequest.base``), see ``delta_codec``.

    ``chain`` runs from the anchor (a full version) to the direct base: a
    subscriber holding any of them fetches the deltas after it, in order.
    """

    chain: Annotated[tuple[DeltaBase, ...], Meta(min_length=1, max_length=MAX_DELTA_CHAIN)]

    def __post_init__(self) -> None:
        for index in range(1, len(self.chain)):
            if self.chain[index].version <= self.chain[index - 1].version:
                raise ValueError(f"chain[{index}].version: versions must increase")


class Manifest(_FromPublisher, tag="manifest", kw_only=True, frozen=True):
    """A complete, immutable description of one published version.

    ``checksums`` always describe the full bytes, also when ``delta`` offers deltas.
    ``deltas_follow``: the publisher serves deltas (``delta_anchor_every`` > 1), so a
    later version may come as a delta against this one; only then is it worth a
    subscriber's memory to keep this version as its delta base.
    """

    version: Version
    created_at: Seconds
    model_id: Text = ""
    chunk_size: ChunkSize
    total_bytes: U63
    tensors: Annotated[tuple[TensorEntry, ...], Meta(max_length=MAX_TENSORS)]
    checksums: Annotated[tuple[U64, ...], Meta(max_length=MAX_CHUNKS)]
    checksum_algorithm: Annotated[str, Meta(max_length=32)] = CHECKSUM_ALGORITHM
    delta: DeltaInfo | None = None
    collective: CollectiveAnnounce | None = None  # also served by a group broadcast
    deltas_follow: bool = False

    def __post_init__(self) -> None:
        _Message.__post_init__(self)
        if self.collective is not None and self.collective.bucket_bytes % self.chunk_size:
            raise ValueError(f"collective.bucket_bytes: {self.collective.bucket_bytes} is not "
                             f"a multiple of chunk_size {self.chunk_size}")
        if self.delta is not None and self.delta.chain[-1].version >= self.version:
            raise ValueError(f"delta: base version {self.delta.chain[-1].version} is not older "
                             f"than version {self.version}")
        if self.checksum_algorithm != CHECKSUM_ALGORITHM:
            raise ValueError(f"checksum_algorithm: unsupported {self.checksum_algorithm!r}")
        expected = -(-self.total_bytes // self.chunk_size)
        if len(self.checksums) != expected:
            raise ValueError(
                f"checksums: {len(self.checksums)} entries, expected {expected} for "
                f"{self.total_bytes} bytes in chunks of {self.chunk_size}"
            )
        seen: set[str] = set()
        end = 0
        for index, entry in enumerate(self.tensors):
            where = f"tensors[{index}]"
            if entry.name in seen:
                raise ValueError(f"{where}.name: duplicate tensor name {entry.name!r}")
            seen.add(entry.name)
            if entry.offset < end:
                raise ValueError(f"{where}.offset: {entry.offset} overlaps the previous tensor")
            end = entry.offset + entry.nbytes
            if end > self.total_bytes:
                raise ValueError(f"{where}: tensor {entry.name!r} ends at byte {end}, past "
                                 f"total_bytes {self.total_bytes}")

    def check(self, limits: Limits) -> Manifest:
        """Receiver-specific bounds (memory, tensor count); returns ``self``."""
        if self.total_bytes > limits.max_total_bytes:
            raise ProtocolError(
                f"manifest.total_bytes: version {self.version} has {self.total_bytes} bytes, "
                f"more than this receiver accepts ({limits.max_total_bytes})"
            )
        if len(self.tensors) > limits.max_tensors:
            raise ProtocolError(f"manifest.tensors: {len(self.tensors)} tensors, more than "
                                f"{limits.max_tensors}")
        return self

    @property
    def num_chunks(self) -> int:
        return len(self.checksums)

    def chunk_span(self, chunk: int) -> tuple[int, int]:
        """(offset, size) of a chunk in the flat buffer."""
        start = chunk * self.chunk_size
        return start, min(self.chunk_size, self.total_bytes - start)

    def chunks_of(self, entry: TensorEntry) -> range:
        """The chunk ids that hold a tensor's bytes."""
        if entry.nbytes == 0:
            return range(0)
        first = entry.offset // self.chunk_size
        last = (entry.offset + entry.nbytes - 1) // self.chunk_size
        return range(first, last + 1)


class Heartbeat(_FromPublisher, tag="heartbeat", kw_only=True, frozen=True):
    """Liveness plus the newest version, so a subscriber that missed a manifest notices."""

    latest_version: U63
    sent_at: Seconds
    interval: Interval


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
    """

    req: U63
    publisher_id: Name
    version: Version
    chunks: Annotated[tuple[Annotated[int, Meta(ge=0, le=MAX_CHUNKS)], ...],
                      Meta(max_length=MAX_CHUNKS_PER_FETCH)]
    base: U63 = 0


class ChunkHeader(_Message, tag="chunk", kw_only=True, frozen=True):
    """First frame of a chunk reply; the second frame carries exactly ``size`` bytes."""

    req: U63
    version: Version
    chunk: Annotated[int, Meta(ge=0, le=MAX_CHUNKS)]
    size: Annotated[int, Meta(ge=0, le=MAX_CHUNK_SIZE)]


ERROR_CODES = ("version_unavailable", "bad_request")


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
    """

    subscriber_id: Name
    staged_version: U63
    applied_version: U63
    last_error: ErrorText | None = None
    publisher_id: Name | None = None
    client_key: Annotated[str, Meta(max_length=64)] | None = None
    ranks: Annotated[tuple[Rank, ...], Meta(max_length=MAX_REPORTED_RANKS)] = ()
    data_path: DataPath = ""  # how the applied version's bytes reached the node

    def __post_init__(self) -> None:
        _Message.__post_init__(self)
        if self.data_path not in ("", *DATA_PATHS):
            raise ValueError(f"data_path: unknown data path {self.data_path!r}")


class StatusRequest(_Message, tag="status", kw_only=True, frozen=True):
    req: U63


class StatusReply(_FromPublisher, tag="status_rep", kw_only=True, frozen=True):
    """The publisher's view: versions held, the last report of each subscriber, and the
    chunk payload bytes sent so far (full versions and deltas: what deltas save)."""

    req: U63
    latest_version: U63
    versions: Annotated[tuple[U63, ...], Meta(max_length=4096)]
    subscribers: Annotated[tuple[Report, ...], Meta(max_length=100_000)]
    bytes_sent_full: U64 = 0
    bytes_sent_delta: U64 = 0
    collective: GroupStatus | None = None  # the collective path's group, if announced


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

    def __post_init__(self) -> None:
        _Message.__post_init__(self)
        if self.state not in POLL_STATES:
            raise ValueError(f"state: unknown state {self.state!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: unknown backend {self.backend!r}")


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


Message = (
    Manifest | Heartbeat | LatestRequest | LatestReply | FetchRequest | ChunkHeader
    | ErrorReply | Report | StatusRequest | StatusReply | CollectivePoll | CollectiveReply
)
ALL_TYPES: tuple[type[_Message], ...] = (
    Manifest, Heartbeat, LatestRequest, LatestReply, FetchRequest, ChunkHeader, ErrorReply,
    Report, StatusRequest, StatusReply, CollectivePoll, CollectiveReply,
)

_ENCODER = msgspec.msgpack.Encoder()


class _Tag(msgspec.Struct):
    t: str


def encode(message: _Message) -> bytes:
    """One msgpack frame: the message's fields plus ``t`` (type) and ``p`` (protocol)."""
    return _ENCODER.encode(message)


@lru_cache(maxsize=32)
def _decoder(types: tuple[type[_Message], ...]) -> msgspec.msgpack.Decoder[Any]:
    union: Any = types[0]
    for cls in types[1:]:
        union = union | cls
    return msgspec.msgpack.Decoder(union)


def decode(frame: bytes | memoryview, *, expect: tuple[type[_Message], ...] = ALL_TYPES,
           limits: Limits | None = None) -> Message:
    """Parse and validate one control frame; raises ``ProtocolError`` naming the field.

    ``expect`` lists the message types this socket may receive; ``limits``
    applies the receiver's bounds to manifests (``Manifest.check``).
    """
    bound = MAX_CONTROL_BYTES if limits is None else min(MAX_CONTROL_BYTES,
                                                         limits.max_control_bytes)
    if len(frame) > bound:
        raise ProtocolError(f"message: {len(frame)} bytes exceeds {bound}")
    try:
        message = _decoder(expect).decode(frame)
    except msgspec.ValidationError as exc:
        raise ProtocolError(_describe(frame, exc, expect)) from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"message: not valid msgpack ({exc})") from exc
    if limits is not None:
        manifest = message if isinstance(message, Manifest) else getattr(message, "manifest", None)
        if isinstance(manifest, Manifest):
            manifest.check(limits)
    return message


M = TypeVar("M", bound=_Message)


def decode_as(frame: bytes | memoryview, cls: type[M], *, limits: Limits | None = None) -> M:
    """``decode`` for a socket that receives exactly one message type."""
    message = decode(frame, expect=(cls,), limits=limits)
    if not isinstance(message, cls):  # pragma: no cover - the decoder only builds ``cls``
        raise ProtocolError(f"message.t: expected {cls.__name__}")
    return message


_FIELD = re.compile(r"^[A-Za-z_][\w.\[\]]*$")
_LOCATED = re.compile(r"^(.*) - at `(key` in `)?\$(.*)`$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(\w+)`$")


def _describe(frame: bytes | memoryview, exc: msgspec.ValidationError,
              expect: tuple[type[_Message], ...]) -> str:
    """``<type>.<path>.<field>: <what>`` from msgspec's ``"<what> - at `$.<path>`"``."""
    located = _LOCATED.match(str(exc))
    what, path = (located.group(1), located.group(3)) if located else (str(exc), "")
    if located and located.group(2):
        what = f"a map key: {what}"
    missing = _MISSING.match(what)
    if missing:
        path = f"{path}.{missing.group(1)}"
    else:
        head, colon, rest = what.partition(": ")
        if colon and _FIELD.match(head):
            path, what = f"{path}.{head}", rest  # a __post_init__ check named its field
    try:
        root: str | None = msgspec.msgpack.decode(frame, type=_Tag).t[:32]
    except msgspec.DecodeError:
        root = None
    if path == ".t":
        if root is None:
            return "message.t: missing, or not a string"
        wanted = ", ".join(sorted(str(c.__struct_config__.tag) for c in expect))
        return f"message.t: unexpected {root!r} here (expected {wanted})"
    return f"{root or 'message'}{path}: {what}"
