"""The weightpub wire protocol: what the bytes mean (not how they move).

Every control message is ONE msgpack frame holding a map with ``"p"`` (the
protocol version) and ``"t"`` (the message type). Bulk data is raw bytes.

Sockets and frames::

    PUB  -> SUB     [ msgpack{t: "manifest" | "heartbeat"} ]
    DEALER -> ROUTER [ msgpack{t: "latest" | "fetch" | "status" | "report"} ]
    ROUTER -> DEALER [ msgpack{t: "latest_rep" | "status_rep" | "error"} ]
                   | [ msgpack{t: "chunk", req, version, chunk, size}, <size raw bytes> ]

A version's tensors are laid out back to back (each offset aligned to
``TENSOR_ALIGN``) in one flat byte buffer of ``total_bytes``; the buffer is
cut into ``ceil(total_bytes / chunk_size)`` chunks, each with an xxh3-64
checksum. A subscriber can therefore preallocate the whole version from the
manifest and receive every chunk straight into place.

Decoding never trusts the peer: sizes, counts, names and dtypes are checked
before they are used, and any violation raises ``ProtocolError`` naming the
field. Never pickle.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from publisher.dtypes import dtype_from_name, itemsize
from publisher.errors import ProtocolError
from publisher.wire_checks import (
    MAX_NDIM,
    read_float,
    read_int,
    read_int_list,
    read_list,
    read_map,
    read_name,
    read_optional_str,
    read_str,
)

__all__ = [
    "CHECKSUM_ALGORITHM",
    "PROTOCOL_VERSION",
    "TENSOR_ALIGN",
    "ChunkHeader",
    "ErrorReply",
    "FetchRequest",
    "Heartbeat",
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
    "encode",
]

PROTOCOL_VERSION = 1
CHECKSUM_ALGORITHM = "xxh3_64"
TENSOR_ALIGN = 64
MAX_VERSION = (1 << 63) - 1
MAX_CONTROL_BYTES = 256 << 20


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


@dataclass(frozen=True, slots=True)
class Limits:
    """Upper bounds a receiver enforces before allocating anything a peer asked for.

    By default a version may not exceed this machine's physical memory: a
    subscriber stages whole versions in host RAM.
    """

    max_total_bytes: int = field(default_factory=_physical_memory)
    max_tensors: int = 1_000_000
    max_chunks: int = 10_000_000
    max_chunks_per_fetch: int = 4096
    min_chunk_size: int = 4096
    max_chunk_size: int = 1 << 30


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a version: where its bytes sit in the version's flat buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_wire(cls, raw: object, where: str, limits: Limits) -> TensorEntry:
        msg = read_map(raw, where)
        name = read_name(msg, "name", where)
        dtype_str = read_str(msg, "dtype", where, max_len=32)
        dtype = dtype_from_name(dtype_str, field=f"{where}.dtype")
        shape = tuple(
            read_int_list(msg, "shape", where, max_len=MAX_NDIM, hi=limits.max_total_bytes)
        )
        offset = read_int(msg, "offset", where, hi=limits.max_total_bytes)
        nbytes = read_int(msg, "nbytes", where, hi=limits.max_total_bytes)
        if math.prod(d for d in shape if d) > limits.max_total_bytes:
            # an empty tensor has 0 bytes whatever its other dims; torch would still overflow
            raise ProtocolError(f"{where}.shape: {list(shape)} has too many elements")
        size = itemsize(dtype)
        expected = math.prod(shape) * size
        if nbytes != expected:
            raise ProtocolError(
                f"{where}.nbytes: {nbytes} does not match shape {list(shape)} x {dtype_str} "
                f"({expected} bytes) for tensor {name!r}"
            )
        if offset % size:
            raise ProtocolError(f"{where}.offset: {offset} is not aligned to {size} bytes")
        return cls(name=name, dtype=dtype_str.removeprefix("torch."), shape=shape,
                   offset=offset, nbytes=nbytes)


@dataclass(frozen=True, slots=True)
class Manifest:
    """A complete, immutable description of one published version."""

    TYPE: ClassVar[str] = "manifest"
    publisher_id: str
    started_at: float
    version: int
    created_at: float
    model_id: str
    chunk_size: int
    total_bytes: int
    tensors: tuple[TensorEntry, ...]
    checksums: tuple[int, ...]
    data_paths: tuple[str, ...] = ("zmq",)
    checksum_algorithm: str = CHECKSUM_ALGORITHM

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

    @property
    def instance(self) -> tuple[float, str]:
        """Orders publisher instances: a restarted publisher has a later ``started_at``."""
        return (self.started_at, self.publisher_id)

    def to_wire(self) -> dict[str, Any]:
        return {
            "publisher_id": self.publisher_id,
            "started_at": self.started_at,
            "version": self.version,
            "created_at": self.created_at,
            "model_id": self.model_id,
            "chunk_size": self.chunk_size,
            "total_bytes": self.total_bytes,
            "tensors": [t.to_wire() for t in self.tensors],
            "checksums": list(self.checksums),
            "data_paths": list(self.data_paths),
            "checksum_algorithm": self.checksum_algorithm,
        }

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS) -> Manifest:
        where = "manifest"
        total = read_int(msg, "total_bytes", where, hi=limits.max_total_bytes)
        chunk_size = read_int(
            msg, "chunk_size", where, lo=limits.min_chunk_size, hi=limits.max_chunk_size
        )
        raw_tensors = read_list(msg, "tensors", where, max_len=limits.max_tensors)
        tensors = tuple(
            TensorEntry.from_wire(raw, f"{where}.tensors[{i}]", limits)
            for i, raw in enumerate(raw_tensors)
        )
        _check_layout(tensors, total)
        expected_chunks = -(-total // chunk_size)
        if expected_chunks > limits.max_chunks:
            raise ProtocolError(f"{where}.checksums: {expected_chunks} chunks exceed the limit")
        checksums = tuple(read_int_list(msg, "checksums", where, max_len=limits.max_chunks))
        if len(checksums) != expected_chunks:
            raise ProtocolError(
                f"{where}.checksums: {len(checksums)} entries, expected {expected_chunks} "
                f"for {total} bytes in chunks of {chunk_size}"
            )
        algorithm = read_str(msg, "checksum_algorithm", where, max_len=32)
        if algorithm != CHECKSUM_ALGORITHM:
            raise ProtocolError(f"{where}.checksum_algorithm: unsupported {algorithm!r}")
        paths = read_list(msg, "data_paths", where, max_len=16)
        if not all(isinstance(p, str) and len(p) <= 64 for p in paths):
            raise ProtocolError(f"{where}.data_paths: expected a list of short strings")
        return cls(
            publisher_id=read_name(msg, "publisher_id", where),
            started_at=read_float(msg, "started_at", where),
            version=read_int(msg, "version", where, lo=1, hi=MAX_VERSION),
            created_at=read_float(msg, "created_at", where),
            model_id=read_str(msg, "model_id", where),
            chunk_size=chunk_size,
            total_bytes=total,
            tensors=tensors,
            checksums=checksums,
            data_paths=tuple(paths),
            checksum_algorithm=algorithm,
        )


def _check_layout(tensors: tuple[TensorEntry, ...], total: int) -> None:
    """Tensors must have unique names and sit in order, without overlap, inside the buffer."""
    seen: set[str] = set()
    end = 0
    for index, entry in enumerate(tensors):
        where = f"manifest.tensors[{index}]"
        if entry.name in seen:
            raise ProtocolError(f"{where}.name: duplicate tensor name {entry.name!r}")
        seen.add(entry.name)
        if entry.offset < end:
            raise ProtocolError(f"{where}.offset: {entry.offset} overlaps the previous tensor")
        end = entry.offset + entry.nbytes
        if end > total:
            raise ProtocolError(
                f"{where}: tensor {entry.name!r} ends at byte {end}, past total_bytes {total}"
            )


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Liveness plus the newest version, so a subscriber that missed a manifest notices."""

    TYPE: ClassVar[str] = "heartbeat"
    publisher_id: str
    started_at: float
    latest_version: int
    sent_at: float
    interval: float

    def to_wire(self) -> dict[str, Any]:
        return {
            "publisher_id": self.publisher_id,
            "started_at": self.started_at,
            "latest_version": self.latest_version,
            "sent_at": self.sent_at,
            "interval": self.interval,
        }

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS) -> Heartbeat:
        where = "heartbeat"
        interval = read_float(msg, "interval", where)
        if not 0 < interval <= 3600:
            raise ProtocolError(f"{where}.interval: {interval} is outside (0, 3600]")
        return cls(
            publisher_id=read_name(msg, "publisher_id", where),
            started_at=read_float(msg, "started_at", where),
            latest_version=read_int(msg, "latest_version", where, hi=MAX_VERSION),
            sent_at=read_float(msg, "sent_at", where),
            interval=interval,
        )


