"""A chunk reply: a fixed 32-byte binary header, then the payload, in one of two forms.

::

    offset  0   4s  magic  b"WPck"   (never the first byte of a msgpack map: control
                                      frames and chunk frames are told apart here)
            4   u16 protocol          PROTOCOL_VERSION (4); checked before anything else
            6   u16 flags             0: inline, FOLLOWS (1): the payload is the next message
            8   u64 req               the fetch request this answers
           16   u64 version           the version the bytes belong to
           24   u32 chunk             chunk index
           28   u32 size              payload bytes
           32   <size bytes>          inline only: the chunk (or its delta payload, ``delta_codec``)

    all little-endian.

*Inline* (flags 0): header and payload in ONE frame (``build``/``pack``, a copy
behind the header); still accepted, and what a test or a plugged-in source builds.

*Follows* (flags ``FOLLOWS``, protocol 4): the header is a 32-byte message of its
own, and the very next message on the same connection is the payload alone, exactly
``size`` bytes, sent by the publisher straight from its snapshot and by a peer
straight from its staging (``zmq`` ``copy=False``, ``track=True``: no copy per receiver;
``publisher/store/buffer_claims.py`` keeps the snapshot region from being overwritten,
``BufferPool.send_begin`` a staging buffer from being reused, while ZeroMQ still sends
it). Both messages are one frame each, so neither can be torn by a reconnect (the
libzmq 4.3.5 ``fq.cpp`` ``!_more`` abort that ended two-frame replies,
docs/RELIABILITY.md); a header whose payload never comes, or a message of the wrong
size where a payload is due, is a ``ProtocolError`` (``PayloadPairing``) and the chunk
is fetched again.

Receivers accept both forms and copy the payload once, from ZeroMQ's frame into place.
``benchmarks/chunk_frames.py`` measures the forms.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

from weightpub_wire.errors import ProtocolError, ProtocolVersionError
from weightpub_wire.message_base import MAX_CHUNK_SIZE, MAX_CHUNKS, PROTOCOL_VERSION

__all__ = ["FOLLOWS", "HEADER_BYTES", "MAGIC", "ChunkHeader", "PayloadPairing", "ScratchPool",
           "build", "frame_bytes", "header_frame", "is_chunk", "pack", "parse", "payload"]

MAGIC = b"WPck"
_HEADER = struct.Struct("<4sHHQQII")
HEADER_BYTES = _HEADER.size  # 32
_MAX_U63 = (1 << 63) - 1
FOLLOWS = 1  # flags: the payload is the next message on the connection


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """What a chunk frame says about its payload (``size`` bytes at ``HEADER_BYTES``)."""

    req: int
    version: int
    chunk: int
    size: int
    #: the payload is a message of its own (``FOLLOWS``), not behind the header
    follows: bool = False


def frame_bytes(size: int) -> int:
    """Length of the frame that carries ``size`` payload bytes."""
    return HEADER_BYTES + size


def is_chunk(frame: bytes | memoryview) -> bool:
    """Whether ``frame`` is a chunk frame (else it is a msgpack control message)."""
    return len(frame) >= len(MAGIC) and bytes(frame[: len(MAGIC)]) == MAGIC


def pack(buffer: bytearray | memoryview, *, req: int, version: int, chunk: int,
         payload: bytes | memoryview) -> memoryview:
    """Write the header and copy ``payload`` behind it; the frame (a view of ``buffer``)."""
    size = len(payload)
    _HEADER.pack_into(buffer, 0, MAGIC, PROTOCOL_VERSION, 0, req, version, chunk, size)
    view = memoryview(buffer)[: HEADER_BYTES + size]
    view[HEADER_BYTES:] = payload
    return view


def header_frame(*, req: int, version: int, chunk: int, size: int) -> bytes:
    """The 32-byte header of a ``FOLLOWS`` reply: the payload goes as the next message."""
    return _HEADER.pack(MAGIC, PROTOCOL_VERSION, FOLLOWS, req, version, chunk, size)


def build(*, req: int, version: int, chunk: int, payload: bytes | memoryview) -> bytearray:
    """A new chunk frame (allocates; the serving paths ``pack`` into reused scratch)."""
    buffer = bytearray(frame_bytes(len(payload)))
    pack(buffer, req=req, version=version, chunk=chunk, payload=payload)
    return buffer


def parse(frame: bytes | memoryview) -> ChunkHeader:
    """The header of a chunk frame; ``ProtocolError`` naming what is wrong.

    The protocol field is read before the rest, so a peer of another version gets a
    ``ProtocolVersionError`` naming both versions whatever its header looks like.
    """
    if not is_chunk(frame):
        raise ProtocolError("chunk: not a chunk frame (bad magic)")
    if len(frame) < 6:
        raise ProtocolError(f"chunk: {len(frame)}-byte frame, shorter than its header")
    protocol = int.from_bytes(frame[4:6], "little")
    if protocol != PROTOCOL_VERSION:
        raise ProtocolVersionError("chunk.protocol", protocol, PROTOCOL_VERSION)
    if len(frame) < HEADER_BYTES:
        raise ProtocolError(f"chunk: {len(frame)}-byte frame, shorter than its header")
    _, _, flags, req, version, chunk, size = _HEADER.unpack_from(frame)
    if flags not in (0, FOLLOWS):
        raise ProtocolError(f"chunk.flags: {flags}, expected 0 or {FOLLOWS}")
    follows = flags == FOLLOWS
    if follows and len(frame) != HEADER_BYTES:
        raise ProtocolError(f"chunk: a {len(frame)}-byte header frame, expected "
                            f"{HEADER_BYTES} (its payload follows as a message of its own)")
    if not follows and size != len(frame) - HEADER_BYTES:
        raise ProtocolError(f"chunk.size: {size}, the frame carries "
                            f"{len(frame) - HEADER_BYTES} payload bytes")
    if size > MAX_CHUNK_SIZE:
        raise ProtocolError(f"chunk.size: {size} exceeds {MAX_CHUNK_SIZE}")
    if not 1 <= version <= _MAX_U63 or req > _MAX_U63:
        raise ProtocolError(f"chunk: version {version} or req {req} out of range")
    if chunk > MAX_CHUNKS:
        raise ProtocolError(f"chunk.chunk: {chunk} exceeds {MAX_CHUNKS}")
    return ChunkHeader(req=req, version=version, chunk=chunk, size=size, follows=follows)


def payload(frame: bytes | memoryview, header: ChunkHeader | None = None) -> memoryview:
    """The payload in ``frame`` (a view, no copy): behind the header of an inline reply,
    the whole frame when it is the message that followed a ``FOLLOWS`` header."""
    if header is not None and header.follows:
        return memoryview(frame)
    return memoryview(frame)[HEADER_BYTES:]


class PayloadPairing:
    """Per receiving socket: the ``FOLLOWS`` header whose payload message is due next.

    Why a state: ZeroMQ hands the header over as soon as it arrived, while the payload
    may still be on the wire; the reader returns to its other sockets meanwhile.
    """

    __slots__ = ("due",)

    def __init__(self) -> None:
        self.due: ChunkHeader | None = None

    def expect(self, header: ChunkHeader) -> None:
        self.due = header

    def take(self, frame: bytes | memoryview, more: int) -> ChunkHeader:
        """The header ``frame`` is the payload of; ``ProtocolError`` if it is not one."""
        header, self.due = self.due, None
        if header is None:  # pragma: no cover - callers check ``due`` first
            raise ProtocolError("chunk: a payload with no header before it")
        if more or len(frame) != header.size:
            raise ProtocolError(f"chunk {header.chunk} of version {header.version}: "
                                f"{len(frame)}-byte message{' (multipart)' if more else ''} "
                                f"where its {header.size}-byte payload was due")
        return header

    def reset(self) -> None:
        """The connection went away (a reconnect): no payload is due any more."""
        self.due = None


class ScratchPool:
    """Reused send buffers for chunk frames; at most ``max_free_bytes`` idle.

    A buffer is taken for one frame and given back once ZeroMQ reports the frame
    sent (``MessageTracker.done``); one never given back (its peer was dropped
    while ZeroMQ still held the frame) is simply freed by the garbage collector.
    ``drop_idle`` (any thread) frees the idle ones: a budget that needs the room.
    """

    def __init__(self, max_free_bytes: int = 64 << 20) -> None:
        self._free: list[bytearray] = []
        self._free_bytes = 0
        self._max_free = max_free_bytes
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        """Bytes of idle buffers kept for reuse."""
        return self._free_bytes

    def take(self, nbytes: int) -> bytearray:
        with self._lock:
            for index, buffer in enumerate(self._free):
                if nbytes <= len(buffer) <= 2 * nbytes:
                    self._free_bytes -= len(buffer)
                    return self._free.pop(index)
        return bytearray(nbytes)

    def give(self, buffer: bytearray) -> None:
        with self._lock:
            if self._free_bytes + len(buffer) <= self._max_free:
                self._free.append(buffer)
                self._free_bytes += len(buffer)

    def drop_idle(self) -> None:
        with self._lock:
            self._free.clear()
            self._free_bytes = 0
