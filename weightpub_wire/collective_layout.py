"""The collective data path, what both sides agree on: announce, buckets, round headers.

A publisher started with ``collective="gloo" | "nccl" | "cuda_ipc"`` announces it
in every manifest and ``latest`` reply (``CollectiveAnnounce``); a subscriber that
may use it asks to join through the ROUTER (``protocol.CollectivePoll``) and is
told its rank in the current group epoch (``protocol.CollectiveReply``). The
version's bytes then go out as packed buckets: contiguous ranges of the version's
flat buffer (the same layout the chunks cut), each a whole number of chunks, so
every bucket is checked against the manifest's chunk checksums as it lands::

    flat buffer  |--------- bucket 0 ---------|--------- bucket 1 ---------|-- 2 --|
    chunks       | c0 | c1 | c2 | c3 | c4 | c5 | c6 | c7 | c8 | c9 |c10 |c11 |c12|

A group round is driven by the publisher (rank 0), one ``HEADER_WORDS``-word
int64 header broadcast at a time::

    header {magic, kind, epoch, version, total_bytes, bucket_bytes, buckets, publisher}
      kind KEEPALIVE: nothing follows (sent every ``keepalive`` s: members never wait
                      longer than that plus the timeout to learn the root is gone);
                      ``version`` is the last round's: older versions will not come
      kind DATA:      all_gather(ready) -> broadcast each bucket -> all_gather(verified)
      kind CLOSE:     the root leaves; members tear the group down

``cuda_ipc`` (a replica on the trainer's GPU) has no group: the reply hands the
member an ``IpcHandle`` of the newest version's device buffer, which it copies
from bucket by bucket. Never pickle: handles are plain bytes and integers.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

import msgspec
import torch
from msgspec import Meta

from weightpub_wire.collective_backends import collective_backend, known_backends
from weightpub_wire.errors import ConfigError

__all__ = [
    "BACKENDS",
    "DATA_PATHS",
    "FALLBACK_CAUSES",
    "MAX_FALLBACK_CAUSES",
    "HEADER_WORDS",
    "KIND_CLOSE",
    "KIND_DATA",
    "KIND_KEEPALIVE",
    "MAX_BUCKET_BYTES",
    "MAX_MEMBERS",
    "CollectiveAnnounce",
    "GroupStatus",
    "MAX_IPC_HANDLE_BYTES",
    "MAX_IPC_STORAGE_BYTES",
    "IpcHandle",
    "RoundHeader",
    "bucket_spans",
    "ipc_handle_limit",
    "publisher_tag",
]

#: collective backends a publisher may announce (``collective_backends.py``: what each needs)
BACKENDS = known_backends()
#: how the bytes of a version reached a node (``Report.data_path``, ``weight_version()``)
DATA_PATHS = ("zmq", *BACKENDS)
MAX_MEMBERS = 256  # subscribers (nodes) in one group
#: why a version a node held back for the collective path came over ZeroMQ frames instead
#: (``CollectiveMember``: status, the replica's metric label, polls, ``weightpub status``)
FALLBACK_CAUSES = (
    "unusable",  # the backend cannot run here (NCCL without a GPU, cuda_ipc on another GPU)
    "refused",  # the publisher refused this node (limits, penalty, backend)
    "join_failed",  # the rendezvous of the epoch failed here
    "join_timeout",  # asked to join, but no epoch took this node in time
    "epoch_ended",  # the publisher ended this node's epoch (a failure on its side)
    "group_lost",  # the group broke while waiting for rounds (peer died, timeout)
    "round_failed",  # the broadcast round of this version failed mid-way
    "checksum",  # a received bucket failed its chunk checksums
    "round_passed",  # its round went by without this node (formed after it)
    "round_timeout",  # in the group, but no round came within the timeout
    "staging_budget",  # no staging memory for it now (the ZeroMQ path waits for it)
    "receiver_error",  # the receiving thread failed unexpectedly
    "ipc_copy",  # cuda_ipc: the copy out of the publisher's device buffer failed
    "closing",  # this subscriber is closing
)
MAX_FALLBACK_CAUSES = 16  # causes one poll or one member carries (bounded on the wire)
MIN_BUCKET_BYTES = 4096
MAX_BUCKET_BYTES = 1 << 30
HEADER_WORDS = 8
MAGIC = 0x77707562_636F6C6C  # "wpubcoll"
KIND_KEEPALIVE, KIND_DATA, KIND_CLOSE = 0, 1, 2

U63 = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Port = Annotated[int, Meta(ge=0, le=65535)]  # 0: no rendezvous (cuda_ipc)
Label = Annotated[str, Meta(max_length=64, pattern="^[A-Za-z0-9_.:-]*$")]
Backend = Annotated[str, Meta(max_length=16)]
Member = Annotated[str, Meta(min_length=1, max_length=1024,
                             pattern="^[^\x00-\x1f\x7f-\x9f]+$")]


class CollectiveAnnounce(msgspec.Struct, frozen=True, kw_only=True):
    """The collective path a publisher offers (in manifests and ``latest`` replies).

    ``store_port``: the rendezvous (a torch ``TCPStore``) on the host the subscriber
    dialled; ``epoch``: the group epoch when this was sent (rounds carry their own);
    ``bucket_bytes``: the bucket layout (a multiple of the manifest's chunk size);
    ``timeout``: seconds any one rendezvous or collective may take before the path
    is given up for that version; ``device_uuid``: the publisher's GPU (cuda_ipc).
    """

    backend: Backend
    store_port: Port
    epoch: U63
    bucket_bytes: Annotated[int, Meta(ge=MIN_BUCKET_BYTES, le=MAX_BUCKET_BYTES)]
    timeout: Annotated[float, Meta(gt=0.0, le=3600.0)]
    keepalive: Annotated[float, Meta(gt=0.0, le=600.0)] = 1.0
    device_uuid: Label = ""

    def __post_init__(self) -> None:
        try:
            backend = collective_backend(self.backend)
        except ConfigError as exc:
            raise ValueError(f"backend: {exc}") from None
        if backend.has_group and not self.store_port:
            raise ValueError(f"store_port: {self.backend} needs a rendezvous port")
        if self.keepalive >= self.timeout:
            raise ValueError(f"keepalive: {self.keepalive}s must be shorter than the "
                             f"timeout {self.timeout}s")


#: What ``UntypedStorage._share_cuda_()`` returns as its handle (torch 2.13,
#: ``CUDACachingAllocator::shareIpcHandle``): a format byte and a kind byte, then a
#: ``cudaIpcMemHandle_t`` (64 bytes) for cudaMalloc memory or, with
#: ``expandable_segments``, ``ExpandableSegment::share``: a header (pid, segment size,
#: handle count: 24 bytes) and one shareable handle per segment the block spans, a
#: POSIX fd (4 bytes) or a ``CUmemFabricHandle`` (64 bytes). Segments are at least
#: ``kSmallBuffer`` (2 MiB); a block is at most twice its storage (the coarsest
#: ``roundup_power2_divisions``).
_IPC_PREFIX, _IPC_MEM_HANDLE, _SEGMENTS_HEADER, _SEGMENT_HANDLE = 2, 64, 24, 64
_MIN_SEGMENT = 2 << 20
#: the largest device buffer a handle may describe (more memory than any one GPU has)
MAX_IPC_STORAGE_BYTES = 256 << 30


def ipc_handle_limit(storage_bytes: int) -> int:
    """The most bytes torch's IPC handle of a ``storage_bytes`` CUDA storage can take."""
    segments = -(-2 * max(storage_bytes, 1) // _MIN_SEGMENT) + 1  # +1: an unaligned start
    return _IPC_PREFIX + max(_IPC_MEM_HANDLE, _SEGMENTS_HEADER + _SEGMENT_HANDLE * segments)


MAX_IPC_HANDLE_BYTES = ipc_handle_limit(MAX_IPC_STORAGE_BYTES)  # about 16 MiB


class IpcHandle(msgspec.Struct, frozen=True, kw_only=True):
    """A CUDA IPC handle of one version's device buffer (``torch.UntypedStorage._share_cuda_``
    fields, all plain bytes and integers). ``handle`` grows with the buffer when the
    exporter's allocator uses ``expandable_segments`` (``ipc_handle_limit``)."""

    version: Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]
    device_index: Annotated[int, Meta(ge=0, le=1024)]
    handle: Annotated[bytes, Meta(max_length=MAX_IPC_HANDLE_BYTES)]
    storage_bytes: Annotated[int, Meta(ge=0, le=MAX_IPC_STORAGE_BYTES)]
    storage_offset: U63
    ref_counter_handle: Annotated[bytes, Meta(max_length=1024)]
    ref_counter_offset: U63
    event_handle: Annotated[bytes, Meta(max_length=256)]  # a cudaIpcEventHandle_t: 64
    event_sync_required: bool

    def __post_init__(self) -> None:
        limit = ipc_handle_limit(self.storage_bytes)
        if len(self.handle) > limit:
            raise ValueError(f"handle: {len(self.handle)} bytes, more than a CUDA IPC handle "
                             f"of a {self.storage_bytes}-byte storage takes ({limit})")


class GroupStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The publisher's collective path in ``weightpub status``: who is in the group."""

    backend: Backend
    state: Annotated[str, Meta(max_length=16)]
    epoch: U63
    members: Annotated[tuple[Member, ...], Meta(max_length=MAX_MEMBERS)] = ()
    waiting: Annotated[tuple[Member, ...], Meta(max_length=MAX_MEMBERS)] = ()
    rounds: U63 = 0
    last_version: U63 = 0
    bytes_sent: U63 = 0
    last_error: Annotated[str, Meta(max_length=1024)] | None = None
    #: (member, cause, count): versions each polling node fetched over ZeroMQ instead
    fallbacks: Annotated[tuple[tuple[Member, Label, U63], ...],
                         Meta(max_length=MAX_MEMBERS * MAX_FALLBACK_CAUSES)] = ()


class RoundHeader(msgspec.Struct, frozen=True, kw_only=True):
    """One group round as the root announces it (sent as ``HEADER_WORDS`` int64 words)."""

    kind: int
    epoch: int
    version: int = 0
    total_bytes: int = 0
    bucket_bytes: int = 0
    buckets: int = 0
    publisher: int = 0

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([MAGIC, self.kind, self.epoch, self.version, self.total_bytes,
                             self.bucket_bytes, self.buckets, self.publisher],
                            dtype=torch.int64)

    @staticmethod
    def empty() -> torch.Tensor:
        return torch.zeros(HEADER_WORDS, dtype=torch.int64)

    @classmethod
    def from_tensor(cls, words: torch.Tensor, *, epoch: int, publisher: int,
                    max_total_bytes: int, bucket_bytes: int) -> RoundHeader:
        """Check a received header against what this member agreed to (``ValueError``)."""
        values = [int(v) for v in words.cpu().tolist()]
        if len(values) != HEADER_WORDS or values[0] != MAGIC:
            raise ValueError("round header: bad magic (not a weightpub group?)")
        header = cls(kind=values[1], epoch=values[2], version=values[3],
                     total_bytes=values[4], bucket_bytes=values[5], buckets=values[6],
                     publisher=values[7])
        if header.kind not in (KIND_KEEPALIVE, KIND_DATA, KIND_CLOSE):
            raise ValueError(f"round header: unknown kind {header.kind}")
        if header.epoch != epoch or header.publisher != publisher:
            raise ValueError(f"round header: epoch {header.epoch} of publisher "
                             f"{header.publisher:x}, expected {epoch} of {publisher:x}")
        if header.kind == KIND_DATA:
            if header.version < 1 or not 0 <= header.total_bytes <= max_total_bytes:
                raise ValueError(f"round header: version {header.version} of "
                                 f"{header.total_bytes} bytes is out of bounds")
            if header.bucket_bytes != bucket_bytes:
                raise ValueError(f"round header: buckets of {header.bucket_bytes} bytes, "
                                 f"announced {bucket_bytes}")
            if header.buckets != len(bucket_spans(header.total_bytes, bucket_bytes)):
                raise ValueError(f"round header: {header.buckets} buckets do not cut "
                                 f"{header.total_bytes} bytes")
        return header


def bucket_spans(total_bytes: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """(offset, size) of each bucket of a version's flat buffer."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: {bucket_bytes} must be positive")
    return [(start, min(bucket_bytes, total_bytes - start))
            for start in range(0, total_bytes, bucket_bytes)]


def publisher_tag(publisher_id: str) -> int:
    """A 62-bit number naming a publisher instance in round headers."""
    return int.from_bytes(hashlib.sha256(publisher_id.encode()).digest()[:8], "big") >> 2
