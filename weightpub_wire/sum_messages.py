"""Checksums that follow their manifest (issue 29, ``announce_early``): the messages.

A publisher with ``announce_early`` announces a version as soon as its layout is known,
before its snapshot is copied and hashed: the manifest says ``sums_follow`` (its
``checksums`` are placeholders, zeros, under ``checksum_algorithm`` ``SUMS_FOLLOW``) and
the real per-chunk xxh3-64 sums follow over the subscriber's own DEALER to the ROUTER, the
CURVE-authenticated control channel, never on the (plain) stream port::

    DEALER -> ROUTER  [ {t: "chunk_sums", req, publisher_id, version, have} ]
    ROUTER -> DEALER  [ {t: "chunk_sums_rep", req, version, first, chunks, sums} ]
                    | [ {t: "error", ...} ]   (version_unavailable: not held any more)

The publisher hashes chunks in an order of its own and numbers the sums as they end
(0, 1, ...): ``have`` says how many of them the asker holds, and the reply carries the
next ones from ``first`` (= ``have``): ``chunks[i]`` has the sum ``sums[i]``, at least
one and at most ``MAX_SUMS_PER_REPLY``. The publisher holds the request (bounded) until
one more sum is ready, so a subscriber keeps one request out per version until it holds
every chunk's sum. Same shape as ``slice_sums`` (``slice_messages``), one version's whole
chunks instead of one plan's bytes.

A subscriber that predates this refuses the early manifest by its
``checksum_algorithm`` (named in the error) and takes the version from the complete
manifest the publisher announces again once every sum is in.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from weightpub_wire.errors import ProtocolError
from weightpub_wire.message_base import MAX_CHUNKS, U63, U64, Name, Version, _Message

__all__ = ["MAX_SUMS_PER_REPLY", "SUM_REPLIES", "SUM_REQUESTS", "ChunkSums", "ChunkSumsReply"]

MAX_SUMS_PER_REPLY = 4096  # about 50 KB of msgpack per reply
ChunkId = Annotated[int, Meta(ge=0, lt=MAX_CHUNKS)]


class ChunkSums(_Message, tag="chunk_sums", kw_only=True, frozen=True):
    """The sums of version ``version`` after the first ``have`` ones, when there are any."""

    req: U63
    publisher_id: Name
    version: Version
    have: Annotated[int, Meta(ge=0, le=MAX_CHUNKS)]


class ChunkSumsReply(_Message, tag="chunk_sums_rep", kw_only=True, frozen=True):
    """Sums ``first`` .. ``first + len(sums) - 1`` of the publisher's order: chunk
    ``chunks[i]`` has the xxh3-64 ``sums[i]``."""

    req: U63
    version: Version
    first: Annotated[int, Meta(ge=0, le=MAX_CHUNKS)]
    chunks: Annotated[tuple[ChunkId, ...], Meta(min_length=1, max_length=MAX_SUMS_PER_REPLY)]
    sums: Annotated[tuple[U64, ...], Meta(min_length=1, max_length=MAX_SUMS_PER_REPLY)]

    def __post_init__(self) -> None:
        _Message.__post_init__(self)
        if len(self.sums) != len(self.chunks):
            raise ValueError(f"sums: {len(self.sums)} entries for {len(self.chunks)} chunks")
        if self.first + len(self.chunks) > MAX_CHUNKS:
            raise ValueError(f"first: {self.first} + {len(self.chunks)} sums is past "
                             f"{MAX_CHUNKS} chunks")

    def check(self, num_chunks: int, have: int) -> None:
        """Against the version asked: every chunk id in range, none twice, and the run
        starts at or before what the asker holds (``ProtocolError`` naming the field)."""
        if self.first > have:
            raise ProtocolError(f"chunk_sums_rep.first: {self.first}, past the {have} sums "
                                "held (a gap)")
        if len(set(self.chunks)) != len(self.chunks):
            raise ProtocolError("chunk_sums_rep.chunks: a chunk named twice")
        bad = next((c for c in self.chunks if c >= num_chunks), None)
        if bad is not None:
            raise ProtocolError(f"chunk_sums_rep.chunks: chunk {bad}, the version has "
                                f"{num_chunks}")


#: what a publisher's ROUTER may receive for early sums; what a subscriber may get back
SUM_REQUESTS: tuple[type[_Message], ...] = (ChunkSums,)
SUM_REPLIES: tuple[type[_Message], ...] = (ChunkSumsReply,)
