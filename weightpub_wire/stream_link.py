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
    slices   (subscriber -> publisher)  4s magic b"WPsl", u32 count, u64 req,
                                        u64 version, then per chunk: u32 chunk,
                                        u32 n, n x (u32 start, u32 length,
                                        u32 stride, u32 rows)                  24 + 8n + 16b
    reply    (publisher -> subscriber)  4s magic b"WPsr", u8 status, u8 flags,
                                        2x pad, u64 req, u64 version, u32 chunk,
                                        u32 size, then ``size`` bytes (OK)     32 + size

A reply's ``status``: ``ACCEPTED`` / ``REFUSED`` answer the hello (the connection is
closed after a refusal), ``OK`` carries a chunk, ``UNAVAILABLE`` says the version is
not held (evicted or overwritten; no payload). Every parser is bounded and names
what was wrong (``ProtocolError``).

Slices (a sliced subscriber, issue 30 on the stream): a ``slices`` request names, per
chunk, the blocks of its plan in that chunk (``weightpub_wire.slice_layout``: ``rows``
copies of ``length`` bytes ``stride`` apart from ``start``, counted from the chunk's
first byte), in the order the publisher gathers them for ``slice_sums``; the reply's
payload is those bytes back to back, ``size`` of them. Who serves them says so in the
``ACCEPTED`` reply's ``flags`` (``FLAG_SLICES``): a publisher from before has 0 there
(the byte was padding, which such a subscriber never read) and would cut a
connection that sent it the unknown magic, so a subscriber sends ``slices`` only
after that flag.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta

from weightpub_wire.errors import ProtocolError
from weightpub_wire.message_base import MAX_CHUNK_SIZE, MAX_CHUNKS, U63, Name, _Message

__all__ = ["ACCEPTED", "FLAG_SLICES", "HELLO_BYTES", "MAX_CHUNK_BLOCKS", "MAX_REQUEST_BLOCKS",
           "OK", "REFUSED", "REPLY_BYTES", "REQUEST_BYTES", "SLICE_CHUNK_BYTES", "STREAM_PATHS",
           "TOKEN_BYTES", "UNAVAILABLE", "Block", "PeerStreamRequest", "StreamReply",
           "StreamRequest", "StreamToken", "StreamTokenRequest", "hello", "parse_blocks",
           "parse_hello", "parse_reply", "parse_request_head", "parse_slice_chunk", "reply_header",
           "request", "request_chunks", "slice_request"]

#: ``data_path`` of a version that came over the stream: every chunk, or some over frames
STREAM_PATHS = ("stream", "stream+zmq")
TOKEN_BYTES = 32
MAX_REQUEST_CHUNKS = 1024  # chunks in one stream request (a subscriber's whole credit)
MAX_CHUNK_BLOCKS = 4096  # blocks of one chunk in a ``slices`` request (more: frames)
MAX_REQUEST_BLOCKS = 16384  # blocks in one ``slices`` request (256 KiB of them)
FLAG_SLICES = 1  # ``ACCEPTED.flags``: this publisher serves ``slices`` requests

_HELLO = struct.Struct("<4s32s")
_REQUEST = struct.Struct("<4sIQQ")
_SLICE_CHUNK = struct.Struct("<II")
_BLOCK = struct.Struct("<IIII")
_REPLY = struct.Struct("<4sBB2xQQII")
HELLO_BYTES = _HELLO.size  # 36
REQUEST_BYTES = _REQUEST.size  # 24
REPLY_BYTES = _REPLY.size  # 32
SLICE_CHUNK_BYTES = _SLICE_CHUNK.size  # 8
HELLO_MAGIC = b"WPsh"
REQUEST_MAGIC = b"WPsq"
SLICES_MAGIC = b"WPsl"
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


#: a block of a slice request: (start in the chunk, length, stride, rows)
Block = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """A request's fixed part: ``count`` chunk ids (u32 each) follow it, or (``slices``)
    ``count`` chunks each with its blocks."""

    count: int
    req: int
    version: int
    slices: bool = False