@dataclass(frozen=True, slots=True)
class LatestRequest:
    """Clone-pattern snapshot request: 'what is your newest version, and where is your PUB?'"""

    TYPE: ClassVar[str] = "latest"
    req: int

    def to_wire(self) -> dict[str, Any]:
        return {"req": self.req}

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS) -> LatestRequest:
        return cls(req=read_int(msg, "req", "latest"))


@dataclass(frozen=True, slots=True)
class LatestReply:
    """The newest manifest (or none yet) and the PUB port to subscribe to."""

    TYPE: ClassVar[str] = "latest_rep"
    req: int
    publisher_id: str
    started_at: float
    pub_endpoint: str
    heartbeat_interval: float
    manifest: Manifest | None

    def to_wire(self) -> dict[str, Any]:
        return {
            "req": self.req,
            "publisher_id": self.publisher_id,
            "started_at": self.started_at,
            "pub_endpoint": self.pub_endpoint,
            "heartbeat_interval": self.heartbeat_interval,
            "manifest": None if self.manifest is None else self.manifest.to_wire(),
        }

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS) -> LatestReply:
        where = "latest_rep"
        raw = msg.get("manifest")
        manifest = None if raw is None else Manifest.from_wire(read_map(raw, f"{where}.manifest"),
                                                               limits)
        interval = read_float(msg, "heartbeat_interval", where)
        if not 0 < interval <= 3600:
            raise ProtocolError(f"{where}.heartbeat_interval: {interval} is outside (0, 3600]")
        return cls(
            req=read_int(msg, "req", where),
            publisher_id=read_name(msg, "publisher_id", where),
            started_at=read_float(msg, "started_at", where),
            pub_endpoint=read_str(msg, "pub_endpoint", where, max_len=1024),
            heartbeat_interval=interval,
            manifest=manifest,
        )


