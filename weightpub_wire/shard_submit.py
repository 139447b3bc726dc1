"""A trainer rank's shard of one version, told to the coordinator that announces the union.

Sent by every rank of a ``publisher.sharded_publisher.ShardedPublisher`` on a
DEALER to the coordinator's ROUTER once its shard is hashed: the coordinator
needs the shard's layout and checksums (to build the union manifest) and where
to fetch it (``endpoint``, ``publisher_id``), never its bytes. ZeroMQ, not a
torch collective: a rank that died must cost the version, not hang rank 0.
"""

from __future__ import annotations

import sys
from typing import Annotated

import msgspec
from msgspec import Meta

from weightpub_wire.errors import ProtocolError
from weightpub_wire.manifest import MAX_SHARDS, DeltaInfo, TensorEntry
from weightpub_wire.message_base import (
    MAX_CHUNKS,
    MAX_TENSORS,
    U63,
    U64,
    ChunkSize,
    Name,
    Text,
    Version,
    _Message,
)
from weightpub_wire.nixl_link import NixlOffer

__all__ = ["DECODED_PER_FRAME_BYTE", "ShardSubmit", "decode_submit", "decoded_bytes",
           "encode_submit"]

#: the most memory a decoded submit can take per byte of its frame (a 3-byte msgpack
#: uint16 checksum is a 32-byte int object and an 8-byte tuple slot: 13x; 9-byte uint64
#: ones measured 6.4x): a frame this many times smaller than a byte bound cannot, decoded,
#: exceed it
DECODED_PER_FRAME_BYTE = 16
#: a Python int of up to 64 bits as pymalloc holds it (36 bytes rounded to its 16-byte
#: size class) and the tuple slot that points to it
_INT_BYTES = 48

Rank = Annotated[int, Meta(ge=0, le=MAX_SHARDS)]


class ShardSubmit(_Message, tag="shard_submit", kw_only=True, frozen=True):
    """Rank ``rank`` of ``world_size`` holds ``tensors`` of ``version`` (its own layout from
    offset 0, ``total_bytes`` a multiple of ``chunk_size``), served at ``endpoint``.

    ``delta``: the versions this rank serves its shard's deltas from (its own
    ``Manifest.delta``, digests over its own checksums); ``deltas_follow``: it serves
    deltas at all (``publisher.sharding.shard_deltas`` makes the union's from every rank's).
    ``nixl``: the rank's NIXL offer of this shard (its own ``Manifest.nixl``), passed on
    in the union's ``ShardSource.nixl``; ``stream_port``: the rank's plain-TCP stream
    port (its own ``Manifest.stream_port``), passed on in ``ShardSource.stream_port``."""

    rank: Rank
    world_size: Annotated[int, Meta(ge=1, le=MAX_SHARDS)]
    version: Version
    publisher_id: Name
    endpoint: Text
    chunk_size: ChunkSize
    total_bytes: U63
    tensors: Annotated[tuple[TensorEntry, ...], Meta(max_length=MAX_TENSORS)]
    checksums: Annotated[tuple[U64, ...], Meta(max_length=MAX_CHUNKS)]
    model_id: Text = ""
    delta: DeltaInfo | None = None
    deltas_follow: bool = False
    nixl: NixlOffer | None = None
    stream_port: Annotated[int, Meta(ge=1, le=65535)] | None = None

    def __post_init__(self) -> None:
        _Message.__post_init__(self)
        if self.rank >= self.world_size:
            raise ValueError(f"rank: {self.rank} is not below world_size {self.world_size}")
        if self.total_bytes % self.chunk_size:
            raise ValueError(f"total_bytes: {self.total_bytes} is not a multiple of "
                             f"chunk_size {self.chunk_size}")
        if len(self.checksums) != self.total_bytes // self.chunk_size:
            raise ValueError(f"checksums: {len(self.checksums)} entries for "
                             f"{self.total_bytes // self.chunk_size} chunks")
        if self.delta is not None and self.delta.chain[-1].version >= self.version:
            raise ValueError(f"delta: base version {self.delta.chain[-1].version} is not "
                             f"older than version {self.version}")


_DECODER = msgspec.msgpack.Decoder(ShardSubmit)
_ENCODER = msgspec.msgpack.Encoder()


def encode_submit(submit: ShardSubmit) -> bytes:
    return _ENCODER.encode(submit)


def decoded_bytes(submit: ShardSubmit) -> int:
    """The memory a decoded submit holds, about (every int counted at its largest size).

    Why not the frame: a decoded submit costs 3-13x its frame (Python objects for
    every checksum and tensor), so a bound on frame bytes let 8 submits of 59 MiB
    take a coordinator from 237 to 1,659 MiB (issue 28.3). One pass over the
    tensors, checksums counted in bulk.
    """
    size = sys.getsizeof(submit) + sys.getsizeof(submit.tensors) + \
        sys.getsizeof(submit.checksums) + len(submit.checksums) * _INT_BYTES
    size += sys.getsizeof(submit.publisher_id) + sys.getsizeof(submit.endpoint) + \
        sys.getsizeof(submit.model_id)
    for entry in submit.tensors:
        size += (sys.getsizeof(entry) + sys.getsizeof(entry.name) + sys.getsizeof(entry.dtype)
                 + sys.getsizeof(entry.shape) + (len(entry.shape) + 2) * _INT_BYTES)
    if submit.delta is not None:
        size += sys.getsizeof(submit.delta) + sys.getsizeof(submit.delta.chain) + \
            len(submit.delta.chain) * 512  # a base: version, digest, a few ints
    if submit.nixl is not None:  # the agent's metadata blob, its name, a few ints a region
        size += sys.getsizeof(submit.nixl.metadata) + sys.getsizeof(submit.nixl.agent) + \
            256 + len(submit.nixl.regions) * (64 + 3 * _INT_BYTES)
    return size


def decode_submit(frame: bytes | memoryview, max_bytes: int) -> ShardSubmit:
    """A submission, or ``ProtocolError`` naming what is wrong with it."""
    if len(frame) > max_bytes:
        raise ProtocolError(f"shard_submit: {len(frame)} bytes, more than {max_bytes}")
    try:
        return _DECODER.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"shard_submit: {exc}") from exc
