"""Where each chunk comes from: the tracker's plan, one DEALER per peer, and the fallbacks.

Chunk ``c`` is in stripe ``c % stripes``; the plan (``PeerPlan``) gives each
stripe a chain of peers, nearest first (the parent in that stripe's tree, then
the grandparent). A chunk is asked of the first peer of its chain that has not
failed this version, lowest chunks first, at most ``window`` chunks ahead per
peer: the peer holds back what it has not verified yet and sends it the moment
it has (cut-through), so the next chunk is always already asked for. A chunk
whose chain is empty (this subscriber is the stripe's root, or has no plan) or
used up goes to the publisher, under the publisher's credit as before.

A peer fails for the version (its outstanding chunks are asked of the next
source, and it is not asked again for that version) when it answers with an
error, sends a chunk that fails its checksum or has the wrong size (it is then
also banned for ``ban_seconds``), disconnects, or makes no progress for
``stall_timeout`` while chunks are outstanding (or for ``timeout``, the
subscriber's ``request_timeout``, while it cannot be sent to at all).
``stall_timeout`` scales with the version's chunk size (``stall_timeout()``: about
1 s for the default chunks; a peer slower than that is better skipped). A peer that
stalls is also backed off for later versions: ``BACKOFF_S`` doubled per stall in
a row, at most ``BACKOFF_MAX_S``, forgotten at its next chunk (until then, once
its backoff is over, it is asked one chunk at a time: ``route``); kept (for
``MAX_SHUNNED`` endpoints) when the peer leaves the plan, so leaving and joining
again does not reset it. So a stranger that joins the plan and never serves (a
sybil) costs one stall time now and then, not one per version.

A peer that refuses the CURVE handshake (it has not learnt this subscriber's key
from the tracker yet) is dialled again every ``REDIAL_AFTER`` seconds until that
timeout. None of this counts against ``max_chunk_retries``: a bad peer costs a
retry from another source, never the version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from weightpub_wire.chunk_frame import PayloadPairing
from weightpub_wire.endpoints import is_wildcard, parse_endpoint
from weightpub_wire.errors import ProtocolError
from weightpub_wire.monitored_dealer import LINK_EVENTS, MonitoredDealer
from weightpub_wire.peer_protocol import PeerPlan, PeerSource
from weightpub_wire.ratelog import RateLimitedLog
from weightpub_wire.security import SocketHook

__all__ = ["PeerLink", "Sources", "VersionKey"]

log = logging.getLogger("weightpub.peers")

VersionKey = tuple[str, int]  # (publisher_id, version)
REDIAL_AFTER = 0.25  # seconds after a refused handshake
STALL_FLOOR_S = 1.0  # a peer's first chunk may wait for its own source (cut-through)
STALL_MIN_BYTES_PER_S = 8 << 20  # then one chunk per this rate, or the peer is skipped
BACKOFF_S = 10.0  # a peer that stalled is skipped this long, doubled per stall in a row
BACKOFF_MAX_S = 300.0
MAX_SHUNNED = 1024  # backoffs and bans kept for peers no longer in the plan


@dataclass(eq=False, slots=True)
class PeerLink:
    """One DEALER to one peer, and what this subscriber knows about that peer."""

    endpoint: str
    key: str
    dealer: MonitoredDealer  # its socket and monitor (monitored_dealer.py)
    last_progress: float = 0.0  # a chunk arrived, or the first request went out
    blocked_since: float | None = None  # sends refused (not connected yet)
    down: bool = False  # disconnected, and not connected again since
    refused_at: float | None = None  # the peer refused our handshake (dialled again soon)
    failed: set[VersionKey] = field(default_factory=set)
    banned_until: float = 0.0
    #: a header (chunk_frame.FOLLOWS) whose payload is this socket's next message
    pairing: PayloadPairing = field(default_factory=PayloadPairing)
    stalls: int = 0  # stalls in a row (backoff); 0 again at its next chunk

    @property
    def sock(self) -> zmq.Socket:
        return self.dealer.sock

    @property
    def monitor(self) -> zmq.Socket:
        return self.dealer.monitor

    def usable(self, key: VersionKey, now: float) -> bool:
        return not self.down and key not in self.failed and now >= self.banned_until


class Sources:
    """The links the current plan names; runs on the subscriber's thread."""

    def __init__(self, ctx: zmq.Context, hooks_for: Callable[[str], list[SocketHook]], *,
                 window: int, timeout: float, max_message_bytes: int,
                 on_open: Callable[[PeerLink], None], on_close: Callable[[PeerLink], None],
                 ban_seconds: float = 60.0, digest: str = "") -> None:
        """``digest``: the slice plan this subscriber holds ("" for whole versions): a
        source of another plan is skipped (``other_plan``, a tracker before issue 30)."""
        self.ctx = ctx
        self.hooks_for = hooks_for  # the CURVE client hook for a peer's key (or none)
        self.window = window
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes
        self.on_open = on_open
        self.on_close = on_close
        self.ban_seconds = ban_seconds
        self.digest = digest
        self.stall_timeout = stall_timeout(0, timeout)
        self.links: dict[str, PeerLink] = {}
        self.chains: list[list[PeerLink]] = []
        self._shunned: dict[str, tuple[int, float]] = {}  # endpoint -> (stalls, banned until)
        self.failures: dict[str, int] = {}  # by kind
        self._warn = RateLimitedLog(log)

    @property
    def stripes(self) -> int:
        return len(self.chains)

    def chunk_size(self, size: int) -> None:
        """The version being fetched has chunks of ``size`` bytes: its stall timeout."""
        self.stall_timeout = stall_timeout(size, self.timeout)

    # -- the plan ------------------------------------------------------------------------------
    def apply(self, plan: PeerPlan, curve: bool) -> list[PeerLink]:
        """Follow a new plan; returns the links it no longer names (their requests must go)."""
        chains: list[list[PeerLink]] = []
        wanted: dict[str, PeerLink] = {}
        for chain in plan.sources:
            links = []
            for source in chain:
                link = self._link(source, curve, wanted)
                if link is not None:
                    links.append(link)
            chains.append(links)
        gone = [link for endpoint, link in self.links.items() if wanted.get(endpoint) is not link]
        for link in gone:
            self._close(link)
        self.links, self.chains = wanted, chains
        return gone

    def _link(self, source: PeerSource, curve: bool,
              wanted: dict[str, PeerLink]) -> PeerLink | None:
        if source.endpoint in wanted:
            return wanted[source.endpoint]
        try:
            endpoint = parse_endpoint(source.endpoint, error=ProtocolError)
            if is_wildcard(endpoint) or (endpoint.scheme == "tcp" and not endpoint.port):
                raise ProtocolError(f"peer_plan.sources: {source.endpoint!r} is not reachable")
            if source.plan != self.digest:
                raise ProtocolError(f"peer_plan.sources: {source.endpoint!r} holds slice plan "
                                    f"{source.plan or '(whole versions)'}, this subscriber "
                                    f"{self.digest or '(whole versions)'}")
            if curve != bool(source.key):
                raise ProtocolError(f"peer_plan.sources: {source.endpoint!r} "
                                    f"{'has no' if curve else 'has a'} CURVE key, this "
                                    f"subscriber {'uses' if curve else 'does not use'} CURVE")
        except ProtocolError as exc:
            self._count("bad_source")
            self._warn.warning("source", f"skipping a peer the tracker named: {exc}")
            return None
        old = self.links.get(source.endpoint)
        if old is not None and old.key == source.key:
            wanted[source.endpoint] = old
            return old
        link = PeerLink(source.endpoint, source.key, self._connect(source.endpoint, source.key))
        link.stalls, link.banned_until = self._shunned.pop(source.endpoint, (0, 0.0))
        wanted[source.endpoint] = link
        self.on_open(link)
        return link

    def _connect(self, endpoint: str, key: str) -> MonitoredDealer:
        # the receive queue keeps ZeroMQ's default bound (a peer is asked a few chunks at
        # a time); the monitor also reports disconnects: a dead peer is skipped at once
        return MonitoredDealer(self.ctx, endpoint, hooks=self.hooks_for(key),
                               handshake_timeout=self.timeout,
                               max_message_bytes=self.max_message_bytes,
                               unbounded_receive=False, events=LINK_EVENTS)

    def redial(self, now: float) -> None:
        """Dial again the peers that refused our handshake a moment ago: ZeroMQ gives up on a
        refused connection, and a peer learns a new member's key at its next hello."""
        for link in self.links.values():
            if link.refused_at is not None and now - link.refused_at >= REDIAL_AFTER:
                self.on_close(link)
                link.dealer.close()
                link.dealer = self._connect(link.endpoint, link.key)
                link.refused_at = None
                self.on_open(link)

    def _close(self, link: PeerLink) -> None:
        if link.stalls or link.banned_until:  # a member that leaves the plan and comes back
            self._shunned[link.endpoint] = (link.stalls, link.banned_until)  # is still
            while len(self._shunned) > MAX_SHUNNED:  # backed off (or banned)
                del self._shunned[next(iter(self._shunned))]
        self.on_close(link)
        link.dealer.close()

    def close(self) -> None:
        for link in self.links.values():
            self._close(link)
        self.links, self.chains = {}, []

    # -- choosing ------------------------------------------------------------------------------
    def route(self, todo: list[int], key: VersionKey, in_flight: dict[PeerLink, int],
              now: float) -> tuple[dict[PeerLink, list[int]], list[int]]:
        """Split ``todo`` (ascending) into chunks to ask of each peer now and chunks for
        the publisher; a chunk whose peer has no room waits for that peer. A peer on
        probation (it stalled, its backoff is over) is asked one chunk at a time until
        it sends one; the rest of its stripe goes on to the next source meanwhile, so
        probing a peer that still stalls costs one chunk's wait, not the stripe's."""
        to_peers: dict[PeerLink, list[int]] = {}
        to_publisher: list[int] = []
        stripes = self.stripes
        for chunk in todo:
            link = None
            if stripes:
                link = next((lk for lk in self.chains[chunk % stripes] if lk.usable(key, now)
                             and not (lk.stalls and in_flight.get(lk, 0)
                                      + len(to_peers.get(lk, ())) >= 1)), None)
            if link is None:
                to_publisher.append(chunk)
                continue
            batch = to_peers.setdefault(link, [])
            if in_flight.get(link, 0) + len(batch) < self.window:
                batch.append(chunk)
        return {link: batch for link, batch in to_peers.items() if batch}, to_publisher

    # -- what happened -------------------------------------------------------------------------
    def sent(self, link: PeerLink, had_outstanding: bool, now: float) -> None:
        link.blocked_since = None
        if not had_outstanding:
            link.last_progress = now

    def blocked(self, link: PeerLink, now: float) -> None:
        if link.blocked_since is None:
            link.blocked_since = now

    def arrived(self, link: PeerLink, now: float) -> None:
        link.last_progress = now
        link.stalls = 0

    def fail(self, link: PeerLink, key: VersionKey | None, kind: str, why: str,
             now: float, *, ban: bool = False) -> None:
        """``link`` failed for version ``key`` (and is banned a while when ``ban``)."""
        self._count(kind)
        if key is not None:
            link.failed.add(key)
            if len(link.failed) > 16:
                link.failed.discard(min(link.failed, key=lambda k: k[1]))
        if ban:
            link.banned_until = now + self.ban_seconds
        elif kind == "timeout":  # a stall: skip it for a while after this version too
            link.stalls += 1
            backoff = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** min(link.stalls - 1, 16))
            link.banned_until = max(link.banned_until, now + backoff)
        link.blocked_since = None
        self._warn.warning(kind, f"peer {link.endpoint}: {why}; asking the next source")

    def expired(self, in_flight: dict[PeerLink, int], now: float) -> list[PeerLink]:
        """Links with chunks outstanding and no progress for ``stall_timeout``, or
        unsendable for ``timeout``."""
        out = []
        for link in self.links.values():
            if link.down:
                continue
            if in_flight.get(link, 0) and now - link.last_progress > self.stall_timeout:
                out.append(link)
            elif link.blocked_since is not None and now - link.blocked_since > self.timeout:
                out.append(link)
        return out

    def watch(self, link: PeerLink, now: float) -> bool:
        """Read the link's monitor; True when it has just gone down (disconnected, or a
        connection attempt was refused). A link that is down is skipped (a dead peer costs
        the next version nothing) until it connects again."""
        lost = False
        for event in link.dealer.events():
            if event.event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.down, link.blocked_since = False, None
            elif event.event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED):
                # gone, or its port refuses connections (a member that died, still planned)
                link.down = lost = True
                link.blocked_since = None  # skipped from now on: nothing waits for it
            else:  # refused: dialled again after REDIAL_AFTER; the timeout decides
                self._count("handshake")
                self.blocked(link, now)
                link.refused_at = now
        return lost

    def _count(self, kind: str) -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1

    def stats(self) -> dict[str, object]:
        now = time.monotonic()
        return {"sources": sorted(self.links), "stripes": self.stripes,
                "peer_failures": dict(self.failures), "stall_timeout": self.stall_timeout,
                "backed_off": sorted(lk.endpoint for lk in self.links.values()
                                     if lk.stalls and lk.banned_until > now)}


def stall_timeout(chunk_bytes: int, request_timeout: float) -> float:
    """How long a peer may hold our outstanding chunks without sending one, for chunks of
    ``chunk_bytes``: ``STALL_FLOOR_S`` (or a shorter ``request_timeout``) for the latency,
    plus one chunk at ``STALL_MIN_BYTES_PER_S``. Not ``request_timeout`` alone (it was, a
    fixed 5 s): too long for small chunks (every stalling peer cost that much per
    version), too short for big ones over a slow link."""
    return min(request_timeout, STALL_FLOOR_S) + chunk_bytes / STALL_MIN_BYTES_PER_S
