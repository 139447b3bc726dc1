"""The stream path, subscriber side (``stream=True``, issue 29): chunks on a plain TCP socket.

A manifest with ``stream_port`` gets a ``StreamSource``, a *first* source
(``staging/chunk_source.py``, as NIXL's): it takes the chunks the publisher is about
to be asked as ZeroMQ frames. To connect it asks a one-time token over the client's
own DEALER (``StreamTokenRequest``; under CURVE that is the authenticated
connection), connects to the port at the ROUTER's host (a non-blocking connect,
polled; not done within ``request_timeout``: ``connect_timeout``), presents the token
and, once accepted, sends chunk requests there (``weightpub_wire.stream_link``). A
sharded trainer's ranks each get a source of their own (``StreamPicker.follow_ranks``,
called by ``shard_links.py``): the token asked over that rank's DEALER, that rank's
range only, numbered from 0 on its port, fallbacks counted per rank. Each
reply's bytes are ``recv_into``'d straight into the target's buffer and hashed as
they land, then handed to ``SourceSink.in_place`` with that digest: verified
against the manifest's checksum there, with no copy and no second pass.

A sliced subscriber's versions (a ``SparseAssembly``, ``slice_source.py``) come the same
way once the publisher says it serves slices (``FLAG_SLICES`` in its ``ACCEPTED``): a
``slices`` request names each chunk's planned blocks, the reply's bytes are
``recv_into``'d (a scatter read, ``recvmsg_into``) straight to where the plan puts
them in the sparse staging buffer, hashed as they land and verified against the slice
sums the slice source asked; a chunk is offered here only once its sum is in. A slice
whose pieces average under ``_MIN_PIECE`` (half rows of a few KiB) lands in a scratch
buffer of at most a chunk instead and is scattered from there by numpy, as a frame's
is (``SparseAssembly.place``): a Python step per short piece costs more than that copy. Deltas
and whole-chunk fallbacks stay on frames; a publisher whose stream predates slices
costs a counted ``unsupported`` per version.

Any failure gives the chunks back to ZeroMQ frames with a named, counted cause
(``FALLBACK_CAUSES``, ``status()["stream"]``) and stops taking chunks of that version
(the next version tries afresh with a new token); a chunk that fails its checksum
goes to frames alone. A version whose chunks all came over the stream is staged with
``data_path`` "stream", one with some over frames "stream+zmq".

Memory safety: the socket is read on the client's thread only, and bytes go into the
target only while the request they answer is still in the client's table (the table
is cleared before a dropped or completed target's buffer is given back); anything
else is read into scratch and dropped. The connection is kept across versions of one
publisher instance.

Memory bounds: the landing buffer and the scratch dropped bytes go to are one buffer per
source, made when first needed, as large as the largest use (a chunk's slice, or
``_SCRATCH``), and counted in the subscriber's staging budget while it lives
(``BufferPool.hold``; ``status()["stream"]["scratch_bytes"]``). It goes once nothing is
asked here any more (the version ended), when the source closes or disconnects, and
when the pool needs the room for a version's staging (``BufferPool.on_shed``; after the
reply being read into it). A budget with no room for it: a slice of short pieces is
scatter-read in place instead (slower, the same bytes; counted as ``landing_refused``),
and bytes nobody waits for cost a fallback to frames (``staging_budget``: the connection
is dropped instead of read).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash
import zmq

from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.chunk_source import ChunkSource, Retry, SourceSink
from subscriber_ext.transport.staging.delta_assembly import DeltaAssembly
from subscriber_ext.transport.staging.sparse_assembly import SparseAssembly
from subscriber_ext.transport.staging.sparse_delta import SparseDeltaAssembly
from weightpub_wire import protocol as wire
from weightpub_wire import stream_link
from weightpub_wire.bounded_counts import count_bounded
from weightpub_wire.buffers import BufferPool
from weightpub_wire.endpoints import parse_endpoint
from weightpub_wire.errors import ProtocolError
from weightpub_wire.ratelog import RateLimitedLog

__all__ = ["FALLBACK_CAUSES", "StreamPicker", "StreamRoute", "StreamSource"]

log = logging.getLogger("weightpub.subscriber")

#: why chunks of a version offered on the stream came over ZeroMQ frames instead
FALLBACK_CAUSES = (
    "refused",  # the token was refused (at the port, or no token was handed out)
    "no_answer",  # no token came back over the DEALER within request_timeout
    "connect",  # the stream port could not be reached (refused, unreachable)
    "connect_timeout",  # the connect did not complete within request_timeout
    "closed",  # the connection ended (publisher gone, cut)
    "bad_reply",  # a reply header that does not parse or answers nothing asked
    "checksum",  # a chunk that came over the stream failed its checksum
    "timeout",  # requests out and no byte for request_timeout
    "unsupported",  # a sliced version, and the publisher's stream does not serve slices
    "staging_budget",  # bytes nobody waits for, and no room in the budget to read them
)
_MAX_CAUSES = 16
_READ_BUDGET = 64 << 20  # bytes read per ``on_events`` (the client's loop turns between)
_SCRATCH = 1 << 20  # at most this much scratch is made to read and drop stale bytes
_MAX_RANKS = 64  # ranks named in ``rank_fallbacks`` (more are counted in the causes only)
_SCATTER = 512  # slice pieces one ``recvmsg_into`` fills at most
#: a slice whose pieces average less is read into scratch and scattered by numpy (as a
#: frame's is): a Python step per tiny piece costs more than that one copy
_MIN_PIECE = 16 << 10


@dataclass(frozen=True, slots=True)
class StreamRoute:
    """Where a source's chunks come from: the stream ``port`` at ``host`` of publisher
    instance ``publisher_id``, which serves the version's chunks ``[first_chunk,
    first_chunk + num_chunks)`` numbered as its own from 0 (a sharded trainer's ``rank``;
    a publisher serves them all from 0). ``send`` asks for the token over the DEALER
    to that publisher or rank (False: not sent, asked again at the next top-up)."""

    host: str
    port: int
    publisher_id: str
    first_chunk: int
    num_chunks: int
    send: Callable[[Any], bool]
    rank: int | None = None


class StreamSource(ChunkSource):
    """One connection to a publisher's stream port and the chunks asked on it."""

    first = True
    kind = "stream"

    def __init__(self, picker: StreamPicker, sink: SourceSink) -> None:
        self.picker = picker
        self.sink = sink
        self.manifest: wire.Manifest | None = None
        self.route: StreamRoute | None = None
        self.target: Assembly | None = None
        self.sock: socket.socket | None = None
        #: idle -> token -> connect -> hello -> up; any failure: back to idle
        self.state = "idle"
        self.since = 0.0  # when the token was asked (``no_answer``), the connect begun
        self._token = b""  # presented once the connect completes
        self.token_req = 0
        self.peer: tuple[str, int] | None = None  # (publisher_id, port) connected to
        self.down = False  # this version's chunks are not taken any more (a fallback)
        self.given_back: set[int] = set()  # this version's chunks frames must bring
        self.verified = 0  # chunks of this version verified after coming here
        self.mine: dict[int, list[int]] = {}  # req -> chunks, asked here (sent or queued)
        #: (req, version, chunks, each chunk's blocks for a sliced target) not sent yet
        self.queued: list[tuple[int, int, list[int], list[list[stream_link.Block]] | None]] = []
        #: the publisher serves ``slices`` (its ACCEPTED's flags); None: not connected
        self.slices_ok: bool | None = None
        #: (publisher_id, port) of a stream that does not serve slices (asked no more)
        self.unsliced: tuple[str, int] | None = None
        self.outbox = bytearray()
        self.last_progress = 0.0
        self._poller: zmq.Poller | None = None
        # the reply being read: its header, then its payload into ``dest`` (None: dropped)
        self._head = bytearray(stream_link.REPLY_BYTES)
        self._head_pos = 0
        self._reply: stream_link.StreamReply | None = None
        #: where the payload goes: the chunk, or a slice's pieces in order (None: dropped)
        self._dest: list[memoryview] | None = None
        self._piece = 0  # the piece being filled, and how far
        self._piece_pos = 0
        self._pos = 0
        self._chunk = 0  # the union's number of the chunk being read
        self._hasher = xxhash.xxh3_64()
        #: a slice of short pieces lands here first (at most a chunk; ``_MIN_PIECE``), and
        #: bytes nobody waits for are read here and dropped; made when first needed,
        #: counted in the staging budget while it lives (``_grow``, ``release_scratch``)
        self._scratch = bytearray()
        self._held = 0  # bytes of ``_scratch`` counted in ``picker.pool``
        self._release_after = False  # given back once the reply read into it ends
        self._scatter: SparseAssembly | None = None  # where the landed bytes go, if used

    @property
    def label(self) -> str:
        rank = None if self.route is None else self.route.rank
        return "stream" if rank is None else f"stream of trainer rank {rank}"

    def follow(self, manifest: wire.Manifest, route: StreamRoute) -> None:
        """A new manifest: per-version state starts over; the connection stays if it is to
        the same publisher instance and port."""
        if self.manifest is manifest:
            return
        self.manifest = manifest
        self.route = route
        self.target = None
        self.release_scratch()  # the last version's scratch goes (a stale reply's: after it)
        self.down = False
        self.given_back = set()
        self.verified = 0
        if self.peer is not None and self.peer != (route.publisher_id, route.port):
            self.disconnect()

    # -- the ChunkSource interface ------------------------------------------------------------
    def _in_flight(self) -> int:
        requests = self.sink.requests
        for req in [r for r in self.mine if r not in requests]:
            del self.mine[req]
        return sum(len(r.chunks) for req in self.mine
                   if (r := requests.get(req)) is not None)

    def ahead(self) -> int:
        if self.down:
            return 0
        return max(0, self.picker.window(self.manifest) - self._in_flight())

    def ask(self, target: Assembly, chunks: Sequence[int], now: float) -> list[int]:
        sparse = target if isinstance(target, SparseAssembly) else None
        if self.down or target.manifest is not self.manifest or target.fetch_base \
                or isinstance(target, (DeltaAssembly, SparseDeltaAssembly)) \
                or (sparse is not None and sparse.whole_cause is not None):
            return list(chunks)
        route = self.route
        assert route is not None
        if sparse is not None and self.slices_ok is False:  # connected, without slices
            self.unsliced = self.peer
        if sparse is not None and self.unsliced == (route.publisher_id, route.port):
            self.down = True  # known: this version's slices come over frames, no token asked
            self.count("unsupported", "the publisher's stream does not serve slices")
            return list(chunks)
        end = route.first_chunk + route.num_chunks
        take = [c for c in chunks if route.first_chunk <= c < end and c not in self.given_back
                and (sparse is None or _sliceable(sparse, c))]
        if not take:
            return list(chunks)
        if self.state == "idle" and not self._ask_token(now):
            return list(chunks)
        self.target = target
        taken = set(take)
        rest = [c for c in chunks if c not in taken]
        for batch in _batches(take, sparse):
            req = self.sink.requests.next_id()
            self.sink.requests.track(req, batch, now, source=self)
            if not self.mine:
                self.last_progress = now
            self.mine[req] = batch
            blocks = None if sparse is None else [_chunk_blocks(sparse, c) for c in batch]
            self.queued.append((req, target.fetch_version, batch, blocks))
        if self.state == "up":
            self._send_queued()
        return rest

    def expire(self, now: float, retry: Retry) -> bool:
        if self.state == "token" and now - self.since > self.picker.request_timeout:
            self.fall_back("no_answer", f"no stream token within "
                                        f"{self.picker.request_timeout}s")
        elif self.state == "connect":
            if now - self.since > self.picker.request_timeout:
                self.fall_back("connect_timeout", f"{self._host()}:{self._port()}: not "
                                                  "connected within "
                                                  f"{self.picker.request_timeout}s")
        elif self.mine and self._in_flight() and \
                now - self.last_progress > self.picker.request_timeout:
            self.fall_back("timeout", f"no byte for {now - self.last_progress:.1f}s with "
                                      "chunks asked")
        return False

    def tick(self, now: float) -> float:
        if self._scratch and self._reply is None and not self.queued and not self._in_flight():
            self.release_scratch()  # nothing asked here any more: the version ended
        if self.outbox:
            self._flush()
            return 0.001 if self.outbox else 0.1
        return float("inf")

    def register(self, poller: zmq.Poller) -> None:
        self._poller = poller
        self._watch()

    def _watch(self) -> None:
        """Poll the socket's fd: writable while the connect is under way, then readable."""
        if self._poller is not None and self.sock is not None:
            self._poller.register(self.sock.fileno(), zmq.POLLOUT if self.state == "connect"
                                  else zmq.POLLIN)

    def on_events(self, events: dict[Any, int], now: float) -> None:
        # a plain socket is polled (and reported) by its file descriptor
        if self.sock is not None and self.sock.fileno() in events:
            if self.state == "connect":
                self._connected()
            else:
                self._read()

    def arrived(self, via: Any, size: int, now: float) -> None:
        """A chunk that came here verified (maybe after its sum followed the manifest)."""
        self.verified += 1
        self.picker.bytes_received += size
        target, manifest = self.target, self.manifest
        if target is not None and manifest is not None:
            done = self.picker.verified(manifest)  # this version's, over every rank's stream
            needed = len(target.layout.chunks) if isinstance(target, SparseAssembly) \
                else manifest.num_chunks
            target.data_path = "stream" if done == needed else "stream+zmq"

    def refused(self, via: Any, chunk: int, why: str, now: float) -> bool:
        """A chunk that came here failed its checksum: frames bring it (no try counted)."""
        self.given_back.add(chunk)
        self.count("checksum", why)
        return True

    def close(self) -> None:
        """Closed for good (its rank gone from the manifest, the client closing): what it
        asked is forgotten, so frames may ask it."""
        self.sink.requests.drop(self)
        self.mine.clear()
        self.queued.clear()
        self.disconnect()
        self.release_scratch()

    # -- the token and the connection ---------------------------------------------------------
    def _ask_token(self, now: float) -> bool:
        self.token_req = self.sink.requests.next_id()
        assert self.route is not None
        if not self.route.send(stream_link.StreamTokenRequest(req=self.token_req)):
            return False  # not connected yet: the next top-up asks again
        self.state, self.since = "token", now
        return True

    def owns(self, message: Any) -> bool:
        return isinstance(message, (stream_link.StreamToken, wire.ErrorReply)) \
            and self.state == "token" and message.req == self.token_req

    def on_reply(self, message: Any) -> None:
        """The token (or an error instead) came back over the DEALER: connect."""
        route = self.route  # (a peer's, before its first version: ``PeerStreamSource.warm``)
        if isinstance(message, wire.ErrorReply) or route is None:
            self.fall_back("refused", f"no stream token: "
                                      f"{getattr(message, 'message', 'no route')}")
            return
        assert isinstance(message, stream_link.StreamToken)
        if message.port != route.port:
            self.fall_back("bad_reply", f"token for port {message.port}, the manifest says "
                                        f"{route.port}")
            return
        # a non-blocking connect: the client's thread never waits on it (its completion is
        # polled; ``expire`` ends it after request_timeout as ``connect_timeout``)
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                route.host, message.port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            self.fall_back("connect", f"{route.host}:{message.port}: {exc}")
            return
        sock.setblocking(False)
        error = sock.connect_ex(address)
        self.sock = sock
        self.peer = (route.publisher_id, message.port)
        self._token = message.token
        self.state, self.since = "connect", time.monotonic()
        if error not in (0, errno.EINPROGRESS):
            self.fall_back("connect", f"{route.host}:{message.port}: "
                                      f"{os.strerror(error)}")
            return
        self._watch()
        if error == 0:
            self._connected()

    def _connected(self) -> None:
        """The connect ended: present the token, or fall back naming why it failed."""
        assert self.sock is not None
        error = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            self.fall_back("connect", f"{self._host()}:{self._port()}: "
                                      f"{os.strerror(error)}")
            return
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.state = "hello"
        self._watch()
        self.last_progress = time.monotonic()
        self.outbox += stream_link.hello(self.picker.present(self._token))
        self._token = b""
        self._flush()

    def _port(self) -> int:
        return 0 if self.peer is None else self.peer[1]

    def _host(self) -> str:
        return "" if self.route is None else self.route.host

    def disconnect(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            if self._poller is not None:
                try:
                    self._poller.unregister(sock.fileno())
                except KeyError:
                    pass
            sock.close()
        self.peer = None
        self.state = "idle"
        self._token = b""
        self.outbox.clear()
        self.slices_ok = None
        self._head_pos = 0
        self._reply = None
        self._dest = None
        self._scatter = None
        self.release_scratch()

    # -- the scratch, counted ------------------------------------------------------------------
    def _grow(self, size: int) -> bool:
        """Make the scratch at least ``size`` bytes if the staging budget has room for
        the difference; False (nothing made) if not."""
        if len(self._scratch) >= size:
            return True
        pool = self.picker.pool
        if pool is not None and not pool.hold(size - self._held):
            return False
        self._scratch = bytearray()  # the old one goes before the new one is made
        self._scratch = bytearray(size)
        self._held = size if pool is not None else 0
        return True

    def release_scratch(self) -> None:
        """Give the scratch back to the budget; if a reply is being read into it, once
        that reply ends."""
        if self._reply is not None and (self._dest is None or self._scatter is not None):
            self._release_after = bool(self._scratch)
            return
        self._release_after = False
        held, self._held, self._scratch = self._held, 0, bytearray()
        if held and self.picker.pool is not None:
            self.picker.pool.unhold(held)

    @property
    def scratch_bytes(self) -> int:
        """Bytes of scratch this source holds (counted in the staging budget)."""
        return len(self._scratch)

    def fall_back(self, cause: str, why: str) -> None:
        """Give every chunk asked here back to frames; take no more of this version."""
        self.count(cause, why)
        self.disconnect()
        self.down = True
        self.queued.clear()
        for req in list(self.mine):
            if req in self.sink.requests:
                self.sink.requests.forget(req)
        self.mine.clear()

    def count(self, cause: str, why: str) -> None:
        self.picker.count(cause, why, self.manifest,
                          rank=None if self.route is None else self.route.rank)

    def _send_queued(self) -> None:
        first = 0 if self.route is None else self.route.first_chunk
        for req, version, chunks, blocks in self.queued:
            if req not in self.sink.requests:
                continue
            if blocks is None:  # the publisher's (or the rank's) own numbers
                self.outbox += stream_link.request(req, version, [c - first for c in chunks])
            else:
                self.outbox += stream_link.slice_request(
                    req, version, [(c - first, b) for c, b in zip(chunks, blocks, strict=True)])
        self.queued.clear()
        self._flush()

    def _flush(self) -> None:
        if self.sock is None or not self.outbox:
            return
        try:
            sent = self.sock.send(self.outbox)
        except BlockingIOError:
            return
        except OSError as exc:
            self.fall_back("closed", f"sending: {exc}")
            return
        del self.outbox[:sent]

    # -- replies ------------------------------------------------------------------------------
    def _read(self) -> None:
        budget = _READ_BUDGET
        while self.sock is not None and budget > 0:
            try:
                if self._reply is None:
                    n = self.sock.recv_into(memoryview(self._head)[self._head_pos:])
                else:
                    n = self._read_payload()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.fall_back("closed", str(exc))
                return
            if n < 0:  # fallen back (``staging_budget``)
                return
            if n == 0:
                self.fall_back("closed", "the publisher closed the stream")
                return
            self.last_progress = time.monotonic()
            budget -= n
            if self._reply is None:
                self._head_pos += n
                if self._head_pos == len(self._head):
                    self._head_pos = 0
                    self._on_header()
            elif self._pos == self._reply.size:
                self._on_payload()

    def _on_header(self) -> None:
        try:
            reply = stream_link.parse_reply(self._head)
        except ProtocolError as exc:
            self.fall_back("bad_reply", str(exc))
            return
        if reply.status == stream_link.ACCEPTED and self.state == "hello":
            self.state = "up"
            self.slices_ok = bool(reply.flags & stream_link.FLAG_SLICES)
            if not self.slices_ok and any(blocks is not None for *_, blocks in self.queued):
                self.unsliced = self.peer  # its later versions: frames, without a token
                self.fall_back("unsupported", "the publisher's stream does not serve slices")
                return
            self._send_queued()
            return
        if reply.status == stream_link.REFUSED:
            self.fall_back("refused", "the publisher refused the stream token")
            return
        if self.state != "up" or reply.status == stream_link.ACCEPTED:
            self.fall_back("bad_reply", f"a {reply.status_name} reply before the stream was "
                                        "accepted, or twice")
            return
        # the union's number (a sharded trainer's rank numbers its own range from 0)
        chunk = reply.chunk + (0 if self.route is None else self.route.first_chunk)
        asked = self.mine.get(reply.req)  # None: a request forgotten here (stale), dropped
        if asked is not None and chunk not in asked:
            self.fall_back("bad_reply", f"a reply to request {reply.req} chunk "
                                        f"{reply.chunk}, which was not asked there")
            return
        if reply.status == stream_link.UNAVAILABLE:  # evicted: frames hear it and move on
            if reply.req in self.sink.requests:
                for chunk in self.mine.get(reply.req, []):
                    self.given_back.add(chunk)
                self.sink.requests.forget(reply.req)
            return
        manifest = self.manifest
        request = self.sink.requests.get(reply.req)
        target = self.target
        self._scatter = None
        if request is not None and target is not None and chunk in request.chunks \
                and reply.version != target.fetch_version:  # asked, answered for another
            self.fall_back("bad_reply", f"a reply to request {reply.req} chunk {reply.chunk} "
                                        f"names version {reply.version}, it asked for "
                                        f"{target.fetch_version}")
            return
        if request is not None and target is not None and manifest is not None \
                and chunk in request.chunks:
            sparse = target if isinstance(target, SparseAssembly) else None
            size = manifest.chunk_span(chunk)[1] if sparse is None \
                else sparse.layout.sizes[chunk]
            if reply.size != size:
                self.fall_back("bad_reply", f"chunk {chunk}: {reply.size} bytes, the "
                                            f"{'manifest' if sparse is None else 'plan'} "
                                            f"says {size}")
                return
            short = sparse is not None and size < _MIN_PIECE * _pieces(sparse, chunk)
            if sparse is None:
                self._dest = [target.chunk_target(chunk)]
            elif short and self._grow(size):  # short pieces: land, scatter
                self._dest, self._scatter = [memoryview(self._scratch)[:size]], sparse
            else:  # long pieces, or no room to land them: scatter-read in place
                self.picker.landing_refused += short
                self._dest = sparse.slice_targets(chunk)
        else:
            self._dest = None  # nobody waits for it any more: read and dropped
        self._reply = reply
        self._chunk = chunk
        self._pos = 0
        self._piece = self._piece_pos = 0
        self._hasher.reset()
        if reply.size == 0:
            self._on_payload()

    def _read_payload(self) -> int:
        reply = self._reply
        assert reply is not None and self.sock is not None
        left = reply.size - self._pos
        if self._dest is not None and reply.req not in self.sink.requests:
            self._dest = None  # the target went meanwhile: not one more byte into its buffer
        dest = self._dest
        if dest is None:
            if not self._scratch and not self._grow(min(left, _SCRATCH)):
                self.fall_back("staging_budget", f"no room in the staging budget to read and "
                                                 f"drop {left} bytes nobody waits for")
                return -1
            n = self.sock.recv_into(self._scratch, min(left, len(self._scratch)))
        elif len(dest) - self._piece == 1:  # one run (a whole chunk): the plain read
            piece = dest[self._piece][self._piece_pos:]
            n = self.sock.recv_into(piece)
            if self._scatter is None:  # (landed bytes are hashed as ``place`` scatters)
                self._hasher.update(piece[:n])
            self._piece_pos += n
        else:  # a slice's pieces: one scatter read fills several, in order
            pieces = [dest[self._piece][self._piece_pos:],
                      *dest[self._piece + 1: self._piece + _SCATTER]]
            n = self.sock.recvmsg_into(pieces)[0]
            got = n
            for piece in pieces:
                if not got:
                    break
                take = min(got, len(piece))
                self._hasher.update(piece[:take])
                got -= take
                if take == len(piece):
                    self._piece += 1
                    self._piece_pos = 0
                else:
                    self._piece_pos += take
        self._pos += n
        return n

    def _on_payload(self) -> None:
        try:
            self._payload_done()
        finally:
            if self._release_after and self._reply is None:
                self.release_scratch()

    def _payload_done(self) -> None:
        reply, dest = self._reply, self._dest
        self._reply, self._dest = None, None
        assert reply is not None
        target, manifest = self.target, self.manifest
        if dest is None or target is None or manifest is None:
            return
        sparse = target if isinstance(target, SparseAssembly) else None
        scatter, self._scatter = self._scatter, None
        if scatter is not None:  # short pieces: one numpy scatter out of the landing buffer
            if scatter is not target or reply.req not in self.sink.requests \
                    or self._chunk not in scatter.missing:
                return  # nobody waits for it any more: the target is not written
            digest = scatter.place(self._chunk, dest[0])  # hashed, scattered, counted
        else:
            digest = self._hasher.intdigest()
            if sparse is not None:
                sparse.count_slice(reply.size)
        # verified there (``arrived`` names the data path), or held until its sum comes
        self.sink.in_place(reply.req, reply.version, self._chunk, self, self, digest)


def _sliceable(target: SparseAssembly, chunk: int) -> bool:
    """Whether ``chunk`` of a sliced target can come over the stream: its slice sum is in
    (or the plan covers it whole) and its blocks fit one request."""
    return target.readable_in_place(chunk) and \
        len(target.layout.blocks[chunk]) <= stream_link.MAX_CHUNK_BLOCKS


def _pieces(target: SparseAssembly, chunk: int) -> int:
    """At most how many pieces ``chunk``'s planned bytes make in staging (a block is one
    when its rows touch, else one per row), counted without making them."""
    if target.layout.whole(target.manifest, chunk):
        return 1
    return sum(1 if rows == 1 or stride == length else rows
               for _, length, stride, rows in target.layout.blocks[chunk])


def _chunk_blocks(target: SparseAssembly, chunk: int) -> list[stream_link.Block]:
    """The plan's blocks of ``chunk``, their starts counted from the chunk's first byte."""
    low = target.manifest.chunk_span(chunk)[0]
    return [(start - low, length, stride, rows)
            for start, length, stride, rows in target.layout.blocks[chunk]]


def _batches(chunks: list[int], sparse: SparseAssembly | None) -> list[list[int]]:
    """``chunks`` cut into requests: at most ``MAX_REQUEST_CHUNKS`` each, and (a sliced
    target) ``MAX_REQUEST_BLOCKS`` blocks."""
    batches: list[list[int]] = [[]]
    blocks = 0
    for chunk in chunks:
        count = 0 if sparse is None else len(sparse.layout.blocks[chunk])
        if len(batches[-1]) == stream_link.MAX_REQUEST_CHUNKS or \
                blocks + count > stream_link.MAX_REQUEST_BLOCKS:
            batches.append([])
            blocks = 0
        batches[-1].append(chunk)
        blocks += count
    return [batch for batch in batches if batch]


class StreamPicker:
    """Gives a manifest with a ``stream_port`` the one ``StreamSource`` (a
    ``SourcePicker``), and counts why chunks came over frames instead."""

    def __init__(self, mode: bool, host: str, *, request_timeout: float,
                 window_bytes: int, pool: BufferPool | None = None) -> None:
        """``pool``: the staging pool the sources' scratch is counted in (None: not
        counted, tests)."""
        self.mode = mode
        self.pool = pool
        self.landing_refused = 0  # short-piece slices read in place: no room to land them
        self.host = host  # the ROUTER's host: the stream port is there
        self.request_timeout = request_timeout
        self.window_bytes = window_bytes
        self.fallback_causes: dict[str, int] = {}
        self.rank_fallbacks: dict[int, int] = {}  # sharded: fallbacks per trainer rank
        self.last_error: str | None = None
        self.bytes_received = 0
        self.source: StreamSource | None = None  # the publisher's port
        #: a sharded trainer's ranks' ports, by the rank's endpoint (``shard_links.py``)
        self.ranks: dict[str, StreamSource] = {}
        self._warn = RateLimitedLog(log)
        if pool is not None:
            pool.on_shed(self.shed)

    def shed(self) -> None:
        """The pool needs the room for staging: every source's scratch goes."""
        for source in self._sources():
            source.release_scratch()

    def __call__(self, manifest: wire.Manifest, sink: SourceSink) -> list[ChunkSource] | None:
        if not self.mode or manifest.stream_port is None or manifest.shards is not None \
                or manifest.num_chunks == 0:
            if self.source is not None and self.source.sock is not None:
                self.source.disconnect()  # a publisher without the stream: nothing to read
            return None
        if self.source is None:
            self.source = StreamSource(self, sink)
        self.source.follow(manifest, StreamRoute(
            host=self.host, port=manifest.stream_port, publisher_id=manifest.publisher_id,
            first_chunk=0, num_chunks=manifest.num_chunks, send=sink.send))
        return [self.source]

    def follow_ranks(self, manifest: wire.Manifest, senders: dict[str, Callable[[Any], bool]],
                     sink: SourceSink) -> dict[str, StreamSource]:
        """A sharded manifest's ranks with a ``stream_port``: a source each (by the rank's
        endpoint), which asks its token over ``senders[endpoint]`` (the rank's own
        DEALER, ``shard_links.py``) and takes that rank's range; the sources of ranks gone
        (or without a port now) are closed. Empty when the option is off."""
        wanted: dict[str, StreamSource] = {}
        shards = manifest.shards if self.mode and manifest.shards is not None else ()
        for shard in shards:
            if shard.stream_port is None or not shard.num_chunks \
                    or shard.endpoint not in senders or shard.endpoint in wanted:
                continue
            source = self.ranks.get(shard.endpoint) or StreamSource(self, sink)
            source.follow(manifest, StreamRoute(
                host=parse_endpoint(shard.endpoint).host, port=shard.stream_port,
                publisher_id=shard.publisher_id, first_chunk=shard.first_chunk,
                num_chunks=shard.num_chunks, send=senders[shard.endpoint], rank=shard.rank))
            wanted[shard.endpoint] = source
        for endpoint, source in self.ranks.items():
            if endpoint not in wanted:
                source.close()
        self.ranks = wanted
        return dict(wanted)

    def _sources(self) -> list[StreamSource]:
        return [s for s in (self.source, *list(self.ranks.values())) if s is not None]

    def verified(self, manifest: wire.Manifest) -> int:
        """Chunks of ``manifest`` verified after coming over any of its streams."""
        return sum(s.verified for s in self._sources() if s.manifest is manifest)

    def window(self, manifest: wire.Manifest | None) -> int:
        if manifest is None:
            return 1
        return max(1, min(self.window_bytes // manifest.chunk_size, wire.MAX_CHUNKS_IN_FLIGHT))

    def present(self, token: bytes) -> bytes:
        """The token as presented at the port (a test spoils it here)."""
        return token

    # -- replies over the client's DEALER (``SyncClient(repliers=...)``) ---------------------------
    reply_types = (stream_link.StreamToken,)

    def owns(self, message: Any) -> bool:
        return self.source is not None and self.source.owns(message)

    def on_reply(self, message: Any) -> None:
        if self.source is not None:
            self.source.on_reply(message)

    def count(self, cause: str, why: str, manifest: wire.Manifest | None,
              rank: int | None = None) -> None:
        """A fallback to frames by ``cause``; a sharded trainer's ``rank`` is counted in
        ``rank_fallbacks`` too and named in ``last_error``."""
        count_bounded(self.fallback_causes, cause, _MAX_CAUSES)
        if rank is not None:
            count_bounded(self.rank_fallbacks, rank, _MAX_RANKS)
        version = 0 if manifest is None else manifest.version
        whose = "" if rank is None else f"trainer rank {rank}: "
        self.last_error = f"version {version}: {whose}{why} ({cause})"[:1024]
        self._warn.warning(f"stream:{cause}", f"stream: {self.last_error}; fetching over "
                                              "ZeroMQ frames")

    def status(self) -> dict[str, Any]:
        """Read from any thread: ``state`` is the publisher port's, or a sharded trainer's
        ranks' when they all agree ("mixed" when not; ``rank_states`` each)."""
        source = self.source
        ranks = {s.route.rank: s.state for s in list(self.ranks.values())
                 if s.route is not None and s.route.rank is not None}
        states = set(ranks.values())
        state = source.state if source is not None else \
            None if not states else states.pop() if len(states) == 1 else "mixed"
        return {
            "mode": "on" if self.mode else "off",
            "state": state,
            "rank_states": dict(sorted(ranks.items())),
            "bytes_received": self.bytes_received,
            "fallbacks": sum(self.fallback_causes.values()),
            "fallback_causes": dict(self.fallback_causes),
            "rank_fallbacks": dict(self.rank_fallbacks),
            "last_error": self.last_error,
            # scratch held now (counted in the staging budget), and slices read in place
            # for want of room to land them
            "scratch_bytes": sum(s.scratch_bytes for s in self._sources()),
            "landing_refused": self.landing_refused,
        }

    def close(self) -> None:
        if self.pool is not None:
            self.pool.off_shed(self.shed)
        sources = self._sources()
        self.source, self.ranks = None, {}
        for source in sources:
            source.close()
