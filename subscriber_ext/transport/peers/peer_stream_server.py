"""A peer-sharing member's plain-TCP stream port (``stream=True``, ``docs/peer-stream.md``).

Why: over the peer ROUTER every forwarded chunk is a ZeroMQ message (and under CURVE
encrypted and decrypted by ZeroMQ); here a chunk goes with one ``sendmsg([header,
view])`` straight from staging and the asker ``recv_into``s it straight into its own
(``peer_stream.py``), verified there against the checksums that came over CURVE. The
connection-serving core (token check, request parsing and bounds, accept thread,
connection cap, stall cut) is the publisher's (``weightpub_wire.stream_port``).

Who may connect: a holder of a one-time token the peer ROUTER handed out
(``PeerStreamRequest`` -> ``StreamToken``; CURVE: only to keys the tracker admitted,
checked there before the request is read), scoped to the publisher instance it was
asked for; the key is asked again (``admitted``) before every request.

Threads: the connection threads never look at staging. A request becomes a job the
subscriber's thread (``pump``, where ``PeerServer`` runs) resolves with the same
``lookup``: a chunk verified here is counted on its pooled buffer
(``BufferPool.send_begin``), charged to the upload budget and handed to the
connection's thread, which ``sendmsg``s it and ends the count once the kernel holds
the bytes (a buffer given back meanwhile drains until then). A chunk not verified yet
waits, up to ``defer_timeout`` (cut-through: ``changed`` wakes the pump); a version
this member will not have (or the wait ran out) answers ``UNAVAILABLE`` at once and the
rest of that request is not sent, so the asker moves on. At most ``max_queued_chunks``
chunks of a connection are handed over and unsent at a time; a reader that takes
nothing for ``stall_timeout``, or for ``drain_grace`` while a buffer it holds waits to
be reused, is cut.

Slices (a sliced member, ``slice_lookup``): a ``slices`` request is answered (and
``FLAG_SLICES`` said in ``ACCEPTED``) for this member's own plan only: a chunk whose
blocks are not exactly its plan's there, or a version it will not have, is
``UNAVAILABLE`` at once (the asker goes elsewhere). The bytes are those
``slice_fetch`` gives for the plan, sent as the publisher sends them
(``stream_port.slice_parts``): views of the sparse staging where a block is a run or its
rows are long, a gathered copy of short rows (made on the subscriber's thread when the
chunk is handed over, alive until sent: ``scratch_bytes``, at most
``max_queued_chunks`` chunks' worth per connection, counted in the staging budget
(``scratch.hold``); with no room there a chunk's short rows go as views, one per row:
slower, the same bytes, counted in ``gather_refused``). A whole-chunk request to a
sliced member is ``UNAVAILABLE`` (it holds only its plan's bytes).
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from subscriber_ext.transport.peers.peer_server import (
    GONE,
    WAIT,
    Lookup,
    PeerServerLimits,
    SendCounts,
    Served,
)
from subscriber_ext.transport.peers.upload_budget import UploadBudget
from weightpub_wire import stream_link
from weightpub_wire.errors import ProtocolError
from weightpub_wire.stream_port import POLL_S, PortLimits, StreamPort, gathered_size, slice_parts

__all__ = ["PeerStreamServer", "StreamSliceLookup"]

#: ``slice_lookup(publisher_id, version, chunk, blocks)``: the chunk's verified bytes (its
#: span of the staging, where the blocks' starts count from) when ``blocks`` are exactly
#: this member's plan's in that chunk; WAIT; or GONE (another plan's, a version it will
#: not have)
StreamSliceLookup = Callable[[str, int, int, list[stream_link.Block]], "Served | str"]
class Scratch(Protocol):
    """Where gathered copies are counted: ``weightpub_wire.buffers.BufferPool``'s budget."""

    def hold(self, nbytes: int) -> bool: ...

    def unhold(self, nbytes: int) -> None: ...


#: one reply handed to a connection: (chunk, its payload's parts (None: ``UNAVAILABLE``),
#: the pooled buffer's send key, bytes of the parts that are a gathered copy)
_Out = tuple[int, list[memoryview] | None, int | None, int]

