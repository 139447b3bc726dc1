"""What the node owner tells one follower rank about a version, and what it holds for it.

Why apart from ``node_owner.py`` (the owner's threads and connections): an
``Offer`` of a staged version and a ``Partial`` of an arriving one each decide
whether the follower still needs the segment's descriptor (sent once per
segment) and, for partials, which ready tensors it has not heard of yet. That
bookkeeping per follower is the protocol's state; the owner only queues the
messages these functions build.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field

from subscriber_ext.transport.node.node_channel import Channel, Offer, Partial
from subscriber_ext.transport.node.shared_segments import Segment
from subscriber_ext.transport.staging.assembly import StagedVersion
from subscriber_ext.transport.staging.progress import PartialVersion

__all__ = ["PARTIALS_KEPT", "Follower", "Share", "offer_for", "partial_for"]

PARTIALS_KEPT = 4  # attempts a follower was told about, remembered per follower


@dataclass(slots=True)
class Share:
    """A staged version in a shared segment, and who still holds it (the owner: -1)."""

    share_id: int
    staged: StagedVersion
    segment: Segment
    holders: set[int]


@dataclass(slots=True)
class Follower:
    """One attached local rank: its channel, and what it was told already."""

    conn_id: int
    channel: Channel
    rank: int | None = None  # set by its hello
    known_segments: set[int] = field(default_factory=set)
    #: attempt -> how many of its ready tensors were sent to it
    partials: OrderedDict[int, int] = field(default_factory=OrderedDict)


def _descriptor_for(follower: Follower, segment: Segment) -> int | None:
    """A duplicate of ``segment``'s descriptor if ``follower`` has not had it (ours to
    close once sent, whatever happens to the segment); None when it has."""
    if segment.segment_id in follower.known_segments:
        return None
    follower.known_segments.add(segment.segment_id)
    return os.dup(segment.fd)


def offer_for(follower: Follower, share: Share) -> tuple[Offer, int | None]:
    """The ``Offer`` of ``share`` to ``follower`` (who now holds it) and any descriptor."""
    segment = share.segment
    fd = _descriptor_for(follower, segment)
    share.holders.add(follower.conn_id)
    offer = Offer(share=share.share_id, segment=segment.segment_id,
                  segment_bytes=segment.nbytes, fd_attached=fd is not None,
                  manifest=share.staged.manifest,
                  fetch_seconds=max(0.0, share.staged.fetch_seconds),
                  data_path=share.staged.data_path,
                  attempt=share.staged.attempt)
    return offer, fd


def partial_for(follower: Follower, partial: PartialVersion,
                segment: Segment) -> tuple[Partial, int | None] | None:
    """The tensors of ``partial`` that became ready since ``follower`` last heard (the
    first message of an attempt carries its manifest); None for a cancelled reception
    it never heard of."""
    first = partial.attempt not in follower.partials
    if first and partial.cancelled:
        return None
    fd = None
    if first:
        fd = _descriptor_for(follower, segment)
        follower.partials[partial.attempt] = 0
        while len(follower.partials) > PARTIALS_KEPT:
            follower.partials.popitem(last=False)
    sent = follower.partials[partial.attempt]
    ready = tuple(partial.ready_order[sent:])
    follower.partials[partial.attempt] = sent + len(ready)
    message = Partial(attempt=partial.attempt, ready=ready,
                      cancelled=partial.cancelled, segment=segment.segment_id,
                      segment_bytes=segment.nbytes, fd_attached=fd is not None,
                      manifest=partial.manifest if first else None)
    return message, fd
