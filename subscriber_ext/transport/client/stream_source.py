"""The stream path, subscriber side (``stream=True``, issue 29): chunks on a plain TCP socket.

A manifest with ``stream_port`` gets a ``StreamSource``, a *first* source
(``staging/chunk_source.py``, as NIXL's): it takes the chunks the publisher is about
to be asked as ZeroMQ frames. To connect it asks a one-time token over the client's
own DEALER (``StreamTokenRequest``; under CURVE that is the authenticated
connection), connects to the port at the ROUTER's host, presents the token and,
once accepted, sends chunk requests there (``weightpub_wire.stream_link``). Each
reply's bytes are ``recv_into``'d straight into the target's buffer and hashed as
they land, then handed to ``SourceSink.in_place`` with that digest: verified
against the manifest's checksum there, with no copy and no second pass.

Any failure gives the chunks back to ZeroMQ frames with a named, counted cause
(``FALLBACK_CAUSES``, ``status()["stream"]``) and stops taking chunks of that version
(the next version tries afresh with a new token); a chunk that fails its checksum
goes to frames alone. A version whose chunks all came over the stream is staged with
``data_path`` "stream", one with some over frames "stream+zmq".

Memory safety: the socket is read on the client's thread only, and bytes go into the
target only while the request they answer is still in the client's table (the table
is cleared before a dropped or completed target's buffer is given back); anything
else is read into a small scratch buffer and dropped. The connection is kept across
versions of one publisher instance.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import xxhash
import zmq

from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.chunk_source import ChunkSource, Retry, SourceSink
from subscriber_ext.transport.staging.delta_assembly import DeltaAssembly
from subscriber_ext.transport.staging.sparse_assembly import SparseAssembly
from weightpub_wire import protocol as wire
from weightpub_wire import stream_link
from weightpub_wire.errors import ProtocolError
from weightpub_wire.ratelog import RateLimitedLog

__all__ = ["FALLBACK_CAUSES", "StreamPicker", "StreamSource"]

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
)
_MAX_CAUSES = 16
_READ_BUDGET = 64 << 20  # bytes read per ``on_events`` (the client's loop turns between)
_SCRATCH = 1 << 20  # where bytes nobody waits for any more are read and dropped


class StreamSource(ChunkSource):
    """One connection to a publisher's stream port and the chunks asked on it."""

    first = True
    kind = "stream"

    def __init__(self, picker: StreamPicker, sink: SourceSink) -> None:
        self.picker = picker
        self.sink = sink
        self.manifest: wire.Manifest | None = None
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
        self.queued: list[tuple[int, int, list[int]]] = []  # (req, version, chunks) unsent
        self.outbox = bytearray()
        self.last_progress = 0.0
        self._poller: zmq.Poller | None = None
        # the reply being read: its header, then its payload into ``dest`` (None: dropped)
        self._head = bytearray(stream_link.REPLY_BYTES)
        self._head_pos = 0
        self._reply: stream_link.StreamReply | None = None
        self._dest: memoryview | None = None
        self._pos = 0
        self._hasher = xxhash.xxh3_64()
        self._scratch = memoryview(bytearray(_SCRATCH))

    @property
    def label(self) -> str:
        return "stream"

    def follow(self, manifest: wire.Manifest) -> None:
        """A new manifest: per-version state starts over; the connection stays if it is to
        the same publisher instance and port."""
        if self.manifest is manifest:
            return
        self.manifest = manifest
        self.target = None
        self.down = False
        self.given_back = set()
        self.verified = 0
        if self.peer is not None and self.peer != (manifest.publisher_id,
                                                    manifest.stream_port):
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
        if self.down or target.manifest is not self.manifest or target.fetch_base \
                or isinstance(target, (DeltaAssembly, SparseAssembly)):
            return list(chunks)
        take = [c for c in chunks if c not in self.given_back]
        if not take:
            return list(chunks)
        if self.state == "idle" and not self._ask_token(now):
            return list(chunks)
        self.target = target
        taken = set(take)
        rest = [c for c in chunks if c not in taken]
        for start in range(0, len(take), stream_link.MAX_REQUEST_CHUNKS):
            batch = take[start: start + stream_link.MAX_REQUEST_CHUNKS]
            req = self.sink.requests.next_id()
            self.sink.requests.track(req, batch, now, source=self)
            if not self.mine:
                self.last_progress = now
            self.mine[req] = batch
            self.queued.append((req, target.fetch_version, batch))
        if self.state == "up":
            self._send_queued()
        return rest

    def expire(self, now: float, retry: Retry) -> bool:
        if self.state == "token" and now - self.since > self.picker.request_timeout:
            self.fall_back("no_answer", f"no stream token within "
                                        f"{self.picker.request_timeout}s")
        elif self.state == "connect":
            if now - self.since > self.picker.request_timeout:
                self.fall_back("connect_timeout", f"{self.picker.host}:{self._port()}: not "
                                                  "connected within "
                                                  f"{self.picker.request_timeout}s")
        elif self.mine and self._in_flight() and \
                now - self.last_progress > self.picker.request_timeout:
            self.fall_back("timeout", f"no byte for {now - self.last_progress:.1f}s with "
                                      "chunks asked")
        return False

    def tick(self, now: float) -> float:
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
        self.verified += 1
        self.picker.bytes_received += size

    def refused(self, via: Any, chunk: int, why: str, now: float) -> bool:
        """A chunk that came here failed its checksum: frames bring it (no try counted)."""
        self.given_back.add(chunk)
        self.picker.count("checksum", why, self.manifest)
        return True

    def close(self) -> None:
        self.disconnect()

    # -- the token and the connection ---------------------------------------------------------
    def _ask_token(self, now: float) -> bool:
        self.token_req = self.sink.requests.next_id()
        if not self.sink.send(stream_link.StreamTokenRequest(req=self.token_req)):
            return False  # not connected yet: the next top-up asks again
        self.state, self.since = "token", now
        return True

    def owns(self, message: Any) -> bool:
        return isinstance(message, (stream_link.StreamToken, wire.ErrorReply)) \
            and self.state == "token" and message.req == self.token_req

    def on_reply(self, message: Any) -> None:
        """The token (or an error instead) came back over the DEALER: connect."""
        manifest = self.manifest
        if isinstance(message, wire.ErrorReply) or manifest is None:
            self.fall_back("refused", f"no stream token: "
                                      f"{getattr(message, 'message', 'no manifest')}")
            return
        assert isinstance(message, stream_link.StreamToken)
        if message.port != manifest.stream_port:
            self.fall_back("bad_reply", f"token for port {message.port}, the manifest says "
                                        f"{manifest.stream_port}")
            return
        # a non-blocking connect: the client's thread never waits on it (its completion is
        # polled; ``expire`` ends it after request_timeout as ``connect_timeout``)
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                self.picker.host, message.port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            self.fall_back("connect", f"{self.picker.host}:{message.port}: {exc}")
            return
        sock.setblocking(False)
        error = sock.connect_ex(address)
        self.sock = sock
        self.peer = (manifest.publisher_id, message.port)
        self._token = message.token
        self.state, self.since = "connect", time.monotonic()
        if error not in (0, errno.EINPROGRESS):
            self.fall_back("connect", f"{self.picker.host}:{message.port}: "
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
            self.fall_back("connect", f"{self.picker.host}:{self._port()}: "
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
        self._head_pos = 0
        self._reply = None
        self._dest = None

    def fall_back(self, cause: str, why: str) -> None:
        """Give every chunk asked here back to frames; take no more of this version."""
        self.picker.count(cause, why, self.manifest)
        self.disconnect()
        self.down = True
        self.queued.clear()
        for req in list(self.mine):
            if req in self.sink.requests:
                self.sink.requests.forget(req)
        self.mine.clear()

    def _send_queued(self) -> None:
        for req, version, chunks in self.queued:
            if req in self.sink.requests:
                self.outbox += stream_link.request(req, version, chunks)
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
            self._send_queued()
            return
        if reply.status == stream_link.REFUSED:
            self.fall_back("refused", "the publisher refused the stream token")
            return
        if self.state != "up" or reply.status == stream_link.ACCEPTED:
            self.fall_back("bad_reply", f"a {reply.status_name} reply before the stream was "
                                        "accepted, or twice")
            return
        asked = self.mine.get(reply.req)  # None: a request forgotten here (stale), dropped
        if asked is not None and reply.chunk not in asked:
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
        if request is not None and target is not None and manifest is not None \
                and reply.chunk in request.chunks and reply.version == target.fetch_version:
            if reply.size != manifest.chunk_span(reply.chunk)[1]:
                self.fall_back("bad_reply", f"chunk {reply.chunk}: {reply.size} bytes, the "
                                            f"manifest says {manifest.chunk_span(reply.chunk)[1]}")
                return
            self._dest = target.chunk_target(reply.chunk)
        else:
            self._dest = None  # nobody waits for it any more: read and dropped
        self._reply = reply
        self._pos = 0
        self._hasher.reset()
        if reply.size == 0:
            self._on_payload()

    def _read_payload(self) -> int:
        reply = self._reply
        assert reply is not None and self.sock is not None
        left = reply.size - self._pos
        if self._dest is not None and reply.req not in self.sink.requests:
            self._dest = None  # the target went meanwhile: not one more byte into its buffer
        if self._dest is None:
            n = self.sock.recv_into(self._scratch, min(left, _SCRATCH))
        else:
            piece = self._dest[self._pos: reply.size]
            n = self.sock.recv_into(piece)
            if n:
                self._hasher.update(piece[:n])
        self._pos += n
        return n

    def _on_payload(self) -> None:
        reply, dest = self._reply, self._dest
        self._reply, self._dest = None, None
        assert reply is not None
        target, manifest = self.target, self.manifest
        if dest is None or target is None or manifest is None:
            return
        last = self.verified + 1 == manifest.num_chunks
        target.data_path = "stream" if last else "stream+zmq"
        verified = self.sink.in_place(reply.req, reply.version, reply.chunk, self, self,
                                      self._hasher.intdigest())
        if not verified:
            target.data_path = "stream+zmq" if self.verified else "zmq"


class StreamPicker:
    """Gives a manifest with a ``stream_port`` the one ``StreamSource`` (a
    ``SourcePicker``), and counts why chunks came over frames instead."""

    def __init__(self, mode: bool, host: str, *, request_timeout: float,
                 window_bytes: int) -> None:
        self.mode = mode
        self.host = host  # the ROUTER's host: the stream port is there
        self.request_timeout = request_timeout
        self.window_bytes = window_bytes
        self.fallback_causes: dict[str, int] = {}
        self.last_error: str | None = None
        self.bytes_received = 0
        self.source: StreamSource | None = None
        self._warn = RateLimitedLog(log)

    def __call__(self, manifest: wire.Manifest, sink: SourceSink) -> list[ChunkSource] | None:
        if not self.mode or manifest.stream_port is None or manifest.shards is not None \
                or manifest.num_chunks == 0:
            if self.source is not None and self.source.sock is not None:
                self.source.disconnect()  # a publisher without the stream: nothing to read
            return None
        if self.source is None:
            self.source = StreamSource(self, sink)
        self.source.follow(manifest)
        return [self.source]

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

    def count(self, cause: str, why: str, manifest: wire.Manifest | None) -> None:
        if cause in self.fallback_causes or len(self.fallback_causes) < _MAX_CAUSES:
            self.fallback_causes[cause] = self.fallback_causes.get(cause, 0) + 1
        version = 0 if manifest is None else manifest.version
        self.last_error = f"version {version}: {why} ({cause})"[:1024]
        self._warn.warning(f"stream:{cause}", f"stream: {self.last_error}; fetching over "
                                              "ZeroMQ frames")

    def status(self) -> dict[str, Any]:
        source = self.source
        return {
            "mode": "on" if self.mode else "off",
            "state": None if source is None else source.state,
            "bytes_received": self.bytes_received,
            "fallbacks": sum(self.fallback_causes.values()),
            "fallback_causes": dict(self.fallback_causes),
            "last_error": self.last_error,
        }

    def close(self) -> None:
        source, self.source = self.source, None
        if source is not None:
            source.close()
