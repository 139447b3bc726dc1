"""The tracker: which peer-sharing subscriber fetches each chunk from whom.

Why an assignment and not a BitTorrent swarm: a swarm (peers trade bitmaps,
pick the rarest chunk, choke free-riders) solves strangers who come and go and
may cheat; here the tracker knows every replica and they cooperate, so it can
hand out a plan in which every chunk crosses the trainer's uplink once and
every host's uplink carries about one version, with no bitmaps on the wire.

The plan is a set of striped trees (SplitStream, Castro et al. 2003). The
members (peer-sharing subscribers) hold slots ``0..n-1``; with ``T =
min(fanout, n)`` stripes, chunk ``c`` belongs to stripe ``c % T``. The tree of
stripe ``g`` lists the slots of group ``g`` (``slot % T == g``) first, then
every other slot (rotated by stripe, so the member that follows the group
differs from stripe to stripe), as a complete T-ary heap (the parent of
position ``q`` is ``(q - 1) // T``). So only group ``g`` forwards stripe ``g``, each member to
at most ``T`` children, and every member is a leaf in the other trees: a
member downloads a version once and uploads about one version; the root of
stripe ``g`` (slot ``g``) fetches it from the publisher. A chunk is at every
host after about ``T * (1 + log_T n)`` chunk times behind the trainer's stream.

The plan changes only where a new version starts (a member says it fetches a
version newer than the plan's): members that died leave (the last slot moves
into the hole), new members are appended. Between those points a member that
died is skipped (its children are sent to their grandparent; anyone may also
fall back to the publisher), and a member that joined fetches from the
publisher until the next version. Bounds: ``max_members`` (the rest get no
plan), ``member_ttl`` (no hello for that long: gone), ``chain`` (peers listed
per stripe before the publisher); a reply lists at most ``MAX_STRIPES`` chains
and ``MAX_ADMITTED_KEYS`` keys. Without CURVE a member is whoever connects, so one
host could fill the plan with members that never serve (sybils):
``max_members_per_address`` bounds the plaintext members per address the
publisher sees them connect from (the IP, not the advertised endpoint, which a
member chooses); one more gets an empty plan (the publisher serves it) until one
leaves. The default, 4, is a host's honest share on a trusted network (replicas
per host; plaintext peers off loopback need ``insecure``); tests and single-host
fleets with more plaintext members on 127.0.0.1 raise it; 0 turns it off. With
CURVE every member is an authenticated key and the key allow-list is the bound;
``admit`` tells each member which keys may fetch from it: those the publisher
authenticated (``ADMIT_ALL_UP_TO``).

Sliced members (issue 30): each member says which slice plan it fetches and serves
(``PeerHello.plan``, a digest; "" for whole versions), and the tracker keeps one
set of striped trees per digest (``Plan``, each with its own epoch from one counter),
so a member is only handed peers that hold the same bytes: the ranks of replicas
with the same layout share with each other, whole-version members with whole-version
members, and a member alone on its plan fetches from the publisher (``other_plans``
in its answer counts the members on other plans). ``max_members`` counts all
members together; ``max_members_per_address`` counts per plan (a host running one
TP=8 replica holds 8 sliced members, one per plan: its honest share of each plan is
its replicas, as for whole-version members; a sybil only ever joins one group).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from itertools import count

from weightpub_wire.endpoints import Endpoint, is_wildcard, parse_endpoint
from weightpub_wire.errors import ProtocolError
from weightpub_wire.peer_protocol import (
    MAX_ADMITTED_KEYS,
    MAX_CHAIN,
    MAX_STRIPES,
    PeerHello,
    PeerPlan,
    PeerSource,
)
from weightpub_wire.ratelog import RateLimitedLog

__all__ = ["Plan", "Tracker", "TrackerLimits"]

log = logging.getLogger("weightpub.publisher")
#: up to this many members, each member admits every member's key (a member that joins or
#: falls back never waits for its new source to learn its key); above, only the members
#: below it in its trees (``chain`` levels: those that may ask it)
ADMIT_ALL_UP_TO = 64


@dataclass(frozen=True, slots=True)
class TrackerLimits:
    fanout: int = 4  # stripes, and the arity of each stripe's tree; 0 turns peer sharing off
    max_members: int = 4096
    member_ttl: float = 4.0  # seconds without a hello before a member is gone
    chain: int = 2  # peers listed per stripe (parent, grandparent), then the publisher
    max_members_per_address: int = 4  # plaintext members per connecting IP (and slice plan)

    def __post_init__(self) -> None:
        if self.max_members_per_address < 0:
            raise ValueError(f"max_members_per_address: {self.max_members_per_address} is "
                             "negative")
        if not 0 <= self.fanout <= MAX_STRIPES:
            raise ValueError(f"fanout: {self.fanout} is outside [0, {MAX_STRIPES}]")
        if not 1 <= self.chain <= MAX_CHAIN:
            raise ValueError(f"chain: {self.chain} is outside [1, {MAX_CHAIN}]")


@dataclass(slots=True)
class _Member:
    endpoint: str
    key: str
    last_seen: float
    joined: int
    address: str = ""  # where the publisher sees it connect from ("" with CURVE: not counted)
    plan: str = ""  # the slice plan's digest it holds ("" for whole versions)


class Plan:
    """Striped T-ary trees over a fixed list of members (identities by slot)."""

    def __init__(self, slots: list[bytes], fanout: int, version: int, epoch: int,
                 digest: str = "") -> None:
        self.digest = digest  # the slice plan its members hold ("" for whole versions)
        self.slots = slots
        self.version = version
        self.epoch = epoch
        n = len(slots)
        self.stripes = min(fanout, n)
        self.slot_of = {identity: slot for slot, identity in enumerate(slots)}
        self.orders: list[list[int]] = []  # per stripe: slot at each tree position
        self.positions: list[list[int]] = []  # per stripe: tree position of each slot
        for g in range(self.stripes):
            # where group g runs out of interior positions, a different member per stripe
            # takes the spill-over (rotating the others keeps any one member's upload low)
            others = [s for s in range(n) if s % self.stripes != g]
            turn = g * len(others) // self.stripes
            order = list(range(g, n, self.stripes)) + others[turn:] + others[:turn]
            position = [0] * n
            for q, slot in enumerate(order):
                position[slot] = q
            self.orders.append(order)
            self.positions.append(position)

    def ancestors(self, slot: int, stripe: int) -> list[int]:
        """The slots above ``slot`` in ``stripe``'s tree, nearest first (empty for the root)."""
        out = []
        q = self.positions[stripe][slot]
        while q > 0:
            q = (q - 1) // self.stripes
            out.append(self.orders[stripe][q])
        return out

    def descendants(self, slot: int, stripe: int, depth: int) -> list[int]:
        """The slots below ``slot`` in ``stripe``'s tree, down to ``depth`` levels."""
        order, arity = self.orders[stripe], self.stripes
        out: list[int] = []
        level = [self.positions[stripe][slot]]
        for _ in range(depth):
            level = [c for q in level for c in range(arity * q + 1, arity * q + arity + 1)
                     if c < len(order)]
            out.extend(order[c] for c in level)
        return out


