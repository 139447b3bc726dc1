"""Per-peer credit on the ROUTER: what one client may make the publisher hold.

Every reply to a peer is sent tracked (``zmq.MessageTracker`` says when ZeroMQ
has written the frame to the kernel), so for each peer the serving thread knows
the bytes it handed to ZeroMQ that have not left yet. A chunk reply is one frame
(``weightpub_wire.chunk_frame``): its payload is copied behind the header into a
reused scratch buffer, which goes back to the pool once ZeroMQ has sent it; so a
slow reader holds scratch (bounded by the queued bytes below), never a version.

Bounds, per peer (a ROUTER identity):

- ``max_queued_bytes``: beyond it, chunks wait in the peer's own deferred queue
  (sent as the peer drains) and control replies (latest, status) are dropped;
  ``max_total_queued_bytes`` does the same across all peers;
- ``max_pending_chunks``: a fetch that would take a peer past it is refused and
  the peer's connection is cut (a well-behaved subscriber keeps at most
  ``MAX_CREDIT_CHUNKS`` in flight);
- the host budget (``host_budget_bytes``): all scratch, queued and idle, stays
  within what the snapshots leave of it (at least one frame is always in flight);
- ``stall_timeout``: a peer with bytes queued and no progress for this long (it
  never reads) is cut; ZeroMQ then drops its queue and its scratch is freed;
- deferred chunks of a version that was evicted are dropped with a
  ``version_unavailable`` reply, so nothing deferred pins an old version; so is a
  chunk found overwritten by a newer snapshot once copied into scratch
  (``PublishedVersion.intact``, ``publisher/store/buffer_claims.py``): the scratch is
  dropped unsent, and the subscriber moves to the newer version.
"""

from __future__ import annotations

import logging
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
    max_peers: int = 4096
    idle_forget: float = 120.0


