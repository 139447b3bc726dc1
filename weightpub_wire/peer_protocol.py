"""Peer sharing on the wire: how subscribers find each other through the publisher.

A subscriber started with ``peer_share=True`` serves the verified chunks it
holds on a ROUTER of its own, and asks the publisher's tracker where to fetch
from. The tracker answers with an *assignment* (a striped tree, see
``publisher/serving/tracker.py``): chunk ``c`` belongs to stripe ``c % stripes``; for
each stripe the subscriber gets a short chain of peers (its parent in that
stripe's tree, then the grandparent), and fetches from the first one that
works, then from the publisher. An empty chain means: from the publisher (this
subscriber is the stripe's root, or has no place in the plan yet)::

    DEALER -> ROUTER (publisher)  [ {t: "peer_hello", req, publisher_id, endpoint, version,
                                     plan} ]
    ROUTER -> DEALER              [ {t: "peer_plan", req, publisher_id, started_at, version,
                                     epoch, stripes, slot, sources, admit, other_plans,
                                     group} ]
    DEALER -> ROUTER (a peer)     the publisher's own ``fetch`` / ``chunk`` / ``error`` frames
                                  (a sliced member: ``slice_fetch``, ``slice_messages.py``)
    DEALER -> ROUTER (a peer)     [ {t: "peer_nixl", req, publisher_id, version} ]
    ROUTER -> DEALER              [ {t: "peer_nixl_offer", req, version, offer, why} ]
                                  (peers over NIXL, issue 31: the peer's NIXL offer of its
                                  staging of that version, or None and why)

Peers speak to each other exactly as a subscriber speaks to its publisher
(``FetchRequest``, ``ChunkHeader``, ``ErrorReply``; the same per-chunk
checksums from the publisher's manifest), so a peer can never make a
subscriber stage bytes the publisher did not announce. With CURVE, each
source's ``key`` is the public key the publisher authenticated that subscriber
with (its ZAP ``User-Id``, never a claim of the peer), and ``admit`` lists the
keys that may fetch from the receiving subscriber.

Sliced members (issue 30): a subscriber that fetches only a slice plan's bytes says
which plan in ``PeerHello.plan`` (the plan's digest, ``SlicePlan.digest()``; empty: a
whole-version member). The tracker plans each digest's members apart, so a sliced
member is only ever handed peers of the same plan (``PeerSource.plan`` says so, and
the member skips a source whose plan is not its own: a tracker before issue 30 does
not group), and asks them with ``slice_fetch`` (the planned bytes of a chunk, checked
against the publisher's ``slice_sums``). ``PeerPlan.other_plans`` counts the members
the tracker holds on other plans (what a member alone on its plan could have shared
with; ``group``, the members planned together with it). Older peers still parse
these messages: every new field has a default.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from weightpub_wire.message_base import U63, Name, Text, _FromPublisher, _Message
from weightpub_wire.nixl_link import NixlOffer

__all__ = [
    "MAX_ADMITTED_KEYS",
    "MAX_CHAIN",
    "MAX_STRIPES",
    "PEER_REPLIES",
    "PlanDigest",
    "PEER_NIXL_REPLIES",
    "PeerHello",
    "PeerNixl",
    "PeerNixlOffer",
    "PeerPlan",
    "PeerSource",
]

MAX_STRIPES = 16  # stripes (and tree arity) a tracker may hand out
MAX_CHAIN = 4  # peers listed per stripe before the publisher
MAX_ADMITTED_KEYS = 1024
# a CurveZMQ public key in Z85 (40 characters of the Z85 alphabet), or "" without CURVE
_Z85 = r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]"
Z85Key = Annotated[str, Meta(max_length=40, pattern=f"^({_Z85}{{40}})?$")]
#: a slice plan's digest (32 lowercase hex, ``SlicePlan.digest()``), or "" for whole versions
PlanDigest = Annotated[str, Meta(max_length=32, pattern="^([0-9a-f]{32})?$")]


class PeerHello(_Message, tag="peer_hello", kw_only=True, frozen=True):
    """A peer-sharing subscriber registers with the tracker and asks for its assignment.

    ``endpoint`` is where it serves peers (its peer ROUTER's bound address; a
    wildcard host is replaced by the address the publisher sees it connect
    from). ``version`` is the version it fetches or holds: a new version is
    where the tracker updates its plan. Sent about once a second (liveness).
    ``plan``: the digest of the slice plan it fetches and serves ("" for whole
    versions); the tracker plans each digest's members apart.
    """

    req: U63
    publisher_id: Name
    endpoint: Text
    version: U63 = 0
    plan: PlanDigest = ""


class PeerSource(msgspec.Struct, frozen=True):
    """A peer to fetch from: where it serves, its CURVE public key ("" without CURVE),
    and the slice plan it holds ("" for whole versions)."""

    endpoint: Text
    key: Z85Key = ""
    plan: PlanDigest = ""


class PeerPlan(_FromPublisher, tag="peer_plan", kw_only=True, frozen=True):
    """The tracker's answer: where this subscriber fetches each stripe from.

    ``stripes`` 0 means no assignment (fetch everything from the publisher).
    ``sources[s]`` is the chain for stripe ``s``, nearest first; the publisher
    is always the last resort. ``epoch`` changes whenever the plan changes.
    """

    req: U63
    version: U63
    epoch: U63
    stripes: Annotated[int, Meta(ge=0, le=MAX_STRIPES)]
    slot: Annotated[int, Meta(ge=-1, le=1 << 20)] = -1
    sources: Annotated[tuple[Annotated[tuple[PeerSource, ...], Meta(max_length=MAX_CHAIN)], ...],
                       Meta(max_length=MAX_STRIPES)] = ()
    admit: Annotated[tuple[Z85Key, ...], Meta(max_length=MAX_ADMITTED_KEYS)] = ()
    other_plans: Annotated[int, Meta(ge=0, le=1 << 32)] = 0  # members on other plans
    group: Annotated[int, Meta(ge=0, le=1 << 32)] = 0  # members in this one's plan (it too)

    def __post_init__(self) -> None:
        _Message.__post_init__(self)
        if len(self.sources) != self.stripes:
            raise ValueError(f"sources: {len(self.sources)} chains for {self.stripes} stripes")


#: what a subscriber's DEALER may receive from the publisher besides the core replies
PEER_REPLIES: tuple[type[_Message], ...] = (PeerPlan,)


class PeerNixl(_Message, tag="peer_nixl", kw_only=True, frozen=True):
    """Peers over NIXL (issue 31): may this member READ ``version`` one-sided where it
    sits in the peer's staging? Asked on the peer ROUTER (CURVE: admitted keys only),
    once per peer and version; the answer is a ``PeerNixlOffer``. Not in ``PeerPlan``:
    the tracker would carry every member's agent metadata to every member."""

    req: U63
    publisher_id: Name
    version: U63


class PeerNixlOffer(_Message, tag="peer_nixl_offer", kw_only=True, frozen=True):
    """The answer: the peer's offer of the version's staging (a readiness map while it is
    still arriving: ``NixlOffer.ready``), or None and why (counted there as
    ``unoffered``): frames then."""

    req: U63
    version: U63
    offer: NixlOffer | None = None
    why: Text = ""


#: what a peer's DEALER may receive besides chunks and errors
PEER_NIXL_REPLIES: tuple[type[_Message], ...] = (PeerNixlOffer,)
