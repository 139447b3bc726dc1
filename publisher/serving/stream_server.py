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

Threads and bounds: the connection-serving core (token check, request parsing and
bounds, accept thread, connection cap, stall cut) is ``weightpub_wire.stream_port``,
shared with the peers' stream port; one accept thread (``weightpub-stream-accept``) and
one thread per connection (``weightpub-stream-conn``). A connection holds one request
and the slice gathers of one batch
(about ``slice_batch_bytes`` plus a chunk, counted in ``scratch_bytes`` until sent, which
the publisher counts in its host budget); tokens outstanding are bounded and expire. A
chunk's region is counted as being sent (``PublishedVersion.send_begin``) only during
its ``sendmsg`` calls: once they return the kernel holds a copy, so a newer snapshot may
overwrite it. A subscriber that stops reading for ``stall_timeout`` (or
``overwrite_grace`` while a snapshot waits for the region) is cut.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from publisher.store.version_store import PublishedVersion, VersionStore
from weightpub_wire import protocol as wire
from weightpub_wire import stream_link
from weightpub_wire.errors import ProtocolError
from weightpub_wire.stream_port import MIN_ROW_BYTES, PortLimits, StreamPort, slice_parts

__all__ = ["StreamLimits", "StreamServer"]

log = logging.getLogger("weightpub.publisher")

#: one reply of a batch: (chunk, payload bytes, what makes its payload's buffers and says
#: how many bytes of them it gathered: called while the chunk's region is counted as being
#: sent, so a gather copies final bytes)
_Item = tuple[int, int, Callable[[], tuple[list[memoryview], int]]]


@dataclass(frozen=True, slots=True)
class StreamLimits(PortLimits):
    overwrite_grace: float = 2.0  # stalled this long while a newer snapshot waits: cut
    ready_wait: float = 60.0  # a chunk announced before its copy ended: wait this long
    batch_bytes: int = 16 << 20  # chunks of one request sent in one sendmsg, at most this
    #: the same for slices: what a connection's gathers hold at once is about this (plus a
    #: chunk), and the next batch is gathered while the kernel still sends the last
    slice_batch_bytes: int = 4 << 20
    #: strided slice rows shorter than this are gathered (``stream_port.slice_parts``)
    min_row_bytes: int = MIN_ROW_BYTES


class StreamServer(StreamPort):
    """The publisher's stream port: chunks and slices of the store's snapshots."""

    #: answers ``slices`` requests (and says so in ``ACCEPTED``); a test sets it False to
    #: play a publisher from before them
    serves_slices = True
    limits: StreamLimits

    def __init__(self, store: VersionStore, host: str, port: int = 0,
                 limits: StreamLimits | None = None,
                 allowed: Callable[[bytes], bool] | None = None) -> None:
        """``allowed(z85 key)``: the CURVE allow-list, asked again before every request of
        a connection whose token was handed to that key (a key revoked meanwhile is cut,
        as the ROUTER cuts it)."""
        self.store = store
        self.slice_bytes_sent = 0  # of ``bytes_sent``: answers to ``slices`` requests
        self.slice_bytes_gathered = 0  # of those: copied first (strided short rows)
        #: gathered copies alive now (being sent): counted in the publisher's host budget
        self.scratch_bytes = 0
        super().__init__(host, port, limits or StreamLimits(), allowed,
                         accept_name="weightpub-stream-accept", conn_name="weightpub-stream-conn",
                         label="stream", logger=log)

    # -- what is sent (a test may wrap it) ------------------------------------------------------
    def chunk_bytes(self, version: PublishedVersion, chunk: int) -> memoryview:
        return version.chunk_view(chunk)

    def slice_bytes(self, version: PublishedVersion, chunk: int,
                    blocks: list[stream_link.Block]) -> tuple[list[memoryview], int]:
        """The blocks' bytes of ``chunk``, in order: views of the snapshot (a contiguous
        run, or each row of at least ``min_row_bytes``), a gathered copy of shorter rows;
        and how many bytes were gathered."""
        return slice_parts(self.chunk_bytes(version, chunk), blocks, self.limits.min_row_bytes)

    def status(self) -> dict[str, Any]:
        """The port's counters (``StreamPort.port_status``) and the slices': bytes sent
        answering ``slices`` requests, and of those gathered (copied) first."""
        status = self.port_status()
        with self._lock:
            status.update(slice_bytes_sent=self.slice_bytes_sent,
                          slice_bytes_gathered=self.slice_bytes_gathered)
        return status

    def wire_status(self) -> wire.StreamPort:
        """``status()`` as a status reply carries it (``weightpub status``)."""
        return wire.StreamPort(**self.status())

    # -- answers (on a connection's thread) ---------------------------------------------------
    def answer(self, conn: socket.socket, request: stream_link.StreamRequest,
                chunks: tuple[int, ...], scope: str = "") -> None:
        """Send ``chunks`` of the request whole (see ``_reply``)."""
        def item(version: PublishedVersion, chunk: int) -> _Item:
            data = self.chunk_bytes(version, chunk)
            return chunk, len(data), lambda: ([data], 0)

        self._reply(conn, request, chunks, item)

    def answer_slices(self, conn: socket.socket, request: stream_link.StreamRequest,
                       entries: list[tuple[int, list[stream_link.Block]]],
                       scope: str = "") -> None:
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
            self.send_all(conn, parts)
        finally:
            for chunk in begun:
                version.send_end(chunk)
            with self._lock:  # the gathers go with ``parts`` (the kernel holds its copy)
                self.scratch_bytes -= held
        sent = sum(size for _, size, _ in batch)
        self.count_sent(len(batch), sent)
        if slices:
            with self._lock:  # counted from every connection's thread
                self.slice_bytes_sent += sent
        return True

    def overdue(self, stalled: float) -> str | None:
        if stalled > self.limits.overwrite_grace and self.store.writers_waiting():
            return "while a new version waits to overwrite the bytes (overwrite_grace)"
        return None
