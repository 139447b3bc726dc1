"""Slice fetches on the wire (issue 30): register a plan once, then ask for its bytes.

A receiver that needs only some bytes of each version (one rank of a replica: its
``weightpub_wire.slice_plan.SlicePlan``) speaks to the publisher's ROUTER on a
DEALER of its own::

    DEALER -> ROUTER  [ {t: "slice_reg", req, digest, layout, part, parts, tensors} ] x parts
    ROUTER -> DEALER  [ {t: "slice_ack", req, digest, needed_bytes} ]     (all parts in)
    DEALER -> ROUTER  [ {t: "slice_sums", req, publisher_id, version, digest} ]
    ROUTER -> DEALER  [ {t: "slice_sums_rep", req, version, digest, sums} ]
    DEALER -> ROUTER  [ {t: "slice_fetch", req, publisher_id, version, digest, chunks} ]
    ROUTER -> DEALER  chunk frames (``chunk_frame``): per chunk, the plan's bytes of that
                      chunk gathered back to back (``slice_layout``), ``size`` of them
                    | [ {t: "error", ...} ]   (``code`` bad_request: the plan is refused
                                               or unknown; version_unavailable)

Registration comes in ``parts`` (each frame stays under the ROUTER's 64 KiB request
cap, ``MAX_PART_BYTES``); the publisher checks the assembled plan (every rule of
``slice_plan``) and that it hashes to ``digest``, then keeps it in a bounded LRU.
``slice_sums`` lists, for each chunk the plan touches (ascending), the xxh3-64 of the
plan's bytes in that chunk: the reply to a ``slice_fetch`` is verified against it
before anything is staged. A chunk the plan covers whole has the manifest's own
checksum. A publisher that does not know these messages drops them (protocol 4
publishers before issue 30): the receiver times out and fetches whole chunks.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from weightpub_wire.message_base import (
    MAX_CHUNKS,
    MAX_CHUNKS_PER_FETCH,
    U63,
    U64,
    Name,
    Text,
    Version,
    _Message,
)
from weightpub_wire.slice_plan import MAX_PLAN_TENSORS, SliceRuns

__all__ = ["MAX_PART_BYTES", "MAX_PARTS", "SLICE_REPLIES", "SLICE_REQUESTS", "Digest",
           "SliceAck", "SliceFetch", "SliceRegister", "SliceSums", "SliceSumsReply"]

MAX_PART_BYTES = 48 << 10  # one registration frame (the ROUTER refuses frames past 64 KiB)
MAX_PARTS = 4096
Digest = Annotated[str, Meta(min_length=32, max_length=32, pattern="^[0-9a-f]{32}$")]


class SliceRegister(_Message, tag="slice_reg", kw_only=True, frozen=True):
    """Part ``part`` of ``parts`` of the plan ``digest`` (its tensors in order; a tensor
    whose runs do not fit one part continues, under the same name, in the next)."""

    req: U63
    digest: Digest
    layout: Text
    part: Annotated[int, Meta(ge=0, lt=MAX_PARTS)]
    parts: Annotated[int, Meta(ge=1, le=MAX_PARTS)]
    tensors: Annotated[tuple[SliceRuns, ...], Meta(max_length=MAX_PLAN_TENSORS)]

    def __post_init__(self) -> None:
        _Message.__post_init__(self)
        if self.part >= self.parts:
            raise ValueError(f"part: {self.part} is not below parts {self.parts}")


class SliceAck(_Message, tag="slice_ack", kw_only=True, frozen=True):
    """The plan is registered (every part in, checked, hashing to ``digest``)."""

    req: U63
    digest: Digest
    needed_bytes: U64 = 0


class SliceSums(_Message, tag="slice_sums", kw_only=True, frozen=True):
    """Ask for the plan's per-chunk checksums of one version."""

    req: U63
    publisher_id: Name
    version: Version
    digest: Digest


class SliceSumsReply(_Message, tag="slice_sums_rep", kw_only=True, frozen=True):
    """Per chunk the plan touches (ascending chunk ids), xxh3-64 of its planned bytes."""

    req: U63
    version: Version
    digest: Digest
    sums: Annotated[tuple[U64, ...], Meta(max_length=MAX_CHUNKS)]


class SliceFetch(_Message, tag="slice_fetch", kw_only=True, frozen=True):
    """The plan's bytes of some chunks of one version (the count is the credit)."""

    req: U63
    publisher_id: Name
    version: Version
    digest: Digest
    chunks: Annotated[tuple[Annotated[int, Meta(ge=0, le=MAX_CHUNKS)], ...],
                      Meta(max_length=MAX_CHUNKS_PER_FETCH)]


#: what a publisher's ROUTER may receive for slices; what a slice receiver may get back
SLICE_REQUESTS: tuple[type[_Message], ...] = (SliceRegister, SliceSums, SliceFetch)
SLICE_REPLIES: tuple[type[_Message], ...] = (SliceAck, SliceSumsReply)
