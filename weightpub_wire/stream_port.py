"""A plain-TCP stream port's connection-serving core (issue 29): tokens, hellos, requests, sends.

Why here: the publisher's stream port (``publisher/serving/stream_server.py``) and a
peer-sharing subscriber's (``subscriber_ext/transport/peers/peer_stream_server.py``)
speak the same wire (``stream_link``) and need the same guards; this layer is below
both. A subclass says what a request is answered with (``answer``, and
``answer_slices`` where ``serves_slices``) and when a stalled reader must go sooner
(``overdue``).

Who may connect: only a holder of a one-time token (``issue_token``), handed out over
a CURVE-authenticated ZeroMQ connection by the owner; a hello with any other token is
answered ``REFUSED`` and the connection closed. ``allowed(key)`` is asked again before
every request of a connection whose token went to that key (a key revoked meanwhile is
cut). The bytes are not encrypted (docs/RELIABILITY.md).

Threads and bounds: one accept thread (``<name>-accept``) and one thread per connection
(``<name>-conn``), at most ``max_connections`` (more are closed at once); a connection
holds one request in memory at a time (at most ``MAX_REQUEST_CHUNKS`` ids, or a
``slices`` request's ``MAX_REQUEST_BLOCKS`` blocks; what the reader pipelines waits in
the kernel); tokens outstanding are bounded and expire; a reader that takes nothing for
``stall_timeout`` (or what ``overdue`` says) is cut.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from weightpub_wire import stream_link
from weightpub_wire.errors import ProtocolError
from weightpub_wire.ratelog import RateLimitedLog

__all__ = ["MIN_ROW_BYTES", "POLL_S", "Cut", "PortLimits", "StreamPort", "gathered_size",
           "read_exact", "slice_parts"]

POLL_S = 0.5  # socket timeout: how often a blocked thread looks at the clock and at close
_IOV_MAX = 1024  # buffers one sendmsg may carry (Linux's UIO_MAXIOV)
#: strided slice rows shorter than this are gathered (one numpy copy): a view and an
#: iovec per row cost more Python than copying rows of a few KiB
MIN_ROW_BYTES = 16 << 10


@dataclass(frozen=True, slots=True)
class PortLimits:
    max_connections: int = 256
    max_tokens: int = 1024  # issued and not yet presented
    token_ttl: float = 60.0  # a token not presented by then is void
    hello_timeout: float = 10.0  # from connect to a complete hello
    stall_timeout: float = 30.0  # no byte taken by the reader this long: cut


class Cut(Exception):
    """A reader is cut off (stalled, revoked)."""


class StreamPort:
    """A listening TCP socket, its accept thread and one thread per connection."""

    #: answers ``slices`` requests (and says so in ``ACCEPTED``)
    serves_slices = False

    def __init__(self, host: str, port: int = 0, limits: PortLimits | None = None,
                 allowed: Any = None, *, accept_name: str, conn_name: str, label: str,
                 logger: logging.Logger | None = None) -> None:
        """``allowed(z85 key) -> bool``: the CURVE allow-list (None: none); ``accept_name``,
        ``conn_name``: the threads' names; ``label``: what the log lines say it is."""
        self.limits = limits or PortLimits()
        self._allowed = allowed
        self._name = label
        self._conn_name = conn_name
        #: token -> (expiry (monotonic), the CURVE key it was handed to (None without
        #: CURVE), its scope)
        self._tokens: dict[bytes, tuple[float, str | None, str]] = {}
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}
        self._threads: set[threading.Thread] = set()  # connection threads alive
        self._closed = False
        self._warn = RateLimitedLog(logger or logging.getLogger("weightpub.stream"))
        self.bytes_sent = 0
        self.chunks_sent = 0
        self.accepted = 0
        self.refused = 0  # hellos with a bad, used or expired token
        self.turned_away = 0  # connections past max_connections
        self.cut = 0  # readers cut (stalled, bad requests)
        self.tokens_issued = 0  # handed out over the owner's ZeroMQ connection
        self.tokens_denied = 0  # asked for while ``max_tokens`` were outstanding
        bind_host = "0.0.0.0" if host in ("*", "") else host
        self._listener = socket.create_server((bind_host, port), backlog=128,
                                              family=socket.AF_INET6 if ":" in bind_host
                                              else socket.AF_INET)
        self._listener.settimeout(POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._accepter = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=accept_name)
        self._accepter.start()

    # -- tokens (called on the owner's thread) -------------------------------------------------
    def issue_token(self, client_key: str | None = None, scope: str = "") -> bytes | None:
        """A fresh one-time token for ``client_key`` (the CURVE key it was asked with);
        None when ``max_tokens`` are outstanding. ``scope``: handed to ``answer`` with
        every request of the connection it opens (a peer's: the publisher instance)."""
        now = time.monotonic()
        with self._lock:
            for token, (expiry, _, _) in list(self._tokens.items()):
                if expiry < now:
                    del self._tokens[token]
            if len(self._tokens) >= self.limits.max_tokens:
                self.tokens_denied += 1
                return None
            self.tokens_issued += 1
            token = os.urandom(stream_link.TOKEN_BYTES)
            self._tokens[token] = (now + self.limits.token_ttl, client_key, scope)
            return token

    def _take_token(self, token: bytes) -> tuple[bool, str | None, str]:
        """(valid, the key it was handed to, its scope); a token is good once."""
        with self._lock:
            entry = self._tokens.pop(token, None)
        if entry is None or entry[0] < time.monotonic():
            return False, None, ""
        return True, entry[1], entry[2]

    # -- what a subclass says ----------------------------------------------------------------
    def answer(self, conn: socket.socket, request: stream_link.StreamRequest,
               chunks: tuple[int, ...], scope: str) -> None:
        """Answer a plain request for ``chunks`` (on the connection's thread; ``scope``:
        its token's)."""
        raise NotImplementedError

    def answer_slices(self, conn: socket.socket, request: stream_link.StreamRequest,
                      entries: list[tuple[int, list[stream_link.Block]]], scope: str) -> None:
        """Answer a ``slices`` request (only where ``serves_slices``)."""
        raise ProtocolError("stream slices: not served here")

    def overdue(self, stalled: float) -> str | None:
        """Why a reader that took nothing for ``stalled`` s must be cut before
        ``stall_timeout`` (something waits for the bytes it holds); None: not yet."""
        return None

    def port_status(self) -> dict[str, Any]:
        """Counters since start: connections open now, accepted (a good token), refused (a
        bad, used or expired one), turned away (``max_connections``), cut (stalled, bad
        requests, a revoked key); chunk bytes sent; tokens handed out and denied."""
        with self._lock:
            return {"port": self.port, "connections": len(self._conns),
                    "accepted": self.accepted, "refused": self.refused,
                    "turned_away": self.turned_away, "cut": self.cut,
                    "bytes_sent": self.bytes_sent, "chunks_sent": self.chunks_sent,
                    "tokens_issued": self.tokens_issued, "tokens_denied": self.tokens_denied}

    def count_sent(self, chunks: int, nbytes: int) -> None:
        with self._lock:  # counted from every connection's thread
            self.chunks_sent += chunks
            self.bytes_sent += nbytes

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
                time.sleep(POLL_S)
                continue
            with self._lock:
                full = len(self._conns) >= self.limits.max_connections
                if not full:
                    self._conns[conn.fileno()] = conn
                else:
                    self.turned_away += 1
            if full:
                self._warn.warning("stream-full", f"{self._name}: turned a connection away "
                                                  f"({self.limits.max_connections} open)")
                conn.close()
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                      name=self._conn_name)
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        key = conn.fileno()
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            patience = self.limits.hello_timeout  # mid-message, then the reader is cut
            conn.settimeout(patience)
            token = stream_link.parse_hello(
                read_exact(conn, stream_link.HELLO_BYTES, "stream hello", patience))
            valid, client_key, scope = self._take_token(token)
            if not valid:
                with self._lock:  # every connection's thread counts
                    self.refused += 1
                self._warn.warning("stream-token", f"{self._name}: refused a connection "
                                                   "(unknown, used or expired token)")
                conn.sendall(stream_link.reply_header(stream_link.REFUSED))
                return
            with self._lock:  # every connection's thread counts
                self.accepted += 1
            flags = stream_link.FLAG_SLICES if self.serves_slices else 0
            conn.sendall(stream_link.reply_header(stream_link.ACCEPTED, flags=flags))
            conn.settimeout(POLL_S)
            while not self._closed:
                head = read_exact(conn, stream_link.REQUEST_BYTES, "stream request", patience,
                                  idle=lambda: self._closed)
                if client_key is not None and self._allowed is not None \
                        and not self._allowed(client_key.encode()):
                    raise Cut(f"CURVE key {client_key} is not in the allow-list any more")
                request = stream_link.parse_request_head(head, slices=self.serves_slices)
                if request.slices:
                    self.answer_slices(conn, request, _read_slices(conn, request, patience),
                                       scope)
                    continue
                chunks = stream_link.request_chunks(
                    read_exact(conn, 4 * request.count, "stream request", patience, begun=True),
                    request)
                self.answer(conn, request, chunks, scope)
        except (EOFError, ConnectionError, TimeoutError):
            pass  # the reader went (or never said hello in time)
        except (ProtocolError, Cut) as exc:
            with self._lock:  # every connection's thread counts
                self.cut += 1
            self._warn.warning(f"stream-{type(exc).__name__}",
                               f"{self._name}: cut a subscriber: {exc}")
        except OSError as exc:
            if not self._closed:
                self._warn.warning("stream-os", f"{self._name}: connection ended: {exc}")
        finally:
            with self._lock:
                self._conns.pop(key, None)
                self._threads.discard(threading.current_thread())
            conn.close()

    def send_all(self, conn: socket.socket, parts: list[memoryview]) -> None:
        """``sendmsg`` until every byte is in the kernel; cut a reader that stops reading
        (``stall_timeout``, or sooner where ``overdue`` says why)."""
        last = time.monotonic()
        first = 0  # parts[:first] are sent (an index: a slice's parts may be thousands)
        while first < len(parts):
            try:
                sent = conn.sendmsg(parts[first: first + _IOV_MAX])
            except TimeoutError:
                now = time.monotonic()
                if now - last > self.limits.stall_timeout:
                    raise Cut(f"took nothing for {now - last:.0f}s (stall_timeout)") from None
                why = self.overdue(now - last)
                if why is not None:
                    raise Cut(f"took nothing for {now - last:.1f}s {why}") from None
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

    @property
    def closed(self) -> bool:
        return self._closed

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
        self._accepter.join(timeout=2 * POLL_S + 1)
        # the connections end within a poll (their sockets are shut down): once joined no
        # ``sendmsg`` reads the views they were given (the owner may free that memory)
        with self._lock:
            threads = list(self._threads)
        deadline = time.monotonic() + 2 * POLL_S + 1
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _read_slices(conn: socket.socket, request: stream_link.StreamRequest, patience: float
                 ) -> list[tuple[int, list[stream_link.Block]]]:
    """A ``slices`` request's chunks and their blocks, each count bounded before its
    bytes are read; a chunk named twice is a bad request."""
    entries: list[tuple[int, list[stream_link.Block]]] = []
    left = stream_link.MAX_REQUEST_BLOCKS
    for _ in range(request.count):
        chunk, count = stream_link.parse_slice_chunk(
            read_exact(conn, stream_link.SLICE_CHUNK_BYTES, "stream request", patience,
                       begun=True), left)
        left -= count
        blocks = read_exact(conn, 16 * count, "stream request", patience, begun=True)
        entries.append((chunk, stream_link.parse_blocks(blocks, count, chunk)))
    if len({chunk for chunk, _ in entries}) != len(entries):
        raise ProtocolError("stream slices.chunk: a chunk named twice in one request")
    return entries