log = logging.getLogger("weightpub.peers")


@dataclass(eq=False, slots=True)
class _Job:
    """One request of one connection: what the subscriber's thread has left to resolve,
    and what it handed over (chunk, bytes (None: ``UNAVAILABLE``), counted key)."""

    publisher_id: str
    version: int
    req: int
    chunks: deque[int]
    deadline: float
    #: a ``slices`` request's blocks per chunk (None: whole chunks)
    blocks: dict[int, list[stream_link.Block]] | None = None
    out: deque[_Out] = field(default_factory=deque)
    handed: int = 0  # handed over and not sent yet
    done: bool = False  # nothing more will be handed over
    dead: bool = False  # the connection went: what is handed over is ended, not sent
    cond: threading.Condition = field(default_factory=threading.Condition)


class PeerStreamServer(StreamPort):
    """The port, and the jobs its connections wait on (resolved on the subscriber's thread)."""

    def __init__(self, host: str, lookup: Lookup, budget: UploadBudget,
                 limits: PeerServerLimits, *, sends: SendCounts,
                 admitted: Callable[[str], bool] | None = None,
                 slice_lookup: StreamSliceLookup | None = None,
                 scratch: Scratch | None = None) -> None:
        """``admitted(z85 key) -> bool``: CURVE's admitted keys (None: no CURVE);
        ``slice_lookup``: a sliced member's plan (its port then serves ``slices``);
        ``scratch``: the budget gathered copies are counted in (None: not counted)."""
        self.lookup = lookup
        self.scratch = scratch
        self.gather_refused = 0  # slices sent row by row: no room in the budget to gather
        self.slice_lookup = slice_lookup
        self.serves_slices = slice_lookup is not None
        self.slice_bytes_sent = 0  # of the bytes sent: answers to ``slices`` requests
        self.slice_bytes_gathered = 0  # of those: copied first (strided short rows)
        self.scratch_bytes = 0  # gathered copies handed over and not sent yet
        self.budget = budget
        self.peer_limits = limits
        self.sends = sends
        self._jobs: list[_Job] = []
        self._jobs_lock = threading.Lock()
        self._local = threading.local()  # the keys a connection's ``sendmsg`` holds
        self._cpu = 0.0  # connection threads' CPU not yet charged to the budget
        self._dirty = True
        self._next_scan = 0.0
        self.unavailable = 0  # requests answered UNAVAILABLE
        self.send_cpu = 0.0  # CPU seconds the connection threads spent (sends, waits)
        self.pump_cpu = 0.0  # and the subscriber's thread handing chunks over
        # the subscriber's poller wakes when a connection posts a job (``wake_fd``)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        super().__init__(host, 0, PortLimits(max_connections=limits.max_clients,
                                             stall_timeout=limits.stall_timeout),
                         None if admitted is None else lambda key: admitted(key.decode()),
                         accept_name="weightpub-peerstream-accept",
                         conn_name="weightpub-peerstream-conn", label="peer stream", logger=log)

    @property
    def wake_fd(self) -> int:
        return self._wake_r.fileno()

    def _wake(self) -> None:
        self._dirty = True
        try:
            self._wake_w.send(b"w")
        except OSError:
            pass  # full (a wake is pending anyway) or closed

    def changed(self) -> None:
        """Something became servable (a chunk verified, a version started or ended)."""
        self._dirty = True

    # -- a connection's thread ----------------------------------------------------------------
    def answer(self, conn: socket.socket, request: stream_link.StreamRequest,
               chunks: tuple[int, ...], scope: str) -> None:
        self._answer(conn, request, chunks, scope, None)

    def answer_slices(self, conn: socket.socket, request: stream_link.StreamRequest,
                      entries: list[tuple[int, list[stream_link.Block]]], scope: str) -> None:
        if not self.serves_slices:
            raise ProtocolError("stream slices: not served here")
        self._answer(conn, request, tuple(chunk for chunk, _ in entries), scope, dict(entries))

    def _answer(self, conn: socket.socket, request: stream_link.StreamRequest,
                chunks: tuple[int, ...], scope: str,
                blocks: dict[int, list[stream_link.Block]] | None) -> None:
        if len(chunks) > self.peer_limits.max_chunks_per_request:
            raise ProtocolError(f"stream request.count: {len(chunks)} chunks (at most "
                                f"{self.peer_limits.max_chunks_per_request} from a peer)")
        job = _Job(scope, request.version, request.req, deque(chunks),
                   time.monotonic() + self.peer_limits.defer_timeout, blocks)
        with self._jobs_lock:
            self._jobs.append(job)
        self._wake()
        cpu = time.thread_time()
        try:
            while True:
                with job.cond:
                    while not job.out and not job.done and not self.closed:
                        job.cond.wait(POLL_S)
                    items = list(job.out)
                    job.out.clear()
                    finished = job.done
                if self.closed:
                    raise ConnectionError("closing")
                if items:
                    self._send(conn, job, items)
                if finished and not job.out:
                    return
        finally:
            with job.cond:
                job.dead = True
                left = list(job.out)
                job.out.clear()
            for _, _, key, gathered in left:
                if key is not None:
                    self.sends.send_end(key)
                self._unscratch(gathered)
            with self._jobs_lock:
                if job in self._jobs:
                    self._jobs.remove(job)
            spent = time.thread_time() - cpu
            with self._jobs_lock:
                self._cpu += spent
                self.send_cpu += spent

    def _send(self, conn: socket.socket, job: _Job, items: list[_Out]) -> None:
        """One ``sendmsg`` of the items' headers and bytes; their counts end (and their
        gathered copies go) once the kernel holds them (or the send failed)."""
        parts: list[memoryview] = []
        keys = [key for _, _, key, _ in items if key is not None]
        sent = 0
        for chunk, payload, _, _ in items:
            if payload is None:
                parts.append(memoryview(stream_link.reply_header(
                    stream_link.UNAVAILABLE, job.req, job.version, chunk)))
                continue
            size = sum(len(part) for part in payload)
            parts.append(memoryview(stream_link.reply_header(
                stream_link.OK, job.req, job.version, chunk, size)))
            parts.extend(payload)
            sent += size
        self._local.keys = keys
        try:
            self.send_all(conn, parts)
        finally:
            self._local.keys = []
            for key in keys:
                self.sends.send_end(key)
            self._unscratch(sum(gathered for *_, gathered in items))
            with job.cond:
                job.handed -= len(items)
            self._wake()  # room for the next chunks
        self.count_sent(sum(payload is not None for _, payload, _, _ in items), sent)
        if job.blocks is not None:
            with self._jobs_lock:  # counted from every connection's thread
                self.slice_bytes_sent += sent

    def _unscratch(self, gathered: int) -> None:
        if gathered:
            with self._jobs_lock:
                self.scratch_bytes -= gathered
            if self.scratch is not None:
                self.scratch.unhold(gathered)

    def overdue(self, stalled: float) -> str | None:
        keys = getattr(self._local, "keys", [])
        if stalled > self.peer_limits.drain_grace and \
                any(self.sends.draining(key) for key in keys):
            return "while their staging buffer waits to be reused (drain_grace)"
        return None

    # -- the subscriber's thread --------------------------------------------------------------
    def drain_wake(self) -> None:
        """The poller saw ``wake_fd``: read the wakes (the pump runs next)."""
        try:
            self._wake_r.recv(4096)
        except OSError:
            pass

    def pump(self, now: float) -> float:
        """Hand over what can go now; seconds until this wants to run again (inf: idle).
        Its own CPU and the connection threads' are charged to the upload budget."""
        if not self._dirty and now < self._next_scan:
            return self._next_scan - now
        cpu = time.thread_time()
        try:
            return self._pump(now)
        finally:
            spent = time.thread_time() - cpu
            self.pump_cpu += spent
            self.budget.charge(spent)

    def _pump(self, now: float) -> float:
        self._dirty = False
        with self._jobs_lock:
            jobs = list(self._jobs)
            cpu, self._cpu = self._cpu, 0.0
        self.budget.charge(cpu)
        wake = math.inf
        for job in jobs:
            wait = self._resolve(job, now)
            if wait < 0:  # the budget says wait: no job goes before then
                self._next_scan = now + min(-wait, 0.05)
                return self._next_scan - now
            wake = min(wake, wait)
        self._next_scan = now + wake
        return wake

    def _resolve(self, job: _Job, now: float) -> float:
        """Hand over ``job``'s next chunks; seconds until its deadline (inf: nothing to
        wait for), or minus what the budget wants waited."""
        while True:
            with job.cond:
                if job.dead or job.done:
                    return math.inf
                if not job.chunks:
                    job.done = True
                    job.cond.notify()
                    return math.inf
                if job.handed >= self.peer_limits.max_queued_chunks:
                    return math.inf  # the send ending wakes the pump
            chunk = job.chunks[0]
            blocks = None if job.blocks is None else job.blocks[chunk]
            if blocks is None:
                found = self.lookup(job.publisher_id, job.version, chunk)
            elif self.slice_lookup is None:
                found = GONE
            else:
                found = self.slice_lookup(job.publisher_id, job.version, chunk, blocks)
            if found == GONE or (found == WAIT and now >= job.deadline):
                self.unavailable += 1
                self._hand(job, chunk, None, None, 0, last=True)
                return math.inf
            if not isinstance(found, Served):
                return job.deadline - now
            size = len(found.data) if blocks is None else \
                sum(length * rows for _, length, _, rows in blocks)
            wait = self.budget.delay(size, now)
            if wait > 0:
                return -wait
            key = None if found.buffer is None else self.sends.send_begin(found.buffer)
            if blocks is None:
                payload, gathered = [found.data], 0
            else:  # views of the staging, a copy of short rows (the subscriber's thread)
                need = gathered_size(blocks)
                if need and self.scratch is not None and not self.scratch.hold(need):
                    self.gather_refused += 1  # no room to copy them: a view per row
                    payload, gathered = slice_parts(found.data, blocks, min_row_bytes=0)
                else:
                    payload, gathered = slice_parts(found.data, blocks)
                    assert gathered == need
                with self._jobs_lock:
                    self.scratch_bytes += gathered
                    self.slice_bytes_gathered += gathered
            if not self._hand(job, chunk, payload, key, gathered):
                self.budget.refund(size)
                return math.inf
            job.chunks.popleft()

    def _hand(self, job: _Job, chunk: int, payload: list[memoryview] | None,
              key: int | None, gathered: int, last: bool = False) -> bool:
        with job.cond:
            if job.dead:
                if key is not None:
                    self.sends.send_end(key)
                self._unscratch(gathered)
                return False
            job.out.append((chunk, payload, key, gathered))
            job.handed += 1
            job.done = job.done or last
            job.cond.notify()
            return True

    def stats(self) -> dict[str, Any]:
        """What this member sent over its stream port, and how it was used."""
        status = self.port_status()
        return {"stream_port": status["port"], "stream_connections": status["connections"],
                "stream_bytes_sent": status["bytes_sent"],
                "stream_chunks_sent": status["chunks_sent"],
                "stream_tokens_issued": status["tokens_issued"],
                "stream_refused": status["refused"], "stream_cut": status["cut"],
                "stream_unavailable": self.unavailable,
                "stream_slices": self.serves_slices,
                "stream_slice_bytes_sent": self.slice_bytes_sent,
                "stream_slice_bytes_gathered": self.slice_bytes_gathered,
                "stream_scratch_bytes": self.scratch_bytes,
                "stream_gather_refused": self.gather_refused,
                "stream_cpu_s": {"sends": round(self.send_cpu, 3),
                                 "pump": round(self.pump_cpu, 3)}}

    def close(self) -> None:
        super().close()
        with self._jobs_lock:
            jobs = list(self._jobs)
        for job in jobs:  # what the closing connections did not send is ended with them
            with job.cond:
                job.cond.notify_all()
        self._wake_r.close()
        self._wake_w.close()
