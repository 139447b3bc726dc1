"""Per-peer credit on the ROUTER: what one client may make the publisher hold.

Every reply to a peer is sent tracked (``zmq.MessageTracker`` says when ZeroMQ
has written the frame to the kernel), so for each peer the serving thread knows
the bytes it handed to ZeroMQ that have not left yet. A chunk goes without a copy
(``weightpub_wire.chunk_frame``, ``FOLLOWS``): a 32-byte header message, then the
chunk's bytes straight from the snapshot (``copy=False``), counted in the buffer's
claims until ZeroMQ has sent them, so no newer snapshot overwrites them meanwhile
(``publisher/store/buffer_claims.py``). A delta payload goes the same way from the
encoder's bytes. Nothing is copied per subscriber.

Bounds, per peer (a ROUTER identity):

- ``max_queued_bytes``: beyond it, chunks wait in the peer's own deferred queue
  (sent as the peer drains) and control replies (latest, status) are dropped;
  ``max_total_queued_bytes`` does the same across all peers;
- ``max_pending_chunks``: a fetch that would take a peer past it is refused and
  the peer's connection is cut (a well-behaved subscriber keeps at most
  ``MAX_CREDIT_CHUNKS`` in flight);
- the host budget (``host_budget_bytes``): frames that own memory beyond the
  snapshots (control replies) stay within what the snapshots leave of it (at
  least one frame is always in flight); chunk frames are the snapshot's own bytes;
- ``stall_timeout``: a peer with bytes queued and no progress for this long (it
  never reads) is cut (the clock starts when its queue stops being empty: a peer
  idle between versions has not stalled); ZeroMQ then drops its queue and the
  bytes it held are freed; while a new snapshot waits to overwrite bytes ZeroMQ
  still sends, a peer with no progress for ``overwrite_grace`` is cut (the
  writer's wait stays short);
- deferred chunks of a version that was evicted are dropped with a
  ``version_unavailable`` reply, so nothing deferred pins an old version; so is a
  chunk found already claimed by a newer snapshot when its send would begin
  (``PublishedVersion.send_begin``): the subscriber moves to the newer version.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from publisher.serving.connections import ConnectionGuard
from publisher.store.version_store import PublishedVersion
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.ratelog import RateLimitedLog

__all__ = ["MAX_CREDIT_CHUNKS", "Peer", "PeerLimits", "PeerTable"]

log = logging.getLogger("weightpub.publisher")

MAX_CREDIT_CHUNKS = wire.MAX_CHUNKS_IN_FLIGHT  # a subscriber never has more in flight


@dataclass(frozen=True, slots=True)
class PeerLimits:
    max_queued_bytes: int = 64 << 20
    max_total_queued_bytes: int = 2 << 30
    max_pending_chunks: int = 4 * MAX_CREDIT_CHUNKS
    stall_timeout: float = 30.0
    overwrite_grace: float = 2.0  # no progress while a snapshot waits for its bytes: cut
    max_peers: int = 4096
    idle_forget: float = 120.0


@dataclass(slots=True)
class Peer:
    identity: bytes
    fd: int | None
    last_seen: float
    last_progress: float
    #: frames handed to ZeroMQ: (tracker, bytes, what to do once ZeroMQ let go of it)
    queue: deque[tuple[zmq.MessageTracker, int, Callable[[], None] | None]] = field(
        default_factory=deque)
    queued_bytes: int = 0
    #: a chunk's payload due right after the header already sent (the pipe was full),
    #: its release, and whether it is a copy of its own (counted in the host budget)
    owed: tuple[memoryview | bytes, Callable[[], None] | None, bool] | None = None
    deferred: deque[tuple[int, PublishedVersion, int]] = field(default_factory=deque)

    @property
    def pending(self) -> int:
        return len(self.queue) + len(self.deferred)


class PeerTable:
    """Runs on the serving thread only (it sends on the ROUTER)."""

    def __init__(self, router: zmq.Socket, limits: PeerLimits, guard: ConnectionGuard | None,
                 is_held: Callable[[PublishedVersion], bool],
                 budget_room: Callable[[], int] | None = None) -> None:
        """``budget_room``: what the host budget leaves beside the snapshots; the scratch
        (queued frames and idle reuse buffers) stays within it, one frame at least."""
        self.router = router
        self._budget_room = budget_room
        self.limits = limits
        self.guard = guard
        self.is_held = is_held
        self._peers: OrderedDict[bytes, Peer] = OrderedDict()
        self._active: set[bytes] = set()  # peers with frames queued or chunks deferred
        self._next_forget = 0.0
        self.total_queued = 0
        self.owned_queued = 0  # queued bytes that are copies (control replies), not snapshots
        self.chunk_bytes = 0  # full-version chunk bytes handed to ZeroMQ
        # kept for the host budget's bookkeeping: chunk frames no longer take scratch
        self.scratch = chunk_frame.ScratchPool(max_free_bytes=0)
        #: frames of dropped peers ZeroMQ still holds, each with its release
        self._orphans: list[tuple[zmq.MessageTracker, Callable[[], None]]] = []
        #: the claims of the snapshots sent from (their writers may wait for sends to end)
        self.is_overwriting: Callable[[], bool] = lambda: False
        self.dropped_replies = 0
        self.cut_peers = 0
        self._warn = RateLimitedLog(log)

    def __len__(self) -> int:
        return len(self._peers)

    def queued_bytes(self, identity: bytes) -> int:
        peer = self._peers.get(identity)
        return 0 if peer is None else peer.queued_bytes

    # -- who is asking -------------------------------------------------------------------------
    def peer(self, identity: bytes, fd: int | None, now: float) -> Peer | None:
        """The peer's state (created on first sight); None when too many peers are busy."""
        peer = self._peers.get(identity)
        if peer is None:
            if len(self._peers) >= self.limits.max_peers and not self._forget_idle(now, 1):
                self._warn.warning("peers", f"ignoring a new peer: {len(self._peers)} busy "
                                            "peers already (max_peers)")
                return None
            peer = Peer(identity, fd, now, now)
            self._peers[identity] = peer
        else:
            self._peers.move_to_end(identity)
        peer.last_seen = now
        if fd is not None:
            peer.fd = fd
        return peer

    def _forget_idle(self, now: float, wanted: int | None = None) -> int:
        gone = 0
        for identity, peer in list(self._peers.items()):
            idle = not peer.queue and not peer.deferred and peer.owed is None
            if idle and (wanted is not None or now - peer.last_seen > self.limits.idle_forget):
                del self._peers[identity]
                gone += 1
                if wanted is not None and gone >= wanted:
                    break
        return gone

    # -- sending -------------------------------------------------------------------------------
    def _send(self, peer: Peer, body: memoryview | bytes,
              release: Callable[[], None] | None = None, *, owned: bool = True) -> bool:
        """Send the one-frame ``body`` tracked; False if ZeroMQ refused it.

        ``release``: called once ZeroMQ has let go of ``body``; ``owned``: the frame is a
        copy of its own (counted in the host budget), not bytes of a snapshot."""
        if peer.owed is not None and not self._pay_owed(peer):
            return False
        if not self._route(peer):
            return False
        self._track(peer, body, release, owned)
        return True

    def _route(self, peer: Peer) -> bool:
        """Address the next frame to ``peer``; False if its pipe is full or it is gone."""
        try:
            self.router.send(peer.identity, zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.Again:  # the peer's pipe is at its high-water mark: try again later
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:  # the peer has gone (ROUTER_MANDATORY)
                self._drop(peer)
                return False
            raise
        return True

    def _track(self, peer: Peer, body: memoryview | bytes,
               release: Callable[[], None] | None, owned: bool) -> None:
        tracker = self.router.send(body, copy=False, track=True)
        if not peer.queue:  # the stall clock starts with the first frame queued, not at the
            peer.last_progress = time.monotonic()  # peer's last busy moment (idle != stalled)
        self._active.add(peer.identity)
        nbytes = len(body) if owned else -len(body)  # the sign says which: kept in the queue
        peer.queue.append((tracker, nbytes, release))
        peer.queued_bytes += len(body)
        self.total_queued += len(body)
        if owned:
            self.owned_queued += len(body)

    def _pay_owed(self, peer: Peer) -> bool:
        """Send the payload whose header went before the pipe filled; False: not yet."""
        assert peer.owed is not None
        if not self._route(peer):
            return False
        payload, release, owned = peer.owed
        peer.owed = None
        self._track(peer, payload, release, owned=owned)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("peer %s: payload of %d bytes sent", peer.identity.hex(), len(payload))
        return True

    @property
    def scratch_bytes(self) -> int:
        """Send buffers alive beside the snapshots: copied frames ZeroMQ still holds."""
        return self.owned_queued + self.scratch.free_bytes

    def _room(self, peer: Peer, nbytes: int) -> bool:
        return (peer.queued_bytes + nbytes <= self.limits.max_queued_bytes or not peer.queue) \
            and self.total_queued + nbytes <= self.limits.max_total_queued_bytes

    def _within_budget(self, nbytes: int) -> bool:
        """The host budget's room beside the snapshots; with nothing queued one frame
        always goes (else a budget full of snapshots would stop serving them)."""
        if self._budget_room is None or not self.owned_queued:
            return True
        return self.owned_queued + nbytes <= self._budget_room()

    def reply(self, peer: Peer, body: bytes) -> bool:
        """A control reply (latest, status, error); dropped when the peer is not reading."""
        if not self._room(peer, len(body)) or not self._within_budget(len(body)):
            self.dropped_replies += 1
            self._warn.warning("reply", f"dropped a reply: peer has {peer.queued_bytes} bytes "
                                        "unread (max_queued_bytes)")
            return False
        return self._send(peer, body)

    def _send_chunk(self, peer: Peer, header: chunk_frame.ChunkHeader,
                    data: memoryview | bytes, version: PublishedVersion | None,
                    owned: bool = False) -> bool | None:
        """One chunk without a copy: its header message, then ``data`` itself.

        ``data`` in ``version``'s buffer: counted as sent from there until ZeroMQ lets go
        of it (a newer snapshot waits before overwriting it); None when a newer snapshot
        has already claimed it. ``data`` of its own (a delta payload): sent as it is.
        """
        release: Callable[[], None] | None = None
        if version is not None:
            if not version.send_begin(header.chunk):
                return None  # bytes of another version may be there: never sent
            release = functools.partial(version.send_end, header.chunk)
        if peer.owed is not None and not self._pay_owed(peer):
            if release is not None:
                release()
            return False
        head = chunk_frame.header_frame(req=header.req, version=header.version,
                                        chunk=header.chunk, size=len(data))
        if not self._route(peer):
            if release is not None:
                release()
            return False
        self.router.send(head, copy=True)
        self._active.add(peer.identity)
        peer.owed = (data, release, owned)
        if not self._pay_owed(peer):  # the pipe is full now: paid before anything else
            if log.isEnabledFor(logging.DEBUG):
                log.debug("peer %s: header of req %d chunk %d sent, payload owed",
                          peer.identity.hex(), header.req, header.chunk)
        return True

    def send_to(self, identity: bytes, header: chunk_frame.ChunkHeader,
                data: memoryview | bytes, version: PublishedVersion | None,
                owned: bool = False) -> bool:
        """Send a chunk for another server part (delta chunks, slices) under the same
        credit; ``version``: the one ``data`` points into (checked after it is copied);
        ``owned``: ``data`` is a copy made for this reply (a gathered slice), counted in
        the host budget's scratch until ZeroMQ lets go of it.

        False: no room now, try again later. True: sent, or the peer is gone (drop it).
        """
        peer = self._peers.get(identity)
        if peer is None:
            return True
        if not self._room(peer, len(data)) or owned and not self._within_budget(len(data)):
            return False
        sent = self._send_chunk(peer, header, data, version, owned)
        if sent is None:  # overwritten by a newer version meanwhile: the peer is told so
            self._unavailable(peer, header.req, header.version)
            return True
        return sent or identity not in self._peers

    def reply_to(self, identity: bytes, body: bytes) -> bool:
        peer = self._peers.get(identity)
        return True if peer is None else self.reply(peer, body)

    def fetch(self, peer: Peer, req: int, version: PublishedVersion,
              chunks: tuple[int, ...], now: float) -> None:
        """Queue a validated fetch: send what credit allows now, defer the rest."""
        if peer.pending + len(chunks) > self.limits.max_pending_chunks:
            error = wire.ErrorReply(req=req, code="bad_request", version=version.manifest.version,
                                    message=f"more than {self.limits.max_pending_chunks} chunks "
                                            "outstanding; connection closed")
            self._send(peer, wire.encode(error))
            self.cut(peer, f"{peer.pending + len(chunks)} chunks outstanding "
                           f"(max_pending_chunks {self.limits.max_pending_chunks})")
            return
        if log.isEnabledFor(logging.DEBUG):  # which request waits, and behind what
            log.debug("peer %s: fetch req %d version %d chunks %s (%d queued, %d deferred, "
                      "owed %s)", peer.identity.hex(), req, version.manifest.version,
                      chunks[:4], len(peer.queue), len(peer.deferred), peer.owed is not None)
        for chunk in chunks:
            peer.deferred.append((req, version, chunk))
        self._active.add(peer.identity)
        self._flush(peer, now)

    def _flush(self, peer: Peer, now: float) -> None:
        while peer.deferred:
            req, version, chunk = peer.deferred[0]
            if version.failed or not self.is_held(version):
                peer.deferred.popleft()
                self._unavailable(peer, req, version.manifest.version)
                continue
            if not version.chunk_ready(chunk):
                return  # announced before its copy ended: sent once the bytes are final
            data = version.chunk_view(chunk)
            if not self._room(peer, len(data)):
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("peer %s: req %d chunk %d deferred (%d bytes queued)",
                              peer.identity.hex(), req, chunk, peer.queued_bytes)
                return
            header = chunk_frame.ChunkHeader(req=req, version=version.manifest.version,
                                             chunk=chunk, size=len(data))
            sent = self._send_chunk(peer, header, data, version)
            if sent is None:  # a newer snapshot overwrote it: the subscriber moves on
                peer.deferred.popleft()
                self._unavailable(peer, req, version.manifest.version)
                continue
            if not sent:
                return
            self.chunk_bytes += len(data)
            peer.deferred.popleft()

    def _unavailable(self, peer: Peer, req: int, number: int) -> None:
        # one reply per request, not per chunk (a request's chunks are queued together)
        if peer.deferred and peer.deferred[0][0] == req:
            return
        error = wire.ErrorReply(req=req, code="version_unavailable", version=number,
                                message=f"version {number} was evicted, or overwritten by a "
                                        "newer one, while chunks waited")
        self.reply(peer, wire.encode(error))

    # -- progress ------------------------------------------------------------------------------
    def pump(self, now: float) -> None:
        """Account for frames ZeroMQ has sent, send deferred chunks, cut stalled peers.

        Only peers with something queued or deferred are visited (cost: the busy peers).
        """
        for identity in list(self._active):
            peer = self._peers.get(identity)
            if peer is None:
                self._active.discard(identity)
                continue
            progressed = False
            while peer.queue and peer.queue[0][0].done:
                _, nbytes, release = peer.queue.popleft()
                self._unqueue(peer, nbytes)
                if release is not None:
                    release()
                progressed = True
            if peer.owed is not None:
                progressed = self._pay_owed(peer) or progressed
            if progressed or not peer.queue:
                peer.last_progress = now
            elif now - peer.last_progress > self.limits.stall_timeout:
                self.cut(peer, f"{peer.queued_bytes} bytes unread for "
                               f"{now - peer.last_progress:.0f}s (stall_timeout)")
                continue
            elif now - peer.last_progress > self.limits.overwrite_grace \
                    and self.is_overwriting() and any(r is not None for _, _, r in peer.queue):
                self.cut(peer, f"{peer.queued_bytes} bytes unread for "
                               f"{now - peer.last_progress:.1f}s while a new version waits "
                               "to overwrite them (overwrite_grace)")
                continue
            if peer.deferred:
                self._flush(peer, now)
            if not peer.queue and not peer.deferred and peer.owed is None:
                self._active.discard(identity)
        if self._orphans:
            still = []
            for tracker, release in self._orphans:
                if tracker.done:
                    release()
                else:
                    still.append((tracker, release))
            self._orphans = still
        if now >= self._next_forget:
            self._next_forget = now + 1.0
            self._forget_idle(now)

    def _unqueue(self, peer: Peer, nbytes: int) -> None:
        size = abs(nbytes)
        peer.queued_bytes -= size
        self.total_queued -= size
        if nbytes > 0:
            self.owned_queued -= nbytes

    @property
    def sends_held(self) -> int:
        """Frames of dropped peers ZeroMQ still holds (their bytes stay counted as sent)."""
        return len(self._orphans)

    def busy(self) -> bool:
        """Whether the loop should come back soon: some peer has deferred chunks, a payload
        owed, or frames sent from a snapshot that ZeroMQ still holds (a writer may be
        waiting for them to end)."""
        return bool(self._orphans) or any(
            p.deferred or p.owed is not None or p.queue
            for p in (self._peers.get(i) for i in self._active) if p is not None)

    def cut(self, peer: Peer, why: str) -> None:
        """Stop serving a peer: forget its deferred chunks and close its connection."""
        self.cut_peers += 1
        peer.deferred.clear()
        if self.guard is not None:
            self.guard.cut(peer.fd, why)
        self._warn.warning(f"cut-{why.split()[-1]}", f"cut off a peer: {why}")
        self._drop(peer)

    def _drop(self, peer: Peer) -> None:
        if log.isEnabledFor(logging.DEBUG):  # its requests are never answered: re-asked
            log.debug("peer %s dropped: %d frames queued, %d deferred, owed %s",
                      peer.identity.hex(), len(peer.queue), len(peer.deferred),
                      peer.owed is not None)
        # ZeroMQ lets go of its queued frames once it closes the pipe: watch them till then
        for tracker, nbytes, release in peer.queue:
            self._unqueue(peer, nbytes)
            if release is not None:
                self._orphans.append((tracker, release))
        peer.queue.clear()
        if peer.owed is not None and peer.owed[1] is not None:
            peer.owed[1]()  # never handed to ZeroMQ
        peer.owed = None
        self._peers.pop(peer.identity, None)
        self._active.discard(peer.identity)