@dataclass(frozen=True, slots=True)
class StreamReply:
    """What a reply header says (``size`` payload bytes follow it when ``status`` is OK)."""

    status: int
    req: int
    version: int
    chunk: int
    size: int
    flags: int = 0

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


def slice_request(req: int, version: int,
                  chunks: list[tuple[int, list[Block]]] | tuple[tuple[int, list[Block]], ...]
                  ) -> bytes:
    """One ``slices`` request: per chunk, its blocks (starts counted from the chunk's first
    byte), at most ``MAX_REQUEST_CHUNKS`` chunks and ``MAX_REQUEST_BLOCKS`` blocks."""
    if not 0 < len(chunks) <= MAX_REQUEST_CHUNKS:
        raise ProtocolError(f"stream slices: {len(chunks)} chunks (1..{MAX_REQUEST_CHUNKS})")
    if sum(len(blocks) for _, blocks in chunks) > MAX_REQUEST_BLOCKS:
        raise ProtocolError(f"stream slices: more than {MAX_REQUEST_BLOCKS} blocks")
    parts = [_REQUEST.pack(SLICES_MAGIC, len(chunks), req, version)]
    for chunk, blocks in chunks:
        if not 0 < len(blocks) <= MAX_CHUNK_BLOCKS:
            raise ProtocolError(f"stream slices: chunk {chunk} with {len(blocks)} blocks "
                                f"(1..{MAX_CHUNK_BLOCKS})")
        parts.append(_SLICE_CHUNK.pack(chunk, len(blocks)))
        parts.extend(_BLOCK.pack(*block) for block in blocks)
    return b"".join(parts)


def parse_request_head(data: bytes | memoryview, max_chunks: int = MAX_REQUEST_CHUNKS,
                       slices: bool = True) -> StreamRequest:
    """A request's fixed part; its ``count`` is bounded before anything is read for it.
    ``slices`` False: a ``slices`` request is refused (a publisher that does not serve
    them, as one from before them did)."""
    if len(data) != REQUEST_BYTES:
        raise ProtocolError(f"stream request: {len(data)} header bytes, expected "
                            f"{REQUEST_BYTES}")
    magic, count, req, version = _REQUEST.unpack(data)
    if magic not in ((REQUEST_MAGIC, SLICES_MAGIC) if slices else (REQUEST_MAGIC,)):
        raise ProtocolError(f"stream request: magic {bytes(magic)!r}, expected "
                            f"{REQUEST_MAGIC!r}" + (f" or {SLICES_MAGIC!r}" if slices else ""))
    if not 0 < count <= min(max_chunks, MAX_REQUEST_CHUNKS):
        raise ProtocolError(f"stream request.count: {count} chunks (1.."
                            f"{min(max_chunks, MAX_REQUEST_CHUNKS)})")
    if req >= 1 << 63 or not 0 < version < 1 << 63:
        raise ProtocolError(f"stream request: req {req} / version {version} out of range")
    return StreamRequest(count, req, version, magic == SLICES_MAGIC)


def request_chunks(data: bytes | memoryview, head: StreamRequest) -> tuple[int, ...]:
    """The chunk ids after a request's fixed part (``4 * head.count`` bytes)."""
    if len(data) != 4 * head.count:
        raise ProtocolError(f"stream request.chunks: {len(data)} bytes for {head.count} "
                            "chunks")
    chunks = struct.unpack(f"<{head.count}I", data)
    if any(chunk >= MAX_CHUNKS for chunk in chunks):
        raise ProtocolError(f"stream request.chunks: an id past {MAX_CHUNKS}")
    return chunks