@dataclass(frozen=True, slots=True)
class FetchRequest:
    """Ask for some chunks of one version; the count is the subscriber's credit."""

    TYPE: ClassVar[str] = "fetch"
    req: int
    publisher_id: str
    version: int
    chunks: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"req": self.req, "publisher_id": self.publisher_id, "version": self.version,
                "chunks": list(self.chunks)}

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS) -> FetchRequest:
        where = "fetch"
        chunks = read_int_list(msg, "chunks", where, max_len=limits.max_chunks_per_fetch,
                               hi=limits.max_chunks)
        return cls(
            req=read_int(msg, "req", where),
            publisher_id=read_name(msg, "publisher_id", where),
            version=read_int(msg, "version", where, lo=1, hi=MAX_VERSION),
            chunks=tuple(chunks),
        )


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """First frame of a chunk reply; the second frame carries exactly ``size`` bytes."""

    TYPE: ClassVar[str] = "chunk"
    req: int
    version: int
    chunk: int
    size: int

    def to_wire(self) -> dict[str, Any]:
        return {"req": self.req, "version": self.version, "chunk": self.chunk, "size": self.size}

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS) -> ChunkHeader:
        where = "chunk"
        return cls(
            req=read_int(msg, "req", where),
            version=read_int(msg, "version", where, lo=1, hi=MAX_VERSION),
            chunk=read_int(msg, "chunk", where, hi=limits.max_chunks),
            size=read_int(msg, "size", where, hi=limits.max_chunk_size),
        )


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """A request could not be served; ``code`` is machine-readable."""

    TYPE: ClassVar[str] = "error"
    CODES: ClassVar[frozenset[str]] = frozenset({"version_unavailable", "bad_request"})
    req: int
    code: str
    message: str
    version: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"req": self.req, "code": self.code, "message": self.message,
                "version": self.version}

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS) -> ErrorReply:
        where = "error"
        code = read_str(msg, "code", where, max_len=64)
        if code not in cls.CODES:
            raise ProtocolError(f"{where}.code: unknown code {code!r}")
        return cls(
            req=read_int(msg, "req", where),
            code=code,
            message=read_str(msg, "message", where, max_len=4096),
            version=read_int(msg, "version", where, hi=MAX_VERSION),
        )


