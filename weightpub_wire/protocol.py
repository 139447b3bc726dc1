"""The weightpub wire protocol: what the bytes mean (not how they move).

Every control message is ONE msgpack frame holding a map with ``"t"`` (the
message type) and ``"p"`` (the protocol version). Bulk data is raw bytes.

Sockets and frames::

    PUB    -> SUB     [ {t: "manifest" | "heartbeat"} ]
    DEALER -> ROUTER  [ {t: "latest" | "fetch" | "status" | "report" | "coll_poll"
                         | "peer_hello"} ]
    ROUTER -> DEALER  [ {t: "latest_rep" | "status_rep" | "error" | "coll_rep"
                         | "peer_plan"} ]
                    | [ b"WPck", protocol, req, version, chunk, size, <size raw bytes> ]

A chunk reply is one binary frame (``weightpub_wire.chunk_frame``: a 32-byte header,
then the payload), never split over two: a reconnect cannot tear it. Its magic
tells it from a control frame. Protocol 2 sent it as two frames; a peer of
another version is refused with ``ProtocolVersionError`` naming both versions
(control frames: ``p``; chunk frames: the header's protocol field), and a
publisher or peer server answers such a request with an ``error`` reply.

A publisher with a collective data path announces it in manifests and ``latest``
replies (``collective``); ``coll_poll`` / ``coll_rep`` are how a subscriber asks to
join its group and learns its rank (``weightpub_wire.collective_layout``).

A fetch that names a ``base`` gets each chunk as a delta payload instead
(``weightpub_wire.delta_codec``); manifests of such versions carry ``delta``.
Peer sharing (``peer_hello`` / ``peer_plan``) is in ``weightpub_wire.peer_protocol``;
peers serve each other with the same ``fetch`` / ``chunk`` / ``error`` frames.
Slice fetches (``slice_reg`` / ``slice_ack``, ``slice_sums`` / ``slice_sums_rep``,
``slice_fetch`` answered by chunk frames carrying one plan's bytes of each chunk) are in
``weightpub_wire.slice_messages``, the plans themselves in ``weightpub_wire.slice_plan``.
A manifest announced before its checksums (``sums_follow``, issue 29) is followed by
``chunk_sums`` / ``chunk_sums_rep`` on the ROUTER (``weightpub_wire.sum_messages``).

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

The message classes live in ``message_base`` (bounds, limits, the common frame),
``manifest`` (PUB-side announcements) and ``control_messages`` (ROUTER
request/reply); this module gathers them into the ``Message`` union, encodes and
decodes, and re-exports every name so ``protocol.X`` stays the one way to refer
to them.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, TypeVar

import msgspec

from weightpub_wire.chunk_frame import HEADER_BYTES as CHUNK_HEADER_BYTES
from weightpub_wire.chunk_frame import ChunkHeader
from weightpub_wire.collective_layout import CollectiveAnnounce, GroupStatus, IpcHandle
from weightpub_wire.control_messages import (  # noqa: F401 - ERROR_CODES.. re-exported
    ERROR_CODES,
    POLL_STATES,
    REPLY_STATES,
    CollectivePoll,
    CollectiveReply,
    ErrorReply,
    FetchRequest,
    HostMemory,
    LatestReply,
    LatestRequest,
    NixlHolding,
    PendingShards,
    Report,
    ShardGroup,
    StatusReply,
    StatusRequest,
    StreamPort,
)
from weightpub_wire.errors import ProtocolError, ProtocolVersionError
from weightpub_wire.manifest import (
    DeltaBase,
    DeltaInfo,
    Heartbeat,
    Manifest,
    ShardSource,
    TensorEntry,
)
from weightpub_wire.message_base import (  # noqa: F401 - field types re-exported
    CHECKSUM_ALGORITHM,
    DEFAULT_LIMITS,
    MAX_CHUNK_SIZE,
    MAX_CHUNKS,
    MAX_CHUNKS_IN_FLIGHT,
    MAX_CHUNKS_PER_FETCH,
    MAX_CONTROL_BYTES,
    MAX_DELTA_CHAIN,
    MAX_ELEMENTS,
    MAX_ERROR_CHARS,
    MAX_RECEIVED_FRACTION,
    MAX_REPORTED_RANKS,
    MAX_TENSORS,
    MIN_CHUNK_SIZE,
    PROTOCOL_VERSION,
    SUMS_FOLLOW,
    TENSOR_ALIGN,
    U63,
    U64,
    ChunkSize,
    DataPath,
    ErrorText,
    Interval,
    Limits,
    Name,
    Rank,
    ReceivedFraction,
    Seconds,
    Shape,
    Text,
    Version,
    _FromPublisher,
    _Message,
)
from weightpub_wire.peer_figures import (
    PeerFigures,
    PeerNixlFigures,
    PeerStreamFigures,
    peer_total,
)

__all__ = [
    "CHECKSUM_ALGORITHM",
    "CHUNK_HEADER_BYTES",
    "DEFAULT_LIMITS",
    "MAX_CHUNKS_IN_FLIGHT",
    "MAX_CHUNK_SIZE",
    "MAX_CONTROL_BYTES",
    "MIN_CHUNK_SIZE",
    "PROTOCOL_VERSION",
    "SUMS_FOLLOW",
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
    "HostMemory",
    "IpcHandle",
    "LatestReply",
    "LatestRequest",
    "Limits",
    "Manifest",
    "Message",
    "NixlHolding",
    "PeerFigures",
    "PeerNixlFigures",
    "PeerStreamFigures",
    "PendingShards",
    "Report",
    "ShardGroup",
    "ShardSource",
    "StatusReply",
    "StatusRequest",
    "StreamPort",
    "TensorEntry",
    "decode",
    "decode_as",
    "encode",
    "peek_protocol",
    "peek_req",
    "peer_total",
]

Message = (
    Manifest | Heartbeat | LatestRequest | LatestReply | FetchRequest
    | ErrorReply | Report | StatusRequest | StatusReply | CollectivePoll | CollectiveReply
)
ALL_TYPES: tuple[type[_Message], ...] = (
    Manifest, Heartbeat, LatestRequest, LatestReply, FetchRequest, ErrorReply,
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
        theirs = peek_protocol(frame)
        if theirs is not None and theirs != PROTOCOL_VERSION:
            raise ProtocolVersionError(f"{_root(frame) or 'message'}.p", theirs,
                                       PROTOCOL_VERSION) from exc
        raise ProtocolError(_describe(frame, exc, expect)) from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"message: not valid msgpack ({exc})") from exc
    if limits is not None:
        manifest = message if isinstance(message, Manifest) else getattr(message, "manifest", None)
        if isinstance(manifest, Manifest):
            manifest.check(limits)
    return message


class _Peek(msgspec.Struct):
    p: int = PROTOCOL_VERSION
    req: int = 0


def peek_protocol(frame: bytes | memoryview) -> int | None:
    """The ``p`` field of a control frame, whatever else it holds (None: unreadable)."""
    try:
        return msgspec.msgpack.decode(frame, type=_Peek).p
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def peek_req(frame: bytes | memoryview) -> int:
    """The ``req`` of a request this side could not decode (0 when unreadable), so the
    refusal can be addressed to it."""
    try:
        req = msgspec.msgpack.decode(frame, type=_Peek).req
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0
    return req if 0 <= req < 1 << 63 else 0


def _root(frame: bytes | memoryview) -> str | None:
    try:
        return msgspec.msgpack.decode(frame, type=_Tag).t[:32]
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


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
