"""The plain-TCP stream path (issue 29): its token messages and its binary formats.

A publisher with ``stream=True`` also listens on a plain TCP port, announced as
``Manifest.stream_port``. A subscriber with ``stream=True`` asks for a one-time
token over its own (CURVE-authenticated) DEALER (``StreamTokenRequest`` ->
``StreamToken``), connects to that port, presents the token (``hello``), and once
accepted asks for chunks on the plain socket. The publisher answers each chunk
with a reply header followed by the chunk's bytes straight from its snapshot
(``socket.sendmsg``, no copy per subscriber); the subscriber ``recv_into``s them
straight into staging and checks every chunk against the manifest's checksums.
The stream is NOT encrypted (as NIXL's one-sided reads are not): it is opt-in on
both sides, even under CURVE (docs/RELIABILITY.md).

Formats (little-endian)::

    hello    (subscriber -> publisher)  4s magic b"WPsh", 32s token            36 bytes
    request  (subscriber -> publisher)  4s magic b"WPsq", u32 count, u64 req,
                                        u64 version, count x u32 chunk         24 + 4n
    reply    (publisher -> subscriber)  4s magic b"WPsr", u8 status, 3x pad,
                                        u64 req, u64 version, u32 chunk,
                                        u32 size, then ``size`` bytes (OK)     32 + size

A reply's ``status``: ``ACCEPTED`` / ``REFUSED`` answer the hello (the connection is
closed after a refusal), ``OK`` carries a chunk, ``UNAVAILABLE`` says the version is
not held (evicted or overwritten; no payload). Every parser is bounded and names
what was wrong (``ProtocolError``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta

from weightpub_wire.errors import ProtocolError
from weightpub_wire.message_base import MAX_CHUNK_SIZE, MAX_CHUNKS, U63, _Message

__all__ = ["ACCEPTED", "HELLO_BYTES", "OK", "REFUSED", "REPLY_BYTES", "REQUEST_BYTES",
           "STREAM_PATHS", "TOKEN_BYTES", "UNAVAILABLE", "StreamReply", "StreamRequest",
           "StreamToken", "StreamTokenRequest", "hello", "parse_hello", "parse_reply",
           "parse_request_head", "reply_header", "request", "request_chunks"]

#: ``data_path`` of a version that came over the stream: every chunk, or some over frames
STREAM_PATHS = ("stream", "stream+zmq")
TOKEN_BYTES = 32
MAX_REQUEST_CHUNKS = 1024  # chunks in one stream request (a subscriber's whole credit)

_HELLO = struct.Struct("<4s32s")
_REQUEST = struct.Struct("<4sIQQ")
_REPLY = struct.Struct("<4sB3xQQII")
HELLO_BYTES = _HELLO.size  # 36
REQUEST_BYTES = _REQUEST.size  # 24
REPLY_BYTES = _REPLY.size  # 32
HELLO_MAGIC = b"WPsh"
REQUEST_MAGIC = b"WPsq"
REPLY_MAGIC = b"WPsr"

OK, UNAVAILABLE, ACCEPTED, REFUSED = 0, 1, 2, 3
_STATUSES = {OK: "ok", UNAVAILABLE: "unavailable", ACCEPTED: "accepted", REFUSED: "refused"}


class StreamTokenRequest(_Message, tag="stream_token", kw_only=True, frozen=True):
    """DEALER -> ROUTER: a one-time token for the publisher's stream port, please."""

    req: U63


class StreamToken(_Message, tag="stream_token_rep", kw_only=True, frozen=True):
    """ROUTER -> DEALER: present ``token`` once on ``port`` (the manifest's stream_port)."""

    req: U63
    token: Annotated[bytes, Meta(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES)]
    port: Annotated[int, Meta(ge=1, le=65535)]


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """A request's fixed part: ``count`` chunk ids (u32 each) follow it."""

    count: int
    req: int
    version: int


@dataclass(frozen=True, slots=True)
class StreamReply:
    """What a reply header says (``size`` payload bytes follow it when ``status`` is OK)."""

    status: int
    req: int
    version: int
    chunk: int
    size: int

    @property
    def status_name(self) -> str:
        return _STATUSES[self.status]


