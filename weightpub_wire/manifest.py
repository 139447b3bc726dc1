"""What a publisher announces on its PUB socket: a version's manifest, and heartbeats.

A ``Manifest`` is everything a subscriber needs to preallocate a version and
check each chunk as it lands (layout, sizes, checksums, delta chain, collective
path); it is also carried inside ``latest`` replies. Kept apart from the
request/reply messages because it is the one message with real cross-field
validation (tensor layout) and receiver limits (``Manifest.check``).
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec
from msgspec import Meta

from weightpub_wire.adapters import MAX_ADAPTERS, AdapterInfo, check_adapters
from weightpub_wire.collective_layout import CollectiveAnnounce
from weightpub_wire.dtypes import DTYPE_BY_NAME, itemsize
from weightpub_wire.errors import ProtocolError
from weightpub_wire.message_base import (
    CHECKSUM_ALGORITHM,
    MAX_CHUNKS,
    MAX_DELTA_CHAIN,
    MAX_ELEMENTS,
    MAX_TENSORS,
    SUMS_FOLLOW,
    U63,
    U64,
    ChunkSize,
    Interval,
    Limits,
    Name,
    Seconds,
    Shape,
    Text,
    Version,
    _FromPublisher,
    _Message,
)
from weightpub_wire.nixl_link import NixlOffer

__all__ = ["DeltaBase", "DeltaInfo", "Heartbeat", "Manifest", "ShardSource", "TensorEntry",
           "chunks_of"]

MAX_SHARDS = 1 << 16  # trainer ranks serving one version


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


class ShardSource(msgspec.Struct, frozen=True):
    """Chunks ``[first_chunk, first_chunk + num_chunks)`` of a sharded version are served by
    one trainer rank: fetch them from ``endpoint`` as that rank's own chunks from 0, of its
    instance ``publisher_id`` (``publisher.sharded_publisher``).

    ``nixl``: the rank's own NIXL offer (its snapshot buffer, its chunk ``i`` at
    ``i * chunk_size``, i.e. the union's chunk ``first_chunk + i``), as the rank made it
    for its own manifest; None where the rank offers none (frames only, for its range).
    It travelled rank -> coordinator on the CURVE-authenticated collect socket and goes
    on only in the manifest (PUB/ROUTER, CURVE).

    ``stream_port``: the rank's plain-TCP stream port (``stream=True`` there), at the
    host of ``endpoint``; a subscriber with ``stream=True`` asks that rank for a token
    over its DEALER to ``endpoint`` (``weightpub_wire.stream_link``). None: frames only."""

    rank: Annotated[int, Meta(ge=0, le=MAX_SHARDS)]
    endpoint: Text
    publisher_id: Name
    first_chunk: U63
    num_chunks: U63
    nixl: NixlOffer | None = None
    stream_port: Annotated[int, Meta(ge=1, le=65535)] | None = None


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
    #: the version is the union of trainer ranks' shards, each serving its chunk range
    #: (``ShardSource``, in chunk order, covering every chunk once, one endpoint and rank
    #: each), its deltas too (each rank against its own range of the base:
    #: ``publisher.sharding.shard_deltas``); None: this ROUTER serves all
    shards: Annotated[tuple[ShardSource, ...], Meta(min_length=1, max_length=MAX_SHARDS)] \
        | None = None
    #: the version is LoRA adapters (``weightpub_wire.adapters``), not model weights: every
    #: tensor is ``"<adapter>/<PEFT name>"`` of one of them; None: model weights
    adapters: Annotated[tuple[AdapterInfo, ...], Meta(min_length=1, max_length=MAX_ADAPTERS)] \
        | None = None
    #: the version's bytes may also be read one-sided with NIXL (issue 31): one region,
    #: the publisher's snapshot buffer, chunk ``i`` at ``i * chunk_size``
    #: (``weightpub_wire.nixl_link``; bounded like every field). Optional: a subscriber
    #: that predates it ignores it, and any failure of that path falls back to ZeroMQ
    #: frames (an offer that does not fit the version, e.g. a region shorter than
    #: ``total_bytes``, is counted ``bad_offer`` there: the manifest still serves).
    #: It names registered memory: it travels only on PUB/ROUTER (CURVE)
    nixl: NixlOffer | None = None
    #: the version's chunks may also be fetched on a plain TCP port of the publisher's
    #: (issue 29, ``weightpub_wire.stream_link``): a subscriber with ``stream=True`` asks
    #: a one-time token over its DEALER and connects to this port at the ROUTER's host.
    #: Optional: a subscriber that predates it ignores it; unencrypted, so opt-in
    stream_port: Annotated[int, Meta(ge=1, le=65535)] | None = None
    #: announced before its snapshot was hashed (``announce_early``, issue 29): every
    #: ``checksums`` entry is 0 under ``checksum_algorithm`` ``SUMS_FOLLOW`` (so a
    #: subscriber that predates it refuses it by that field) and the real sums come over
    #: the ROUTER (``weightpub_wire.sum_messages``); nothing is staged before they match.
    #: The publisher announces the complete manifest again once every sum is in
    sums_follow: bool = False

    def __post_init__(self) -> None:
        _Message.__post_init__(self)
        if self.adapters is not None:
            check_adapters(self.adapters, [t.name for t in self.tensors])
        if self.shards is not None:
            self._check_shards(self.shards)
        if self.collective is not None and self.collective.bucket_bytes % self.chunk_size:
            raise ValueError(f"collective.bucket_bytes: {self.collective.bucket_bytes} is not "
                             f"a multiple of chunk_size {self.chunk_size}")
        if self.delta is not None and self.delta.chain[-1].version >= self.version:
            raise ValueError(f"delta: base version {self.delta.chain[-1].version} is not older "
                             f"than version {self.version}")
        self._check_sums_follow()
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

    def _check_sums_follow(self) -> None:
        if not self.sums_follow:
            if self.checksum_algorithm != CHECKSUM_ALGORITHM:
                raise ValueError(f"checksum_algorithm: unsupported {self.checksum_algorithm!r}")
            return
        if self.checksum_algorithm != SUMS_FOLLOW:
            raise ValueError(f"checksum_algorithm: {self.checksum_algorithm!r} with "
                             f"sums_follow (expected {SUMS_FOLLOW!r})")
        if any(self.checksums):
            raise ValueError("checksums: must be zeros when sums_follow (the sums follow)")
        for name in ("delta", "collective", "shards", "nixl"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: not offered with sums_follow (its checksums are "
                                 "not known yet)")

    def with_sums(self, checksums: tuple[int, ...]) -> Manifest:
        """The complete manifest of an early one: its sums in, ``sums_follow`` off."""
        return msgspec.structs.replace(self, checksums=tuple(checksums), sums_follow=False,
                                       checksum_algorithm=CHECKSUM_ALGORITHM)

    def _check_shards(self, shards: tuple[ShardSource, ...]) -> None:
        if self.collective is not None:
            raise ValueError("shards: a sharded version offers no collective path")
        next_chunk = 0
        seen: dict[str, int] = {}
        ranks: set[int] = set()
        for index, shard in enumerate(shards):
            # links are per endpoint: two shards at one address would leave a range unasked
            other = seen.setdefault(shard.endpoint, index)
            if other != index:
                raise ValueError(f"shards[{index}].endpoint: {shard.endpoint!r} is also "
                                 f"shards[{other}]'s (each rank serves from its own address)")
            if shard.rank in ranks:
                raise ValueError(f"shards[{index}].rank: rank {shard.rank} serves two ranges")
            ranks.add(shard.rank)
            if shard.first_chunk != next_chunk:
                raise ValueError(f"shards[{index}].first_chunk: {shard.first_chunk}, expected "
                                 f"{next_chunk} (shards cover the chunks in order)")
            next_chunk += shard.num_chunks
        if next_chunk != len(self.checksums):
            raise ValueError(f"shards: cover {next_chunk} chunks, the version has "
                             f"{len(self.checksums)}")

    def shard_of(self, chunk: int) -> ShardSource:
        """The shard serving ``chunk`` (a sharded manifest only)."""
        assert self.shards is not None
        low, high = 0, len(self.shards) - 1
        while low < high:  # the last shard whose first chunk is at or below ``chunk``
            mid = (low + high + 1) // 2
            if self.shards[mid].first_chunk <= chunk:
                low = mid
            else:
                high = mid - 1
        return self.shards[low]

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
        return chunks_of(entry, self.chunk_size)


def chunks_of(entry: TensorEntry, chunk_size: int) -> range:
    """The chunk ids that hold a tensor's bytes (``Manifest.chunks_of``; also for a layout
    that has no manifest yet, as the publisher's early sums)."""
    if entry.nbytes == 0:
        return range(0)
    return range(entry.offset // chunk_size, (entry.offset + entry.nbytes - 1) // chunk_size + 1)


class Heartbeat(_FromPublisher, tag="heartbeat", kw_only=True, frozen=True):
    """Liveness plus the newest version, so a subscriber that missed a manifest notices."""

    latest_version: U63
    sent_at: Seconds
    interval: Interval

