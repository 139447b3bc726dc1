"""The publisher's plain-TCP stream port (``stream=True``, issue 29): chunks sent with no copy.

Why: over ZeroMQ every subscriber receives through ZeroMQ's receive buffer and
every chunk reply is a message of its own; four subscribers reached 0.49x of four
raw TCP streams. Here a chunk goes with one ``socket.sendmsg([header, chunk])``
straight from the snapshot (the kernel copies it into the socket, nothing is copied
per subscriber in Python) and the subscriber ``recv_into``s it straight into staging
(``subscriber_ext/transport/client/stream_source.py``).

Who may connect: only a holder of a one-time token (``issue_token``), which the
serving thread hands out over the CURVE-authenticated ROUTER
(``weightpub_wire.stream_link.StreamToken``); a hello with any other token is
answered ``REFUSED`` and the connection closed. The bytes themselves are not
encrypted (docs/RELIABILITY.md).

Slices (a sliced subscriber, ``stream_link`` ``slices`` requests): the blocks a
subscriber names are sent as views of the snapshot where they are contiguous runs (a
whole tensor, a run of whole rows) or rows of at least ``min_row_bytes``; a strided
block of shorter rows is gathered into one copy first (a syscall entry per tiny row
would cost more than the copy). Every block is checked against the chunk's span in
the version. The subscriber verifies the bytes against the slice sums it asked over
the ROUTER. ``serves_slices`` False answers as a publisher from before: no
``FLAG_SLICES`` in ``ACCEPTED``, and a ``slices`` request cuts the connection.

Threads and bounds: one accept thread (``weightpub-stream-accept``) and one thread per
connection (``weightpub-stream-conn``), at most ``max_connections`` (more are closed at
once); a connection holds one request in memory at a time (at most
``MAX_REQUEST_CHUNKS`` ids, or a ``slices`` request's ``MAX_REQUEST_BLOCKS`` blocks;
what the subscriber pipelines waits in the kernel), and the slice gathers of one batch
(about ``slice_batch_bytes`` plus a chunk, counted in ``scratch_bytes`` until sent, which
the publisher counts in its host budget); tokens outstanding are bounded and expire. A
chunk's region is counted as being sent (``PublishedVersion.send_begin``) only during
its ``sendmsg`` calls: once they return the kernel holds a copy, so a newer snapshot may
overwrite it. A subscriber that stops reading for ``stall_timeout`` (or
``overwrite_grace`` while a snapshot waits for the region) is cut.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from publisher.store.version_store import PublishedVersion, VersionStore
from weightpub_wire import protocol as wire
from weightpub_wire import stream_link
from weightpub_wire.errors import ProtocolError
from weightpub_wire.ratelog import RateLimitedLog

__all__ = ["StreamLimits", "StreamServer"]

log = logging.getLogger("weightpub.publisher")

_POLL_S = 0.5  # socket timeout: how often a blocked thread looks at the clock and at close
_IOV_MAX = 1024  # buffers one sendmsg may carry (Linux's UIO_MAXIOV)

#: one reply of a batch: (chunk, payload bytes, what makes its payload's buffers and says
#: how many bytes of them it gathered: called while the chunk's region is counted as being
#: sent, so a gather copies final bytes)
_Item = tuple[int, int, Callable[[], tuple[list[memoryview], int]]]


@dataclass(frozen=True, slots=True)
class StreamLimits:
    max_connections: int = 256
    max_tokens: int = 1024  # issued and not yet presented
    token_ttl: float = 60.0  # a token not presented by then is void
    hello_timeout: float = 10.0  # from connect to a complete hello
    stall_timeout: float = 30.0  # no byte taken by the subscriber this long: cut
    overwrite_grace: float = 2.0  # the same while a newer snapshot waits for the region
    ready_wait: float = 60.0  # a chunk announced before its copy ended: wait this long
    batch_bytes: int = 16 << 20  # chunks of one request sent in one sendmsg, at most this
    #: the same for slices: what a connection's gathers hold at once is about this (plus a
    #: chunk), and the next batch is gathered while the kernel still sends the last
    slice_batch_bytes: int = 4 << 20
    #: strided slice rows shorter than this are gathered (one numpy copy): a view and an
    #: iovec per row cost more Python than copying rows of a few KiB
    min_row_bytes: int = 16 << 10


class StreamServer:
    """A listening TCP socket, its accept thread and one thread per connection."""

    #: answers ``slices`` requests (and says so in ``ACCEPTED``); a test sets it False to
    #: play a publisher from before them
    serves_slices = True

    def __init__(self, store: VersionStore, host: str, port: int = 0,
                 limits: StreamLimits | None = None,
                 allowed: Callable[[bytes], bool] | None = None) -> None:
        """``allowed(z85 key)``: the CURVE allow-list, asked again before every request of
        a connection whose token was handed to that key (a key revoked meanwhile is cut,
        as the ROUTER cuts it)."""
        self.store = store
        self.limits = limits or StreamLimits()
        self._allowed = allowed
        #: token -> (expiry (monotonic), the CURVE key it was handed to, None without CURVE)
        self._tokens: dict[bytes, tuple[float, str | None]] = {}
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}
        self._closed = False
        self._warn = RateLimitedLog(log)
        self.bytes_sent = 0
        self.chunks_sent = 0
        self.slice_bytes_sent = 0  # of ``bytes_sent``: answers to ``slices`` requests
        self.slice_bytes_gathered = 0  # of those: copied first (strided short rows)
        #: gathered copies alive now (being sent): counted in the publisher's host budget
        self.scratch_bytes = 0
        self.accepted = 0
        self.refused = 0  # hellos with a bad, used or expired token
        self.turned_away = 0  # connections past max_connections
        self.cut = 0  # subscribers cut (stalled, bad requests)
        self.tokens_issued = 0  # handed out over the ROUTER
        self.tokens_denied = 0  # asked for while ``max_tokens`` were outstanding
        bind_host = "0.0.0.0" if host in ("*", "") else host
        self._listener = socket.create_server((bind_host, port), backlog=128,
                                              family=socket.AF_INET6 if ":" in bind_host
                                              else socket.AF_INET)
        self._listener.settimeout(_POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._accepter = threading.Thread(target=self._accept_loop, daemon=True,
                                          name="weightpub-stream-accept")
        self._accepter.start()

    # -- tokens (called on the serving thread) ----------------------------------------------
    def issue_token(self, client_key: str | None = None) -> bytes | None:
        """A fresh one-time token for ``client_key`` (the CURVE key it was asked with);
        None when ``max_tokens`` are outstanding."""
        now = time.monotonic()
        with self._lock:
            for token, (expiry, _) in list(self._tokens.items()):
                if expiry < now:
                    del self._tokens[token]
            if len(self._tokens) >= self.limits.max_tokens:
                self.tokens_denied += 1
                return None
            self.tokens_issued += 1
            token = os.urandom(stream_link.TOKEN_BYTES)
            self._tokens[token] = (now + self.limits.token_ttl, client_key)
            return token

    def _take_token(self, token: bytes) -> tuple[bool, str | None]:
        """(valid, the key it was handed to); a token is good once."""
        with self._lock:
            entry = self._tokens.pop(token, None)
        if entry is None or entry[0] < time.monotonic():
            return False, None
        return True, entry[1]

    # -- what is sent (a test may wrap it) ------------------------------------------------------
    def chunk_bytes(self, version: PublishedVersion, chunk: int) -> memoryview:
        return version.chunk_view(chunk)

    def slice_bytes(self, version: PublishedVersion, chunk: int,
                    blocks: list[stream_link.Block]) -> tuple[list[memoryview], int]:
        """The blocks' bytes of ``chunk``, in order: views of the snapshot (a contiguous
        run, or each row of at least ``min_row_bytes``), a gathered copy of shorter rows;
        and how many bytes were gathered."""
        data = self.chunk_bytes(version, chunk)
        parts: list[memoryview] = []
        gathered_bytes = 0
        for start, length, stride, rows in blocks:
            if rows == 1 or stride == length:
                parts.append(data[start: start + length * rows])
            elif length >= self.limits.min_row_bytes:
                parts.extend(data[row: row + length]
                             for row in range(start, start + rows * stride, stride))
            else:
                array = np.frombuffer(data, dtype=np.uint8)
                gathered = np.lib.stride_tricks.as_strided(
                    array[start:], shape=(rows, length), strides=(stride, 1)).reshape(-1)
                gathered_bytes += gathered.nbytes
                parts.append(gathered.data)
        return parts, gathered_bytes

    def status(self) -> dict[str, Any]:
        """Counters since start: connections open now, accepted (a good token), refused (a
        bad, used or expired one), turned away (``max_connections``), cut (stalled, bad
        requests, a revoked key); chunk bytes sent; tokens handed out and denied."""
        with self._lock:
            return {"port": self.port, "connections": len(self._conns),
                    "accepted": self.accepted, "refused": self.refused,
                    "turned_away": self.turned_away, "cut": self.cut,
                    "bytes_sent": self.bytes_sent, "chunks_sent": self.chunks_sent,
                    "slice_bytes_sent": self.slice_bytes_sent,
                    "slice_bytes_gathered": self.slice_bytes_gathered,
                    "tokens_issued": self.tokens_issued, "tokens_denied": self.tokens_denied}

    def wire_status(self) -> wire.StreamPort:
        """``status()`` as a status reply carries it (``weightpub status``)."""
        return wire.StreamPort(**self.status())

    # -- threads --------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed:
                    return
                time.sleep(_POLL_S)
                continue
            with self._lock:
                full = len(self._conns) >= self.limits.max_connections
                if not full:
                    self._conns[conn.fileno()] = conn
                else:
                    self.turned_away += 1
            if full:
                self._warn.warning("stream-full", "stream: turned a connection away "
                                                  f"({self.limits.max_connections} open)")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="weightpub-stream-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        key = conn.fileno()
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.limits.hello_timeout)
            token = stream_link.parse_hello(_read_exact(conn, stream_link.HELLO_BYTES))
            valid, client_key = self._take_token(token)
            if not valid:
                with self._lock:  # every connection's thread counts
                    self.refused += 1
                self._warn.warning("stream-token", "stream: refused a connection (unknown, "
                                                   "used or expired token)")
                conn.sendall(stream_link.reply_header(stream_link.REFUSED))
                return
            with self._lock:  # every connection's thread counts
                self.accepted += 1
            flags = stream_link.FLAG_SLICES if self.serves_slices else 0
            conn.sendall(stream_link.reply_header(stream_link.ACCEPTED, flags=flags))
            conn.settimeout(_POLL_S)
            while not self._closed:
                head = _read_exact(conn, stream_link.REQUEST_BYTES, idle=lambda: self._closed)
                if client_key is not None and self._allowed is not None \
                        and not self._allowed(client_key.encode()):
                    raise _Cut(f"CURVE key {client_key} is not in the allow-list any more")
                request = stream_link.parse_request_head(head, slices=self.serves_slices)
                if request.slices:
                    self._answer_slices(conn, request, _read_slices(conn, request))
                    continue
                chunks = stream_link.request_chunks(
                    _read_exact(conn, 4 * request.count), request)
                self._answer(conn, request, chunks)
        except (EOFError, ConnectionError, TimeoutError):
            pass  # the subscriber went (or never said hello in time)
        except ProtocolError as exc:
            with self._lock:  # every connection's thread counts
                self.cut += 1
            self._warn.warning("stream-bad", f"stream: cut a subscriber: {exc}")
        except _Cut as exc:
            with self._lock:  # every connection's thread counts
                self.cut += 1
            self._warn.warning("stream-cut", f"stream: cut a subscriber: {exc}")
        except OSError as exc:
            if not self._closed:
                self._warn.warning("stream-os", f"stream: connection ended: {exc}")
        finally:
            with self._lock:
                self._conns.pop(key, None)
            conn.close()

    def _answer(self, conn: socket.socket, request: stream_link.StreamRequest,
                chunks: tuple[int, ...]) -> None:
        """Send ``chunks`` of the request whole (see ``_reply``)."""
        def item(version: PublishedVersion, chunk: int) -> _Item:
            data = self.chunk_bytes(version, chunk)
            return chunk, len(data), lambda: ([data], 0)

        self._reply(conn, request, chunks, item)

    def _answer_slices(self, conn: socket.socket, request: stream_link.StreamRequest,
                       entries: list[tuple[int, list[stream_link.Block]]]) -> None:
        """Send each chunk's blocks back to back (see ``_reply``); a block past its chunk
        in the version is a bad request (the subscriber is cut)."""
        blocks = dict(entries)

        def item(version: PublishedVersion, chunk: int) -> _Item:
            span = version.manifest.chunk_span(chunk)[1]
            size = 0
            for index, (start, length, stride, rows) in enumerate(blocks[chunk]):
                if start + (rows - 1) * stride + length > span:
                    raise ProtocolError(f"stream slices.blocks[{index}] of chunk {chunk}: "
                                        f"ends past the chunk's {span} bytes")
                size += length * rows
            return chunk, size, lambda: self.slice_bytes(version, chunk, blocks[chunk])

        self._reply(conn, request, tuple(chunk for chunk, _ in entries), item, slices=True)

    def _reply(self, conn: socket.socket, request: stream_link.StreamRequest,
               chunks: tuple[int, ...], item: Callable[[PublishedVersion, int], _Item],
               slices: bool = False) -> None:
        """Send the ``item`` of each of ``chunks``, in batches of about ``batch_bytes``;
        one ``UNAVAILABLE`` (and nothing more of the request) when the version is not
        held."""
        version = self.store.get(request.version)
        unavailable = version is None or version.failed
        batch: list[_Item] = []
        size = 0
        for chunk in chunks:
            if unavailable or version is None or chunk >= version.manifest.num_chunks \
                    or not self._wait_ready(version, chunk):
                self._send_batch(conn, request, version, batch, slices)
                conn.sendall(stream_link.reply_header(stream_link.UNAVAILABLE, request.req,
                                                      request.version, chunk))
                return
            batch.append(item(version, chunk))
            size += batch[-1][1]
            if size >= (self.limits.slice_batch_bytes if slices else self.limits.batch_bytes):
                if not self._send_batch(conn, request, version, batch, slices):
                    conn.sendall(stream_link.reply_header(
                        stream_link.UNAVAILABLE, request.req, request.version, chunk))
                    return
                batch, size = [], 0
        if not self._send_batch(conn, request, version, batch, slices):
            conn.sendall(stream_link.reply_header(
                stream_link.UNAVAILABLE, request.req, request.version, batch[0][0]))

    def _wait_ready(self, version: PublishedVersion, chunk: int) -> bool:
        deadline = time.monotonic() + self.limits.ready_wait
        while not version.chunk_ready(chunk):
            if version.failed or self._closed or time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return self.store.get(version.manifest.version) is version

    def _send_batch(self, conn: socket.socket, request: stream_link.StreamRequest,
                    version: PublishedVersion | None, batch: list[_Item],
                    slices: bool = False) -> bool:
        """One ``sendmsg`` of headers and payloads (their regions counted as being sent
        until it returns); False when a newer snapshot claimed one of them first."""
        if not batch or version is None:
            return True
        begun: list[int] = []
        held = 0  # gathered bytes this batch holds
        try:
            for chunk, _, _ in batch:
                if not version.send_begin(chunk):
                    return False
                begun.append(chunk)
            parts: list[memoryview] = []
            for chunk, size, make in batch:
                parts.append(memoryview(stream_link.reply_header(
                    stream_link.OK, request.req, request.version, chunk, size)))
                made, gathered = make()
                parts.extend(made)
                with self._lock:  # counted from every connection's thread
                    self.scratch_bytes += gathered
                    self.slice_bytes_gathered += gathered
                held += gathered
            self._send_all(conn, parts)
        finally:
            for chunk in begun:
                version.send_end(chunk)
            with self._lock:  # the gathers go with ``parts`` (the kernel holds its copy)
                self.scratch_bytes -= held
        sent = sum(size for _, size, _ in batch)
        with self._lock:  # counted from every connection's thread
            self.chunks_sent += len(batch)
            self.bytes_sent += sent
            if slices:
                self.slice_bytes_sent += sent
        return True

    def _send_all(self, conn: socket.socket, parts: list[memoryview]) -> None:
        """``sendmsg`` until every byte is in the kernel; cut a subscriber that stops
        reading (``stall_timeout``, or ``overwrite_grace`` while a snapshot waits)."""
        last = time.monotonic()
        first = 0  # parts[:first] are sent (an index: a slice's parts may be thousands)
        while first < len(parts):
            try:
                sent = conn.sendmsg(parts[first: first + _IOV_MAX])
            except TimeoutError:
                now = time.monotonic()
                if now - last > self.limits.stall_timeout:
                    raise _Cut(f"took nothing for {now - last:.0f}s (stall_timeout)") from None
                if now - last > self.limits.overwrite_grace and self.store.writers_waiting():
                    raise _Cut(f"took nothing for {now - last:.1f}s while a new version "
                               "waits to overwrite the bytes (overwrite_grace)") from None
                if self._closed:
                    raise ConnectionError("closing") from None
                continue
            last = time.monotonic()
            while sent and first < len(parts):
                if sent >= len(parts[first]):
                    sent -= len(parts[first])
                    first += 1
                else:
                    parts[first] = parts[first][sent:]
                    sent = 0
            while first < len(parts) and not len(parts[first]):
                first += 1

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accepter.join(timeout=2 * _POLL_S + 1)


class _Cut(Exception):
    """A subscriber is cut off (stalled)."""


def _read_slices(conn: socket.socket, request: stream_link.StreamRequest
                 ) -> list[tuple[int, list[stream_link.Block]]]:
    """A ``slices`` request's chunks and their blocks, each count bounded before its
    bytes are read; a chunk named twice is a bad request."""
    entries: list[tuple[int, list[stream_link.Block]]] = []
    left = stream_link.MAX_REQUEST_BLOCKS
    for _ in range(request.count):
        chunk, count = stream_link.parse_slice_chunk(
            _read_exact(conn, stream_link.SLICE_CHUNK_BYTES), left)
        left -= count
        entries.append((chunk, stream_link.parse_blocks(_read_exact(conn, 16 * count),
                                                        count, chunk)))
    if len({chunk for chunk, _ in entries}) != len(entries):
        raise ProtocolError("stream slices.chunk: a chunk named twice in one request")
    return entries


def _read_exact(conn: socket.socket, nbytes: int, idle: Any = None) -> bytes:
    """Exactly ``nbytes`` (a socket timeout before the first byte is waited through while
    ``idle()`` is False: a connection may sit idle between versions)."""
    data = bytearray()
    while len(data) < nbytes:
        try:
            piece = conn.recv(nbytes - len(data))
        except TimeoutError:
            if idle is not None and not data and not idle():
                continue
            raise
        if not piece:
            raise EOFError("connection closed")
        data += piece
    return bytes(data)