def hello(token: bytes) -> bytes:
    if len(token) != TOKEN_BYTES:
        raise ProtocolError(f"stream hello: token of {len(token)} bytes, expected "
                            f"{TOKEN_BYTES}")
    return _HELLO.pack(HELLO_MAGIC, token)


def parse_hello(data: bytes | memoryview) -> bytes:
    """The token of a hello; ``ProtocolError`` naming what is wrong."""
    if len(data) != HELLO_BYTES:
        raise ProtocolError(f"stream hello: {len(data)} bytes, expected {HELLO_BYTES}")
    magic, token = _HELLO.unpack(data)
    if magic != HELLO_MAGIC:
        raise ProtocolError(f"stream hello: magic {bytes(magic)!r}, expected {HELLO_MAGIC!r}")
    return bytes(token)


def request(req: int, version: int, chunks: list[int] | tuple[int, ...]) -> bytes:
    """One request for ``chunks`` of ``version`` (at most ``MAX_REQUEST_CHUNKS``)."""
    if not 0 < len(chunks) <= MAX_REQUEST_CHUNKS:
        raise ProtocolError(f"stream request: {len(chunks)} chunks (1..{MAX_REQUEST_CHUNKS})")
    return _REQUEST.pack(REQUEST_MAGIC, len(chunks), req, version) + \
        struct.pack(f"<{len(chunks)}I", *chunks)


def parse_request_head(data: bytes | memoryview, max_chunks: int = MAX_REQUEST_CHUNKS
                       ) -> StreamRequest:
    """A request's fixed part; its ``count`` is bounded before anything is read for it."""
    if len(data) != REQUEST_BYTES:
        raise ProtocolError(f"stream request: {len(data)} header bytes, expected "
                            f"{REQUEST_BYTES}")
    magic, count, req, version = _REQUEST.unpack(data)
    if magic != REQUEST_MAGIC:
        raise ProtocolError(f"stream request: magic {bytes(magic)!r}, expected "
                            f"{REQUEST_MAGIC!r}")
    if not 0 < count <= min(max_chunks, MAX_REQUEST_CHUNKS):
        raise ProtocolError(f"stream request.count: {count} chunks (1.."
                            f"{min(max_chunks, MAX_REQUEST_CHUNKS)})")
    if req >= 1 << 63 or not 0 < version < 1 << 63:
        raise ProtocolError(f"stream request: req {req} / version {version} out of range")
    return StreamRequest(count, req, version)


def request_chunks(data: bytes | memoryview, head: StreamRequest) -> tuple[int, ...]:
    """The chunk ids after a request's fixed part (``4 * head.count`` bytes)."""
    if len(data) != 4 * head.count:
        raise ProtocolError(f"stream request.chunks: {len(data)} bytes for {head.count} "
                            "chunks")
    chunks = struct.unpack(f"<{head.count}I", data)
    if any(chunk >= MAX_CHUNKS for chunk in chunks):
        raise ProtocolError(f"stream request.chunks: an id past {MAX_CHUNKS}")
    return chunks


def reply_header(status: int, req: int = 0, version: int = 0, chunk: int = 0,
                 size: int = 0) -> bytes:
    return _REPLY.pack(REPLY_MAGIC, status, req, version, chunk, size)


def parse_reply(data: bytes | bytearray | memoryview) -> StreamReply:
    """A reply header; ``ProtocolError`` naming the field that is wrong."""
    if len(data) != REPLY_BYTES:
        raise ProtocolError(f"stream reply: {len(data)} header bytes, expected {REPLY_BYTES}")
    magic, status, req, version, chunk, size = _REPLY.unpack(data)
    if magic != REPLY_MAGIC:
        raise ProtocolError(f"stream reply: magic {bytes(magic)!r}, expected {REPLY_MAGIC!r}")
    if status not in _STATUSES:
        raise ProtocolError(f"stream reply.status: unknown status {status}")
    if size > MAX_CHUNK_SIZE or (status != OK and size):
        raise ProtocolError(f"stream reply.size: {size} bytes with status "
                            f"{_STATUSES[status]} (at most {MAX_CHUNK_SIZE}, 0 without a chunk)")
    if chunk >= MAX_CHUNKS:
        raise ProtocolError(f"stream reply.chunk: {chunk} (at most {MAX_CHUNKS - 1})")
    return StreamReply(status, req, version, chunk, size)
