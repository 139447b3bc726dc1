"""The peer ROUTER: a peer-sharing subscriber serves the verified chunks it holds.

It answers the publisher's own ``FetchRequest`` with the publisher's own one-frame
chunk reply (``weightpub_wire.chunk_frame``), from two places (``lookup``): the version being
received (a chunk only once it matched the manifest's checksum; for a delta
rebuild, only final bytes) and the newest complete version it holds (the delta
base a subscriber keeps anyway, so serving costs no extra staging memory).

Slices (issue 30): a sliced subscriber's server also answers ``slice_fetch`` for its
own plan (``slice_lookup``: the plan's bytes of a chunk gathered back to back out of
its sparse staging, a copy of only those bytes, exactly what the publisher sends for
that plan and checked by the asker against the same ``slice_sums``); a plan it does
not hold gets ``version_unavailable`` at once. Without a ``slice_lookup`` (a
whole-version member) every ``slice_fetch`` gets that answer.

Peers over the stream: ``peer_stream`` is answered with a one-time token for the
member's stream port (``stream_token``, ``peer_stream_server.py``), only to admitted keys
(checked before the request is read), or an error naming why not.

Cut-through: a request for a chunk not verified yet, or for a version this
subscriber has not heard of yet, waits and goes out the moment the chunk
verifies, up to ``defer_timeout``; a version it will not have (conflated past,
given up, older than what it holds) gets ``version_unavailable`` at once, and
the asking peer moves on to its next source (``sources.py``).

Without a copy (protocol 4, ``chunk_frame.FOLLOWS``): each chunk goes as its 32-byte
header message, then its payload message straight from the staging buffer
(``copy=False, track=True``). Staging buffers are pooled and reused for newer
versions, so every such send is counted on its buffer (``BufferPool.send_begin``)
until ZeroMQ lets go of it: a buffer given back meanwhile *drains* (stays counted,
is not reused, released or unmapped) until its sends ended. Verified bytes are never
written again while their version is staged, so a peer only ever sees verified bytes.

Bounds: clients, chunks a client has asked for and not received, chunks per
request, chunks handed to ZeroMQ and not yet written to the kernel (per client
and, in bytes, for all; a dropped client's unsent bytes keep counting until
ZeroMQ lets go of them), and the upload budget (rate and CPU share,
``upload_budget.py``). A client whose bytes stay unsent for ``stall_timeout``, or
for ``drain_grace`` while a buffer they point into waits to be reused, is cut: its
TCP connection is shut down under ZeroMQ (the request's ``SRCFD``), which frees what
ZeroMQ held for it (``cut_clients``). With CURVE, only keys the tracker vouched for
connect (ZAP), and every request is checked again.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
import zmq

from subscriber_ext.transport.peers.upload_budget import UploadBudget
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ProtocolError, ProtocolVersionError
from weightpub_wire.nixl_link import NixlOffer
from weightpub_wire.peer_protocol import PeerNixl, PeerNixlOffer
from weightpub_wire.ratelog import RateLimitedLog
from weightpub_wire.slice_messages import SliceFetch
from weightpub_wire.sockets import cut_connection, peer_name
from weightpub_wire.stream_link import PeerStreamRequest, StreamToken

__all__ = ["GONE", "WAIT", "Lookup", "NixlLookup", "PeerServer", "PeerServerLimits", "SendCounts",
           "Served", "SliceLookup"]

log = logging.getLogger("weightpub.peers")

WAIT = "wait"  # not verified (or not started) yet: hold the request
GONE = "gone"  # this subscriber will not have it: version_unavailable


class Served(NamedTuple):
    """A chunk's verified bytes and the pooled buffer they are a view of (None: bytes
    the caller owns and never changes)."""

    data: memoryview
    buffer: torch.Tensor | None


#: ``lookup(publisher_id, version, chunk)``: the chunk's verified bytes, WAIT or GONE
Lookup = Callable[[str, int, int], "Served | str"]
#: ``slice_lookup(publisher_id, version, chunk, digest)``: plan ``digest``'s verified bytes
#: of the chunk gathered back to back, WAIT or GONE
SliceLookup = Callable[[str, int, int, str], "Served | str"]
#: ``nixl_lookup(publisher_id, version)``: this member's NIXL offer of the version's
#: staging, or None and why (peers over NIXL, issue 31)
NixlLookup = Callable[[str, int], "tuple[NixlOffer | None, str]"]
#: ``stream_token(key, publisher_id)``: a one-time token for this member's stream port
#: and the port (``peer_stream_server.py``), or why not
StreamTokens = Callable[[str | None, str], "tuple[bytes, int] | str"]


class SendCounts(Protocol):
    """Where sends without a copy are counted: ``weightpub_wire.buffers.BufferPool``."""

    def send_begin(self, buf: torch.Tensor) -> int: ...

    def send_end(self, key: int) -> None: ...

    def draining(self, key: int) -> bool: ...


@dataclass(frozen=True, slots=True)
class PeerServerLimits:
    max_clients: int = 256
    max_pending_chunks: int = 64  # per client: asked for, not sent yet
    max_chunks_per_request: int = 64
    max_queued_chunks: int = 4  # per client: handed to ZeroMQ, not yet in the kernel
    max_queued_bytes: int = 64 << 20  # all clients together
    defer_timeout: float = 10.0
    stall_timeout: float = 10.0
    drain_grace: float = 2.0  # no progress while a buffer it holds waits to be reused: cut
    max_request_bytes: int = 64 << 10
    idle_forget: float = 60.0


@dataclass(slots=True)
class _Ask:
    req: int
    publisher_id: str
    version: int
    chunk: int
    deadline: float
    digest: str = ""  # a ``slice_fetch``: the plan whose bytes of the chunk are asked


@dataclass(slots=True)
class _Sent:
    """A payload ZeroMQ holds: its tracker, size and counted buffer (None: not counted)."""

    tracker: zmq.MessageTracker
    nbytes: int
    key: int | None


@dataclass(slots=True)
class _Client:
    identity: bytes
    last_seen: float
    last_progress: float
    pending: list[_Ask] = field(default_factory=list)
    queued: deque[_Sent] = field(default_factory=deque)
    #: a payload whose header went before the pipe filled: (bytes, counted key), sent first
    owed: tuple[memoryview, int | None] | None = None
    fd: int | None = None  # its TCP connection (the request's SRCFD), to cut it
    peer: str = ""  # that connection's remote address when first seen


class PeerServer:
    """Runs on the subscriber's thread (the only one touching ``router``)."""

    def __init__(self, router: zmq.Socket, lookup: Lookup, budget: UploadBudget,
                 limits: PeerServerLimits,
                 admitted: Callable[[str], bool] | None = None,
                 sends: SendCounts | None = None,
                 slice_lookup: SliceLookup | None = None,
                 nixl_lookup: NixlLookup | None = None,
                 stream_token: StreamTokens | None = None) -> None:
        """``sends``: where sends out of pooled buffers are counted (required once
        ``lookup`` returns such buffers); ``slice_lookup``: a sliced subscriber's planned
        bytes (None: ``slice_fetch`` is answered ``version_unavailable``);
        ``nixl_lookup``: its NIXL offers (None: every ``peer_nixl`` is answered None);
        ``stream_token``: its stream port's tokens (None: ``peer_stream`` is answered
        with an error, the asker keeps to frames)."""
        self.router = router
        self.lookup = lookup
        self.slice_lookup = slice_lookup
        self.nixl_lookup = nixl_lookup
        self.stream_token = stream_token
        self.budget = budget
        self.limits = limits
        self.admitted = admitted  # CURVE: the request's User-Id must pass
        self.sends = sends
        self._clients: OrderedDict[bytes, _Client] = OrderedDict()
        self._orphans: list[_Sent] = []
        self._queued_bytes = 0
        self._dirty = True
        self._next_scan = 0.0
        self._next_forget = 0.0
        self._warn = RateLimitedLog(log)
        self.chunks_served = 0
        self.slices_served = 0  # of those, a plan's bytes (``slice_fetch``)
        self.nixl_offers = 0  # ``peer_nixl`` answered with an offer
        self.stream_tokens = 0  # ``peer_stream`` answered with a token
        self.bad_requests = 0
        self.unavailable_replies = 0
        self.dropped_clients = 0
        self.cut_clients = 0  # connections shut down under ZeroMQ (stalled readers)
        self.payload_bytes_sent = 0  # handed to ZeroMQ without a copy

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
        key = None
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
            request = wire.decode(frames[1].buffer,
                                  expect=(wire.FetchRequest, SliceFetch, PeerNixl,
                                          PeerStreamRequest))
            if not isinstance(request, wire.FetchRequest | SliceFetch | PeerNixl
                              | PeerStreamRequest):
                raise ProtocolError("message.t: expected fetch, slice_fetch, peer_nixl or "
                                    "peer_stream")
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
        if isinstance(request, PeerNixl):  # answered at once, from the cache (no bytes move)
            self._answer_nixl(frames[0].bytes, request)
            return
        if isinstance(request, PeerStreamRequest):  # an admitted key's (checked above)
            self._answer_stream(frames[0].bytes, request, key if isinstance(key, str) else None)
            return
        client = self._client(frames[0].bytes, now)
        if client is None:
            return
        if client.fd is None:
            fd = _srcfd(frames[1])
            if fd is not None:
                client.fd, client.peer = fd, peer_name(fd)
        digest = request.digest if isinstance(request, SliceFetch) else ""
        if isinstance(request, wire.FetchRequest) and request.base:
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
                                   deadline, digest) for chunk in request.chunks)
        self._dirty = True

    def _answer_nixl(self, identity: bytes, request: PeerNixl) -> None:
        """The member's offer of ``request.version`` (an admitted key's: checked above)."""
        offer, why = (None, "peers over NIXL are off here") if self.nixl_lookup is None \
            else self.nixl_lookup(request.publisher_id, request.version)
        self.nixl_offers += offer is not None
        body = wire.encode(PeerNixlOffer(req=request.req, version=request.version, offer=offer,
                                         why=why[: wire.MAX_ERROR_CHARS]))
        try:
            self.router.send_multipart([identity, body], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # not reading, or gone: it asks again or fetches frames

    def _answer_stream(self, identity: bytes, request: PeerStreamRequest,
                       key: str | None) -> None:
        """A one-time token for this member's stream port, bound to ``key``, or an error
        naming why not."""
        got = "the peer stream is off here" if self.stream_token is None \
            else self.stream_token(key, request.publisher_id)
        if isinstance(got, str):
            body = wire.encode(wire.ErrorReply(req=request.req, code="bad_request",
                                               message=got[: wire.MAX_ERROR_CHARS]))
        else:
            self.stream_tokens += 1
            body = wire.encode(StreamToken(req=request.req, token=got[0], port=got[1]))
        try:
            self.router.send_multipart([identity, body], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # not reading, or gone: it counts no_answer and fetches frames

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
        if self._orphans:
            # ZeroMQ frees a cut client's pipe (and the payloads it held) only once this
            # socket processes its commands, which any call into it does
            self.router.getsockopt(zmq.EVENTS)
            self._orphans = [sent for sent in self._orphans if not self._done(sent)]
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
            found = self._find(ask)
            if found == GONE or (found == WAIT and now >= ask.deadline):
                why = ("is not held here" if not ask.digest else
                       f"is not held here as slices of plan {ask.digest}") if found == GONE else \
                    f"was not verified here within {self.limits.defer_timeout}s"
                self._error(client, ask.req, "version_unavailable", ask.version,
                            f"chunk {ask.chunk} of version {ask.version} {why}")
                client.pending = [a for a in client.pending if a.req != ask.req]
                continue
            if not isinstance(found, Served):
                index += 1
                continue
            size = len(found.data)
            if client.owed is not None or len(client.queued) >= self.limits.max_queued_chunks \
                    or self._queued_bytes + size > self.limits.max_queued_bytes:
                return math.inf
            wait = self.budget.delay(size, now)
            if wait > 0:
                return wait
            if not self._send_chunk(client, ask, found):
                self.budget.refund(size)
                return math.inf
            del client.pending[index]
            return 0.0
        return math.inf

    def _find(self, ask: _Ask) -> Served | str:
        if not ask.digest:
            return self.lookup(ask.publisher_id, ask.version, ask.chunk)
        if self.slice_lookup is None:
            return GONE
        return self.slice_lookup(ask.publisher_id, ask.version, ask.chunk, ask.digest)

    def _send_chunk(self, client: _Client, ask: _Ask, found: Served) -> bool:
        """The chunk's header message, then its payload straight from ``found`` (counted
        on its buffer until ZeroMQ lets go of it); False: not now (pipe full, gone)."""
        head = chunk_frame.header_frame(req=ask.req, version=ask.version, chunk=ask.chunk,
                                        size=len(found.data))
        if not self._route(client):
            return False
        self.router.send(head, copy=True)
        key = None
        if found.buffer is not None:
            if self.sends is None:
                raise RuntimeError("PeerServer: a pooled buffer served with no SendCounts")
            key = self.sends.send_begin(found.buffer)
        client.owed = (found.data, key)
        self.chunks_served += 1
        self.slices_served += bool(ask.digest)
        self._pay_owed(client)  # the pipe may be full now: then paid before anything else
        return True

    def _route(self, client: _Client) -> bool:
        """Address the next message to ``client``; False if its pipe is full or it left."""
        try:
            self.router.send(client.identity, zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:  # the client has gone
                self._drop(client)
                return False
            raise
        return True

    def _pay_owed(self, client: _Client) -> bool:
        """Send the payload whose header went out; False: its pipe is full, not yet."""
        assert client.owed is not None
        data, key = client.owed
        if not self._route(client):
            return client.identity not in self._clients  # dropped: _drop settled it
        client.owed = None
        tracker = self.router.send(data, copy=False, track=True)
        client.queued.append(_Sent(tracker, len(data), key))
        self._queued_bytes += len(data)
        self.payload_bytes_sent += len(data)
        return True

    def _done(self, sent: _Sent) -> bool:
        if not sent.tracker.done:
            return False
        self._dirty = True  # room for the next chunk
        self._queued_bytes -= sent.nbytes
        if sent.key is not None and self.sends is not None:
            self.sends.send_end(sent.key)
        return True

    def _progress(self, client: _Client, now: float) -> None:
        progressed = False
        if client.owed is not None and self._pay_owed(client):
            progressed = True
        while client.queued and self._done(client.queued[0]):
            client.queued.popleft()
            progressed = True
        if progressed or not client.queued:
            client.last_progress = now
            return
        stalled = now - client.last_progress
        if stalled > self.limits.stall_timeout:
            self._cut(client, f"dropped a peer client: {len(client.queued)} chunks unsent for "
                              f"{stalled:.0f}s (stall_timeout)")
        elif stalled > self.limits.drain_grace and self._holds_draining(client):
            self._cut(client, f"dropped a peer client: {len(client.queued)} chunks unsent for "
                              f"{stalled:.1f}s while their staging buffer waits to be reused "
                              "(drain_grace)")

    def _holds_draining(self, client: _Client) -> bool:
        sends = self.sends
        return sends is not None and any(s.key is not None and sends.draining(s.key)
                                         for s in client.queued)

    def _cut(self, client: _Client, why: str) -> None:
        """Drop a client that does not read and shut its connection down, so ZeroMQ lets
        go of what it queued for it (the buffers those point into can be reused)."""
        self._bad(why)
        if client.fd is not None and cut_connection(client.fd, client.peer):
            self.cut_clients += 1
        self._drop(client)

    def _drop(self, client: _Client) -> None:
        self.dropped_clients += 1
        if client.owed is not None:  # its header went, its payload never will
            key = client.owed[1]
            client.owed = None
            if key is not None and self.sends is not None:
                self.sends.send_end(key)
        self._orphans.extend(client.queued)  # still held by ZeroMQ: still counted
        client.queued.clear()
        client.pending.clear()
        self._clients.pop(client.identity, None)

    def _forget_idle(self, now: float, force: bool = False) -> None:
        self._next_forget = now + 1.0
        for identity, client in list(self._clients.items()):
            idle = not client.pending and not client.queued and client.owed is None
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
        return {"served_chunks": self.chunks_served, "served_slices": self.slices_served,
                "nixl_offers": self.nixl_offers, "stream_tokens": self.stream_tokens,
                "clients": len(self._clients),
                "bad_requests": self.bad_requests, "dropped_clients": self.dropped_clients,
                "unavailable_replies": self.unavailable_replies,
                "cut_clients": self.cut_clients, "queued_bytes": self._queued_bytes,
                "payload_bytes_sent": self.payload_bytes_sent}

    def close(self) -> None:
        """Forget every send: the router is closed with no linger, so ZeroMQ drops what it
        held (counted buffers may be reused once the context is gone)."""
        for client in list(self._clients.values()):
            self._drop(client)
        for sent in self._orphans:
            if sent.key is not None and self.sends is not None:
                self.sends.send_end(sent.key)
        self._orphans = []


def _srcfd(frame: zmq.Frame) -> int | None:
    """The descriptor of the TCP connection a request came on (None: not TCP, unknown)."""
    try:
        fd = frame.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError):
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None
