"""What every weightpub frame shares: the protocol version, field bounds, receiver limits.

Split from ``weightpub_wire.protocol`` so the message modules (``manifest``,
``control_messages``, ``peer_protocol``) build on one set of bounded field types
and the common ``_Message`` / ``_FromPublisher`` frames without importing each
other. Every bound here is checked by msgspec while a frame is decoded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
from msgspec import Meta

__all__ = [
    "CHECKSUM_ALGORITHM",
    "DEFAULT_LIMITS",
    "MAX_CHUNKS_IN_FLIGHT",
    "MAX_CHUNK_SIZE",
    "MAX_CONTROL_BYTES",
    "MAX_RECEIVED_FRACTION",
    "MIN_CHUNK_SIZE",
    "PROTOCOL_VERSION",
    "SUMS_FOLLOW",
    "TENSOR_ALIGN",
    "Limits",
]

PROTOCOL_VERSION = 4  # 4: a chunk's payload may follow its header (chunk_frame.py); 3: one frame
CHECKSUM_ALGORITHM = "xxh3_64"
#: a manifest whose checksums follow it (``Manifest.sums_follow``; ``sum_messages``): a
#: subscriber that predates it refuses the manifest naming this value
SUMS_FOLLOW = "xxh3_64, sums follow later"
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
#: a share of a version's bytes that arrived (retries and whole chunks can exceed 1; the
#: sender caps it); finite, NaN refused while decoding
MAX_RECEIVED_FRACTION = 64.0
ReceivedFraction = Annotated[float, Meta(ge=0.0, le=MAX_RECEIVED_FRACTION)]


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
