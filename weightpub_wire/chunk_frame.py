"""A chunk reply is ONE ZeroMQ frame: a fixed 32-byte binary header, then the payload.

::

    offset  0   4s  magic  b"WPck"   (never the first byte of a msgpack map: control
                                      frames and chunk frames are told apart here)
            4   u16 protocol          PROTOCOL_VERSION (3); checked before anything else
            6   u16 flags             0
            8   u64 req               the fetch request this answers
           16   u64 version           the version the bytes belong to
           24   u32 chunk             chunk index
           28   u32 size              payload bytes (== frame length - 32)
           32   <size bytes>          the chunk (or its delta payload, ``delta_codec``)

    all little-endian.

Why one frame: with protocol 2 a reply was two frames (msgpack header, payload).
A connection that drops between them leaves libzmq 4.3.5 holding half a
message; it then aborted the process (``zmq_assert(!_more)`` in ``fq.cpp``) on
the next read. A one-frame reply arrives whole or not at all, so no reconnect
can tear it (docs/RELIABILITY.md).

Copies: the sender copies the payload once behind the header into a reused
``ScratchPool`` buffer (held until ZeroMQ reports the frame sent, so a slow
reader pins scratch, never a version); the receiver takes the frame as ZeroMQ
delivered it (``recv(copy=False)``) and copies the payload into place, the same
single copy ``recv_into`` made. ``benchmarks/chunk_frames.py`` measures both forms.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

from weightpub_wire.errors import ProtocolError, ProtocolVersionError
from weightpub_wire.message_base import MAX_CHUNK_SIZE, MAX_CHUNKS, PROTOCOL_VERSION

__all__ = ["HEADER_BYTES", "MAGIC", "ChunkHeader", "ScratchPool", "build", "frame_bytes",
           "is_chunk", "pack", "parse", "payload"]

MAGIC = b"WPck"
_HEADER = struct.Struct("<4sHHQQII")
HEADER_BYTES = _HEADER.size  # 32
_MAX_U63 = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """What a chunk frame says about its payload (``size`` bytes at ``HEADER_BYTES``)."""

    req: int
    version: int
    chunk: int
    size: int


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
    if flags:
        raise ProtocolError(f"chunk.flags: {flags}, expected 0")
    if size != len(frame) - HEADER_BYTES:
        raise ProtocolError(f"chunk.size: {size}, the frame carries "
                            f"{len(frame) - HEADER_BYTES} payload bytes")
    if size > MAX_CHUNK_SIZE:
        raise ProtocolError(f"chunk.size: {size} exceeds {MAX_CHUNK_SIZE}")
    if not 1 <= version <= _MAX_U63 or req > _MAX_U63:
        raise ProtocolError(f"chunk: version {version} or req {req} out of range")
    if chunk > MAX_CHUNKS:
        raise ProtocolError(f"chunk.chunk: {chunk} exceeds {MAX_CHUNKS}")
    return ChunkHeader(req=req, version=version, chunk=chunk, size=size)


def payload(frame: bytes | memoryview) -> memoryview:
    """The payload of a parsed chunk frame (a view, no copy)."""
    return memoryview(frame)[HEADER_BYTES:]


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