@dataclass(frozen=True, slots=True)
class Report:
    """Back-channel: a subscriber tells the publisher what it staged and applied."""

    TYPE: ClassVar[str] = "report"
    subscriber_id: str
    staged_version: int
    applied_version: int
    last_error: str | None = None
    info: dict[str, str] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            "subscriber_id": self.subscriber_id,
            "staged_version": self.staged_version,
            "applied_version": self.applied_version,
            "last_error": self.last_error,
            "info": self.info,
        }

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS) -> Report:
        where = "report"
        raw_info = read_map(msg.get("info", {}), f"{where}.info")
        if len(raw_info) > 32:
            raise ProtocolError(f"{where}.info: more than 32 entries")
        info = {
            read_str({"k": k}, "k", f"{where}.info", max_len=64):
            read_str(raw_info, k, f"{where}.info", max_len=256)
            for k in raw_info
        }
        return cls(
            subscriber_id=read_name(msg, "subscriber_id", where),
            staged_version=read_int(msg, "staged_version", where, hi=MAX_VERSION),
            applied_version=read_int(msg, "applied_version", where, hi=MAX_VERSION),
            last_error=read_optional_str(msg, "last_error", where),
            info=info,
        )


@dataclass(frozen=True, slots=True)
class StatusRequest:
    TYPE: ClassVar[str] = "status"
    req: int

    def to_wire(self) -> dict[str, Any]:
        return {"req": self.req}

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS) -> StatusRequest:
        return cls(req=read_int(msg, "req", "status"))


@dataclass(frozen=True, slots=True)
class StatusReply:
    """The publisher's view: versions held and the last report of each subscriber."""

    TYPE: ClassVar[str] = "status_rep"
    req: int
    publisher_id: str
    started_at: float
    latest_version: int
    versions: tuple[int, ...]
    subscribers: tuple[Report, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "req": self.req,
            "publisher_id": self.publisher_id,
            "started_at": self.started_at,
            "latest_version": self.latest_version,
            "versions": list(self.versions),
            "subscribers": [r.to_wire() for r in self.subscribers],
        }

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS) -> StatusReply:
        where = "status_rep"
        raw_subs = read_list(msg, "subscribers", where, max_len=100_000)
        return cls(
            req=read_int(msg, "req", where),
            publisher_id=read_name(msg, "publisher_id", where),
            started_at=read_float(msg, "started_at", where),
            latest_version=read_int(msg, "latest_version", where, hi=MAX_VERSION),
            versions=tuple(read_int_list(msg, "versions", where, max_len=100_000,
                                         hi=MAX_VERSION)),
            subscribers=tuple(
                Report.from_wire(read_map(r, f"{where}.subscribers[{i}]"), limits)
                for i, r in enumerate(raw_subs)
            ),
        )


Message = (
    Manifest | Heartbeat | LatestRequest | LatestReply | FetchRequest | ChunkHeader
    | ErrorReply | Report | StatusRequest | StatusReply
)

_TYPES: dict[str, Any] = {
    cls.TYPE: cls
    for cls in (Manifest, Heartbeat, LatestRequest, LatestReply, FetchRequest, ChunkHeader,
                ErrorReply, Report, StatusRequest, StatusReply)
}


def encode(message: Message) -> bytes:
    """One msgpack frame: the message's fields plus ``p`` (protocol) and ``t`` (type)."""
    body = message.to_wire()
    body["p"] = PROTOCOL_VERSION
    body["t"] = message.TYPE
    return msgpack.packb(body, use_bin_type=True)


def decode(
    frame: bytes | memoryview, *, expect: tuple[Any, ...] | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> Message:
    """Parse and validate one control frame; raises ``ProtocolError`` on anything off."""
    if len(frame) > MAX_CONTROL_BYTES:
        raise ProtocolError(f"message: {len(frame)} bytes exceeds {MAX_CONTROL_BYTES}")
    try:
        body = msgpack.unpackb(
            frame, raw=False, strict_map_key=True, use_list=True,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"message: not valid msgpack ({exc})") from exc
    msg = read_map(body, "message")
    proto = read_int(msg, "p", "message", hi=1 << 16)
    if proto != PROTOCOL_VERSION:
        raise ProtocolError(
            f"message.p: protocol version {proto}, this side speaks {PROTOCOL_VERSION}"
        )
    kind = read_str(msg, "t", "message", max_len=32)
    cls = _TYPES.get(kind)
    if cls is None:
        raise ProtocolError(f"message.t: unknown message type {kind!r}")
    if expect is not None and cls not in expect:
        wanted = ", ".join(sorted(c.TYPE for c in expect))
        raise ProtocolError(f"message.t: unexpected {kind!r} here (expected {wanted})")
    return cls.from_wire(msg, limits)
