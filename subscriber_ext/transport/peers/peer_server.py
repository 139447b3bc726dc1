"""The peer ROUTER: a peer-sharing subscriber serves the verified chunks it holds.

It answers the publisher's own ``FetchRequest`` with the publisher's own one-frame
chunk reply (``weightpub_wire.chunk_frame``), from two places (``lookup``): the version being
received (a chunk only once it matched the manifest's checksum; for a delta
rebuild, only final bytes) and the newest complete version it holds (the delta
base a subscriber keeps anyway, so serving costs no extra staging memory).

Cut-through: a request for a chunk not verified yet, or for a version this
subscriber has not heard of yet, waits and goes out the moment the chunk
verifies, up to ``defer_timeout``; a version it will not have (conflated past,
given up, older than what it holds) gets ``version_unavailable`` at once, and
the asking peer moves on to its next source (``sources.py``).

Bounds: clients, chunks a client has asked for and not received, chunks per
request, chunks handed to ZeroMQ and not yet written to the kernel (per client
and, in bytes, for all; a dropped client's unsent bytes keep counting until
ZeroMQ lets go of them), and the upload budget (rate and CPU share,
``upload_budget.py``). A client whose bytes stay unsent for ``stall_timeout``
is dropped. Each chunk is copied behind its header into a reused send buffer: staging
buffers are reused for newer versions while ZeroMQ may still be sending, and a
peer must only ever see verified bytes. With CURVE, only keys the tracker
vouched for connect (ZAP), and every request is checked again.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from subscriber_ext.transport.peers.upload_budget import UploadBudget
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ProtocolError, ProtocolVersionError
from weightpub_wire.ratelog import RateLimitedLog

__all__ = ["GONE", "WAIT", "Lookup", "PeerServer", "PeerServerLimits"]

log = logging.getLogger("weightpub.peers")

WAIT = "wait"  # not verified (or not started) yet: hold the request
GONE = "gone"  # this subscriber will not have it: version_unavailable
#: ``lookup(publisher_id, version, chunk)``: the chunk's verified bytes, WAIT or GONE
Lookup = Callable[[str, int, int], "memoryview | str"]


@dataclass(frozen=True, slots=True)
class PeerServerLimits:
    max_clients: int = 256
    max_pending_chunks: int = 64  # per client: asked for, not sent yet
    max_chunks_per_request: int = 64
    max_queued_chunks: int = 4  # per client: handed to ZeroMQ, not yet in the kernel
    max_queued_bytes: int = 64 << 20  # all clients together
    defer_timeout: float = 10.0
    stall_timeout: float = 10.0
    max_request_bytes: int = 64 << 10
    idle_forget: float = 60.0


@dataclass(slots=True)
class _Ask:
    req: int
    publisher_id: str
    version: int
    chunk: int
    deadline: float


@dataclass(slots=True)
class _Client:
    identity: bytes
    last_seen: float
    last_progress: float
    pending: list[_Ask] = field(default_factory=list)
    queued: deque[tuple[zmq.MessageTracker, bytearray]] = field(default_factory=deque)


class PeerServer:
    """Runs on the subscriber's thread (the only one touching ``router``)."""

    def __init__(self, router: zmq.Socket, lookup: Lookup, budget: UploadBudget,
                 limits: PeerServerLimits,
                 admitted: Callable[[str], bool] | None = None) -> None:
        self.router = router
        self.lookup = lookup
        self.budget = budget
        self.limits = limits
        self.admitted = admitted  # CURVE: the request's User-Id must pass
        self._clients: OrderedDict[bytes, _Client] = OrderedDict()
        self._orphans: list[tuple[zmq.MessageTracker, bytearray]] = []
        self._free: list[bytearray] = []
        self._queued_bytes = 0
        self._dirty = True
        self._next_scan = 0.0
        self._next_forget = 0.0
        self._warn = RateLimitedLog(log)
        self.chunks_served = 0
        self.bad_requests = 0
        self.unavailable_replies = 0
        self.dropped_clients = 0

    def changed(self) -> None:
        """Something became servable (a chunk verified, a version started or ended)."""
        self._dirty = True

    # -- requests ------------------------------------------------------------------------------
    def on_readable(self, now: float) -> None:
        cpu = time.thread_time()
        try:
            for _ in range(256):
                try:
                    frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                self._on_request(frames, now)
        finally:
            self.budget.charge(time.thread_time() - cpu)

    def _on_request(self, frames: list[zmq.Frame], now: float) -> None:
        if len(frames) != 2:
            self._bad(f"dropped a request of {len(frames)} frames (expected 2)")
            return
        if self.admitted is not None:
            try:
                key = frames[1].get("User-Id")
            except zmq.ZMQError:
                key = None
            if not isinstance(key, str) or not self.admitted(key):
                self._bad(f"dropped a request from CURVE key {key}: not vouched for by the "
                          "publisher's tracker")
                return
        try:
            request = wire.decode_as(frames[1].buffer, wire.FetchRequest)
        except ProtocolVersionError as exc:  # say so: the asker then moves on
            self._bad(f"refused a request: {exc}")
            client = self._client(frames[0].bytes, now)
            if client is not None:
                self._error(client, wire.peek_req(frames[1].buffer), "bad_request", 0,
                            f"protocol version {exc.theirs} is not spoken here: this peer "
                            f"speaks {exc.ours}")
            return
        except ProtocolError as exc:
            self._bad(f"dropped a bad request: {exc}")
            return
        client = self._client(frames[0].bytes, now)
        if client is None:
            return
        if request.base:
            self._error(client, request.req, "bad_request", request.version,
                        "peers serve full chunks only; deltas come from the publisher")
            return
        if len(request.chunks) > self.limits.max_chunks_per_request or \
                len(client.pending) + len(request.chunks) > self.limits.max_pending_chunks:
            client.pending.clear()
            self._error(client, request.req, "bad_request", request.version,
                        f"more than {self.limits.max_pending_chunks} chunks outstanding")
            self._bad("a client asked for too many chunks at once; its requests were dropped")
            return
        deadline = now + self.limits.defer_timeout
        client.pending.extend(_Ask(request.req, request.publisher_id, request.version, chunk,
                                   deadline) for chunk in request.chunks)
        self._dirty = True

    def _client(self, identity: bytes, now: float) -> _Client | None:
        client = self._clients.get(identity)
        if client is None:
            if len(self._clients) >= self.limits.max_clients:
                self._forget_idle(now, force=True)
            if len(self._clients) >= self.limits.max_clients:
                self._bad(f"ignoring a new client: {len(self._clients)} busy (max_clients)")
                return None
            client = _Client(identity, now, now)
            self._clients[identity] = client
        client.last_seen = now
        return client

    # -- serving -------------------------------------------------------------------------------
    def pump(self, now: float) -> float:
        """Send what can go now; seconds until this wants to run again (inf: idle)."""
        cpu = time.thread_time()
        try:
            return self._pump(now)
        finally:
            self.budget.charge(time.thread_time() - cpu)

    def _pump(self, now: float) -> float:
        for client in list(self._clients.values()):
            self._progress(client, now)
        self._orphans = [(t, b) for t, b in self._orphans if not self._done(t, b)]
        if now >= self._next_forget:
            self._forget_idle(now)
        writing = any(c.queued for c in self._clients.values()) or bool(self._orphans)
        if self._dirty or now >= self._next_scan:
            self._dirty = False
            self._next_scan = self._scan(now)
        wake = self._next_scan - now
        return max(0.0, min(wake, 0.005) if writing else wake)

    def _scan(self, now: float) -> float:
        """Serve round-robin, one chunk per client per pass; when to scan again."""
        busy = [c for c in self._clients.values() if c.pending]
        while busy:
            still = []
            for client in busy:
                outcome = self._serve_one(client, now)
                if outcome == 0.0:
                    still.append(client)
                elif outcome < math.inf:
                    return now + min(outcome, 0.05)  # the budget says wait
            busy = still
        deadlines = [a.deadline for c in self._clients.values() for a in c.pending]
        return min(deadlines, default=math.inf)

    def _serve_one(self, client: _Client, now: float) -> float:
        """0.0: sent one chunk; inf: nothing to send now; else seconds the budget wants."""
        index = 0
        while index < len(client.pending):
            ask = client.pending[index]
            found = self.lookup(ask.publisher_id, ask.version, ask.chunk)
            if found == GONE or (found == WAIT and now >= ask.deadline):
                why = "is not held here" if found == GONE else \
                    f"was not verified here within {self.limits.defer_timeout}s"
                self._error(client, ask.req, "version_unavailable", ask.version,
                            f"chunk {ask.chunk} of version {ask.version} {why}")
                client.pending = [a for a in client.pending if a.req != ask.req]
                continue
            if not isinstance(found, memoryview):
                index += 1
                continue
            if len(client.queued) >= self.limits.max_queued_chunks or \
                    self._queued_bytes + len(found) > self.limits.max_queued_bytes:
                return math.inf
            wait = self.budget.delay(len(found), now)
            if wait > 0:
                return wait
            if not self._send_chunk(client, ask, found):
                self.budget.refund(len(found))
                return math.inf
            del client.pending[index]
            return 0.0
        return math.inf

    def _send_chunk(self, client: _Client, ask: _Ask, data: memoryview) -> bool:
        buffer = self._buffer(chunk_frame.frame_bytes(len(data)))
        frame = chunk_frame.pack(buffer, req=ask.req, version=ask.version, chunk=ask.chunk,
                                 payload=data)
        try:
            self.router.send(client.identity, zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.Again:
            self._free.append(buffer)
            return False
        except zmq.ZMQError as exc:
            self._free.append(buffer)
            if exc.errno == zmq.EHOSTUNREACH:  # the client has gone
                self._drop(client)
                return False
            raise
        tracker = self.router.send(frame, copy=False, track=True)
        client.queued.append((tracker, buffer))
        self._queued_bytes += len(buffer)
        self.chunks_served += 1
        return True

    def _buffer(self, size: int) -> bytearray:
        for index, buffer in enumerate(self._free):
            if len(buffer) >= size:
                return self._free.pop(index)
        return bytearray(size)

    def _done(self, tracker: zmq.MessageTracker, buffer: bytearray) -> bool:
        if not tracker.done:
            return False
        self._dirty = True  # room for the next chunk
        self._queued_bytes -= len(buffer)
        if len(self._free) < 8:
            self._free.append(buffer)
        return True

    def _progress(self, client: _Client, now: float) -> None:
        progressed = False
        while client.queued and self._done(*client.queued[0]):
            client.queued.popleft()
            progressed = True
        if progressed or not client.queued:
            client.last_progress = now
        elif now - client.last_progress > self.limits.stall_timeout:
            self._bad(f"dropped a peer client: {len(client.queued)} chunks unsent for "
                      f"{now - client.last_progress:.0f}s (stall_timeout)")
            self._drop(client)

    def _drop(self, client: _Client) -> None:
        self.dropped_clients += 1
        self._orphans.extend(client.queued)  # still held by ZeroMQ: still counted
        client.queued.clear()
        client.pending.clear()
        self._clients.pop(client.identity, None)

    def _forget_idle(self, now: float, force: bool = False) -> None:
        self._next_forget = now + 1.0
        for identity, client in list(self._clients.items()):
            idle = not client.pending and not client.queued
            if idle and (force or now - client.last_seen > self.limits.idle_forget):
                del self._clients[identity]
                if force:
                    return

    def _error(self, client: _Client, req: int, code: str, version: int, message: str) -> None:
        self.unavailable_replies += code == "version_unavailable"
        body = wire.encode(wire.ErrorReply(req=req, code=code, version=version,
                                           message=message[: wire.MAX_ERROR_CHARS]))
        try:
            self.router.send_multipart([client.identity, body], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # not reading, or gone: it times out on its side

    def _bad(self, text: str) -> None:
        self.bad_requests += 1
        self._warn.warning(text.split(":")[0][:24], text)

    def stats(self) -> dict[str, int]:
        return {"served_chunks": self.chunks_served, "clients": len(self._clients),
                "bad_requests": self.bad_requests, "dropped_clients": self.dropped_clients,
                "unavailable_replies": self.unavailable_replies,
                "queued_bytes": self._queued_bytes}