def parse_slice_chunk(data: bytes | memoryview, blocks_left: int) -> tuple[int, int]:
    """A ``slices`` request's chunk entry: (chunk, blocks); the block count is bounded
    (per chunk, and by ``blocks_left`` of the request's) before any block is read."""
    if len(data) != SLICE_CHUNK_BYTES:
        raise ProtocolError(f"stream slices.chunk: {len(data)} bytes, expected "
                            f"{SLICE_CHUNK_BYTES}")
    chunk, count = _SLICE_CHUNK.unpack(data)
    if chunk >= MAX_CHUNKS:
        raise ProtocolError(f"stream slices.chunk: {chunk} (at most {MAX_CHUNKS - 1})")
    if not 0 < count <= min(MAX_CHUNK_BLOCKS, blocks_left):
        raise ProtocolError(f"stream slices.blocks: {count} blocks in chunk {chunk} (1.."
                            f"{MAX_CHUNK_BLOCKS}, {MAX_REQUEST_BLOCKS} in a request)")
    return chunk, count


def parse_blocks(data: bytes | memoryview, count: int, chunk: int) -> list[Block]:
    """``count`` blocks of ``chunk``, each checked on its own: ``rows`` of ``length``
    bytes, ``stride`` apart (at least ``length`` when there are more rows), ending within
    ``MAX_CHUNK_SIZE``; with their bytes together at most ``MAX_CHUNK_SIZE`` too. The
    chunk's real span is checked by the server against the version."""
    if len(data) != _BLOCK.size * count:
        raise ProtocolError(f"stream slices.blocks: {len(data)} bytes for {count} blocks")
    blocks: list[Block] = []
    total = 0
    for index, block in enumerate(_BLOCK.iter_unpack(data)):
        start, length, stride, rows = block
        if not length or not rows or (rows > 1 and stride < length):
            raise ProtocolError(f"stream slices.blocks[{index}] of chunk {chunk}: {rows} rows "
                                f"of {length} bytes, {stride} apart")
        total += length * rows
        if start + (rows - 1) * stride + length > MAX_CHUNK_SIZE or total > MAX_CHUNK_SIZE:
            raise ProtocolError(f"stream slices.blocks[{index}] of chunk {chunk}: past "
                                f"{MAX_CHUNK_SIZE} bytes")
        blocks.append(block)
    return blocks


def reply_header(status: int, req: int = 0, version: int = 0, chunk: int = 0,
                 size: int = 0, flags: int = 0) -> bytes:
    return _REPLY.pack(REPLY_MAGIC, status, flags, req, version, chunk, size)


def parse_reply(data: bytes | bytearray | memoryview) -> StreamReply:
    """A reply header; ``ProtocolError`` naming the field that is wrong."""
    if len(data) != REPLY_BYTES:
        raise ProtocolError(f"stream reply: {len(data)} header bytes, expected {REPLY_BYTES}")
    magic, status, flags, req, version, chunk, size = _REPLY.unpack(data)
    if magic != REPLY_MAGIC:
        raise ProtocolError(f"stream reply: magic {bytes(magic)!r}, expected {REPLY_MAGIC!r}")
    if status not in _STATUSES:
        raise ProtocolError(f"stream reply.status: unknown status {status}")
    if size > MAX_CHUNK_SIZE or (status != OK and size):
        raise ProtocolError(f"stream reply.size: {size} bytes with status "
                            f"{_STATUSES[status]} (at most {MAX_CHUNK_SIZE}, 0 without a chunk)")
    if chunk >= MAX_CHUNKS:
        raise ProtocolError(f"stream reply.chunk: {chunk} (at most {MAX_CHUNKS - 1})")
    return StreamReply(status, req, version, chunk, size, flags)


class PeerStreamRequest(_Message, tag="peer_stream", kw_only=True, frozen=True):
    """Peers over the stream: a one-time token for a member's stream port, please, for
    the chunks of publisher instance ``publisher_id``. Asked on the member's peer ROUTER
    (CURVE: admitted keys only); the answer is a ``StreamToken``, or an ``error``
    naming why not (the stream off there). A member from before drops it (an unknown
    ``t``): the asker counts ``no_answer`` and keeps to frames."""

    req: U63
    publisher_id: Name