@dataclass(slots=True)
class Peer:
    identity: bytes
    fd: int | None
    last_seen: float
    last_progress: float
    #: frames handed to ZeroMQ: (tracker, bytes, the scratch buffer of a chunk frame)
    queue: deque[tuple[zmq.MessageTracker, int, bytearray | None]] = field(
        default_factory=deque)
    queued_bytes: int = 0
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
        self.chunk_bytes = 0  # full-version chunk bytes handed to ZeroMQ
        # chunk frames' send buffers: one peer's queue is kept for reuse, so a steady
        # reader costs no allocation (a fresh buffer costs its page faults, ~0.5 s/GB)
        self.scratch = chunk_frame.ScratchPool(
            max_free_bytes=self.limits.max_queued_bytes * 5 // 4)
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
            idle = not peer.queue and not peer.deferred
            if idle and (wanted is not None or now - peer.last_seen > self.limits.idle_forget):
                del self._peers[identity]
                gone += 1
                if wanted is not None and gone >= wanted:
                    break
        return gone

    # -- sending -------------------------------------------------------------------------------
    def _send(self, peer: Peer, body: memoryview | bytes,
              scratch: bytearray | None = None) -> bool:
        """Send the one-frame ``body`` tracked; False if ZeroMQ refused it."""
        try:
            self.router.send(peer.identity, zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.Again:  # the peer's pipe is at its high-water mark: try again later
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:  # the peer has gone (ROUTER_MANDATORY)
                self._drop(peer)
                return False
            raise
        tracker = self.router.send(body, copy=False, track=True)
        self._active.add(peer.identity)
        peer.queue.append((tracker, len(body), scratch))
        peer.queued_bytes += len(body)
        self.total_queued += len(body)
        return True

    @property
    def scratch_bytes(self) -> int:
        """Send buffers alive: frames ZeroMQ still holds and idle ones kept for reuse."""
        return self.total_queued + self.scratch.free_bytes

    def _room(self, peer: Peer, nbytes: int) -> bool:
        return (peer.queued_bytes + nbytes <= self.limits.max_queued_bytes or not peer.queue) \
            and self.total_queued + nbytes <= self.limits.max_total_queued_bytes \
            and self._within_budget(nbytes)

    def _within_budget(self, nbytes: int) -> bool:
        """The host budget's room beside the snapshots; with nothing queued one frame
        always goes (else a budget full of snapshots would stop serving them)."""
        if self._budget_room is None or not self.total_queued:
            return True
        room = self._budget_room()
        if self.scratch_bytes + nbytes <= room:
            return True
        self.scratch.drop_idle()
        return self.total_queued + nbytes <= room

    def reply(self, peer: Peer, body: bytes) -> bool:
        """A control reply (latest, status, error); dropped when the peer is not reading."""
        if not self._room(peer, len(body)):
            self.dropped_replies += 1
            self._warn.warning("reply", f"dropped a reply: peer has {peer.queued_bytes} bytes "
                                        "unread (max_queued_bytes)")
            return False
        return self._send(peer, body)

    def _send_chunk(self, peer: Peer, header: chunk_frame.ChunkHeader,
                    data: memoryview | bytes, version: PublishedVersion | None) -> bool | None:
        """One chunk frame: ``data`` copied behind its header into scratch, then sent.

        ``data`` in ``version``'s buffer: sent only if, once copied, the chunk is still
        intact (a newer snapshot may be overwriting that buffer); None when it was not.
        """
        scratch = self.scratch.take(chunk_frame.frame_bytes(len(data)))
        frame = chunk_frame.pack(scratch, req=header.req, version=header.version,
                                 chunk=header.chunk, payload=data)
        if version is not None and not version.intact(header.chunk):
            self.scratch.give(scratch)  # bytes of another version may be in it: never sent
            return None
        if self._send(peer, frame, scratch):
            return True
        self.scratch.give(scratch)
        return False

    def send_to(self, identity: bytes, header: chunk_frame.ChunkHeader,
                data: memoryview | bytes, version: PublishedVersion | None) -> bool:
        """Send a chunk for another server part (delta chunks) under the same credit;
        ``version``: the one ``data`` points into (checked after it is copied).

        False: no room now, try again later. True: sent, or the peer is gone (drop it).
        """
        peer = self._peers.get(identity)
        if peer is None:
            return True
        if not self._room(peer, chunk_frame.frame_bytes(len(data))):
            return False
        sent = self._send_chunk(peer, header, data, version)
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
            if not self._room(peer, chunk_frame.frame_bytes(len(data))):
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
                _, nbytes, scratch = peer.queue.popleft()
                peer.queued_bytes -= nbytes
                self.total_queued -= nbytes
                if scratch is not None:
                    self.scratch.give(scratch)
                progressed = True
            if progressed or not peer.queue:
                peer.last_progress = now
            elif now - peer.last_progress > self.limits.stall_timeout:
                self.cut(peer, f"{peer.queued_bytes} bytes unread for "
                               f"{now - peer.last_progress:.0f}s (stall_timeout)")
                continue
            if peer.deferred:
                self._flush(peer, now)
            if not peer.queue and not peer.deferred:
                self._active.discard(identity)
        if now >= self._next_forget:
            self._next_forget = now + 1.0
            self._forget_idle(now)

    def busy(self) -> bool:
        """Whether some peer has deferred chunks (the loop should come back soon)."""
        return any(self._peers[i].deferred for i in self._active if i in self._peers)

    def cut(self, peer: Peer, why: str) -> None:
        """Stop serving a peer: forget its deferred chunks and close its connection."""
        self.cut_peers += 1
        peer.deferred.clear()
        if self.guard is not None:
            self.guard.cut(peer.fd, why)
        self._warn.warning(f"cut-{why.split()[-1]}", f"cut off a peer: {why}")
        self._drop(peer)

    def _drop(self, peer: Peer) -> None:
        # its queued frames' scratch is freed by the GC once ZeroMQ lets go of it
        self.total_queued -= peer.queued_bytes
        self._peers.pop(peer.identity, None)
        self._active.discard(peer.identity)