class Tracker:
    """Runs on the publisher's serving thread; answers each ``PeerHello`` with a ``PeerPlan``."""

    def __init__(self, limits: TrackerLimits, publisher_id: str, started_at: float) -> None:
        self.limits = limits
        self.publisher_id = publisher_id
        self.started_at = started_at
        self._members: dict[bytes, _Member] = {}
        self._plans: dict[str, Plan] = {"": Plan([], limits.fanout, 0, 0)}  # by digest
        self._per_plan: Counter[str] = Counter()  # members by digest
        self._epochs = count(1)
        self._joined = count()
        self._next_expiry = 0.0
        self._warn = RateLimitedLog(log)
        self.refused = 0
        self.refused_address = 0  # hellos over ``max_members_per_address`` (empty plans)

    @property
    def enabled(self) -> bool:
        return self.limits.fanout > 0

    @property
    def plan(self) -> Plan:
        """The whole-version members' plan."""
        return self._plans[""]

    def plan_for(self, digest: str) -> Plan | None:
        """The plan of the members that hold slice plan ``digest`` ("": whole versions)."""
        return self._plans.get(digest)

    def members(self) -> int:
        return len(self._members)

    def hello(self, identity: bytes, hello: PeerHello, peer_address: str | None,
              client_key: str | None, now: float, latest: int) -> PeerPlan:
        """Register (or refresh) a member and return its assignment.

        Raises ``ProtocolError`` naming what is wrong (the hello is then ignored).
        """
        if hello.publisher_id != self.publisher_id:
            raise ProtocolError(f"peer_hello.publisher_id: {hello.publisher_id[:32]} is not this "
                                "publisher instance")
        endpoint = advertised_endpoint(hello.endpoint, peer_address)
        self._expire(now)
        member = self._members.get(identity)
        if member is None:
            if len(self._members) >= self.limits.max_members:
                self.refused += 1
                raise ProtocolError(f"peer_hello: the tracker holds {len(self._members)} members "
                                    "(max_members); fetch from the publisher")
            for old_id, old in list(self._members.items()):  # a member that reconnected
                if old.endpoint == endpoint and old.key == (client_key or ""):
                    self._rename(old_id, identity)
            member = self._members.get(identity)
            if member is None:
                address = "" if client_key else (peer_address or "local")
                if self._crowded(address, hello.plan):
                    self.refused_address += 1
                    self._warn.warning("address", f"tracker: {address} has "
                                       f"{self.limits.max_members_per_address} plaintext "
                                       "members already (max_members_per_address); the "
                                       "publisher serves one more")
                    return self._assignment(identity, hello.req, hello.plan)  # not planned
                member = _Member(endpoint, client_key or "", now, next(self._joined), address,
                                 hello.plan)
                self._per_plan[member.plan] += 1
            self._members[identity] = member
        member.endpoint, member.key, member.last_seen = endpoint, client_key or "", now
        if member.plan != hello.plan:  # another plan now (a new layout): it leaves its old
            self._per_plan[member.plan] -= 1  # group (skipped there as a dead member is)
            self._per_plan[hello.plan] += 1
            member.plan = hello.plan
        self._maybe_replan(hello.plan, min(hello.version, latest))
        return self._assignment(identity, hello.req)

    def _crowded(self, address: str, plan: str) -> bool:
        bound = self.limits.max_members_per_address
        if not address or not bound:
            return False
        return sum(1 for m in self._members.values()
                   if m.address == address and m.plan == plan) >= bound

    # -- the plan ------------------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        if now < self._next_expiry:
            return
        self._next_expiry = now + 0.25
        for identity, member in list(self._members.items()):
            if now - member.last_seen > self.limits.member_ttl:
                del self._members[identity]
                self._per_plan[member.plan] -= 1
                log.info("tracker: member %s gone (no hello for %.1fs)", member.endpoint,
                         now - member.last_seen)

        for digest in [d for d in self._plans if d and self._per_plan[d] <= 0]:
            del self._plans[digest]  # nobody holds this slice plan any more
            del self._per_plan[digest]

    def _rename(self, old: bytes, new: bytes) -> None:
        self._members[new] = self._members.pop(old)
        for plan in self._plans.values():
            if old in plan.slot_of:  # keep its slot: nothing else in the plan moves
                plan.slots[plan.slot_of[old]] = new
                plan.slot_of[new] = plan.slot_of.pop(old)

    def _in_group(self, identity: bytes, digest: str) -> bool:
        member = self._members.get(identity)
        return member is not None and member.plan == digest

    def _maybe_replan(self, digest: str, version: int) -> None:
        plan = self._plans.get(digest)
        if plan is None:  # the first member on this slice plan
            plan = self._plans[digest] = Plan([], self.limits.fanout, 0, 0, digest)
        if version < plan.version or (version == plan.version and plan.version > 0):
            return
        alive = all(self._in_group(identity, digest) for identity in plan.slots)
        newcomers = sorted((i for i, m in self._members.items()
                            if m.plan == digest and i not in plan.slot_of),
                           key=lambda i: self._members[i].joined)
        if alive and not newcomers:
            plan.version = version
            return
        slots = list(plan.slots)
        hole = 0
        while hole < len(slots):  # the last member moves into each hole left by a dead one
            if self._in_group(slots[hole], digest):
                hole += 1
                continue
            last = slots.pop()
            if hole < len(slots):
                slots[hole] = last
        slots += newcomers
        if not slots and digest:  # nobody holds this slice plan any more: forget it
            del self._plans[digest]
            return
        plan = self._plans[digest] = Plan(slots, self.limits.fanout, version,
                                          next(self._epochs), digest)
        log.info("tracker: plan %d for version %d%s: %d members, %d stripes", plan.epoch,
                 version, f" (slice plan {digest[:8]})" if digest else "", len(slots),
                 plan.stripes)

    def _assignment(self, identity: bytes, req: int, digest: str = "") -> PeerPlan:
        member = self._members.get(identity)
        digest = digest if member is None else member.plan
        plan = self._plans.get(digest) or Plan([], self.limits.fanout, 0, 0, digest)
        others = len(self._members) - self._per_plan[digest]
        slot = plan.slot_of.get(identity)
        if slot is None:  # not in this version's plan (joined since): the publisher serves it
            return PeerPlan(req=req, publisher_id=self.publisher_id, started_at=self.started_at,
                            version=plan.version, epoch=plan.epoch, stripes=0,
                            other_plans=others)
        chains = []
        admit: dict[str, None] = {}
        small = len(plan.slots) <= ADMIT_ALL_UP_TO
        for stripe in range(plan.stripes):
            live = [plan.slots[s] for s in plan.ancestors(slot, stripe)
                    if self._in_group(plan.slots[s], digest)]
            chains.append(tuple(PeerSource(self._members[i].endpoint, self._members[i].key,
                                           digest) for i in live[: self.limits.chain]))
            below = range(len(plan.slots)) if small else \
                plan.descendants(slot, stripe, self.limits.chain)
            for s in below:
                member = self._members.get(plan.slots[s])
                if member is not None and member.key:
                    admit[member.key] = None
        return PeerPlan(req=req, publisher_id=self.publisher_id, started_at=self.started_at,
                        version=plan.version, epoch=plan.epoch, stripes=plan.stripes, slot=slot,
                        sources=tuple(chains), admit=tuple(admit)[:MAX_ADMITTED_KEYS],
                        other_plans=others, group=len(plan.slots))


def advertised_endpoint(endpoint: str, peer_address: str | None) -> str:
    """Where other subscribers reach a member: its bound address, a wildcard host replaced
    by the address the publisher sees it connect from."""
    parsed = parse_endpoint(endpoint, error=ProtocolError)
    if parsed.scheme != "tcp":
        return str(parsed)
    if not parsed.port:
        raise ProtocolError(f"peer_hello.endpoint: {endpoint!r} has no port")
    if is_wildcard(parsed):
        if not peer_address:
            raise ProtocolError(f"peer_hello.endpoint: {endpoint!r} binds a wildcard and the "
                                "connection has no peer address to put in its place")
        return str(Endpoint("tcp", peer_address, parsed.port))
    return str(parsed)