def read_exact(conn: socket.socket, nbytes: int, what: str, patience: float,
               idle: Any = None, begun: bool = False) -> bytes:
    """Exactly ``nbytes`` of ``what``. Before its first byte a socket timeout is waited
    through while ``idle()`` is False (a connection may sit idle between versions), else
    it ends the connection quietly (nothing was said); once ``what`` (or the message it
    belongs to: ``begun``) has started, ``patience`` seconds without a byte is a ``Cut``
    naming it, so a reader that stops mid-message is counted and logged."""
    data = bytearray()
    last = time.monotonic()
    while len(data) < nbytes:
        try:
            piece = conn.recv(nbytes - len(data))
        except TimeoutError:
            if not data and not begun:
                if idle is not None and not idle():
                    continue
                raise
            waited = time.monotonic() - last
            if waited < patience:
                continue
            raise Cut(f"{what}: {len(data)} of {nbytes} bytes, then nothing for "
                      f"{waited:.1f}s") from None
        if not piece:
            raise EOFError("connection closed")
        data += piece
        last = time.monotonic()
    return bytes(data)


def slice_parts(data: memoryview, blocks: list[stream_link.Block],
                min_row_bytes: int = MIN_ROW_BYTES) -> tuple[list[memoryview], int]:
    """A ``slices`` reply's payload out of ``data`` (the chunk's bytes, where the blocks'
    starts count from), in order: views where a block is one contiguous run or its rows
    are at least ``min_row_bytes``, one gathered copy of a block of shorter rows; and how
    many bytes were gathered. The blocks must lie within ``data`` (checked by the caller)."""
    parts: list[memoryview] = []
    gathered_bytes = 0
    for start, length, stride, rows in blocks:
        if rows == 1 or stride == length:
            parts.append(data[start: start + length * rows])
        elif length >= min_row_bytes:
            parts.extend(data[row: row + length]
                         for row in range(start, start + rows * stride, stride))
        else:
            array = np.frombuffer(data, dtype=np.uint8)
            gathered = np.lib.stride_tricks.as_strided(
                array[start:], shape=(rows, length), strides=(stride, 1)).reshape(-1)
            gathered_bytes += gathered.nbytes
            parts.append(gathered.data)
    return parts, gathered_bytes


def gathered_size(blocks: list[stream_link.Block], min_row_bytes: int = MIN_ROW_BYTES) -> int:
    """Bytes ``slice_parts`` would copy for ``blocks`` (its strided blocks of short rows)."""
    return sum(length * rows for _, length, stride, rows in blocks
               if rows > 1 and stride != length and length < min_row_bytes)
