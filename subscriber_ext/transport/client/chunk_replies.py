"""One chunk reply, from any ``ChunkSource``: receive it into place, verify, route on.

Split from ``sync_client.py``: the ``chunk`` reply (``weightpub_wire.chunk_frame``:
inline, or a header whose payload is the next message) is the data path's hot spot and has the most
outcomes (stale, duplicate, malformed, checksum mismatch, a delta that does not
decode, verified), each with its own consequence for the request table, the
source that sent it (``arrived`` / ``refused``) and the target. The frame is
taken as ZeroMQ delivered it (``recv(copy=False)``) and its payload copied once,
into the target's buffer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from subscriber_ext.transport.client.client_report import ClientReport
from subscriber_ext.transport.client.fetch_credit import FetchCredit
from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.chunk_listener import ChunkListener, final_bytes
from subscriber_ext.transport.staging.chunk_source import ChunkSource
from subscriber_ext.transport.staging.delta_assembly import DeltaState
from weightpub_wire import chunk_frame
from weightpub_wire.checksums import chunk_checksum
from weightpub_wire.errors import (
    ChecksumError,
    ProtocolError,
    ProtocolVersionError,
    WeightPubError,
)

__all__ = ["ChunkReceiver", "discard_rest", "parse_chunk", "within"]

log = logging.getLogger("weightpub.subscriber")


def discard_rest(sock: zmq.Socket, more: int) -> None:
    """Read and drop the remaining frames of a multipart message."""
    while more:
        sock.recv(copy=False)
        more = int(sock.getsockopt(zmq.RCVMORE))


def within(context: str, exc: ProtocolError) -> ProtocolError:
    """``exc`` with ``context`` in front, of the same kind (a version mismatch stays one)."""
    if isinstance(exc, ProtocolVersionError):
        return ProtocolVersionError(f"{context}: {exc.what}", exc.theirs, exc.ours)
    return ProtocolError(f"{context}: {exc}")


def parse_chunk(frame: zmq.Frame, more: int) -> chunk_frame.ChunkHeader:
    """The header of a chunk frame; ``ProtocolError`` if it is malformed or not alone."""
    header = chunk_frame.parse(frame.buffer)
    if more:
        raise ProtocolError(f"chunk {header.chunk}: more frames follow a one-frame reply")
    return header


class ChunkReceiver:
    """Chunk frames into the target: the table, the source that sent each, the bytes counted."""

    def __init__(self, credit: FetchCredit, report: ClientReport,
                 deltas: DeltaState, listeners: list[ChunkListener], *,
                 target: Callable[[], Assembly | None],
                 complete: Callable[[Assembly], None],
                 delta_failed: Callable[[Assembly, WeightPubError], None]) -> None:
        """``target()``: the version being fetched; ``complete(target)``: every chunk is
        in; ``delta_failed(target, why)``: fetch that version in full instead."""
        self.received_bytes = 0  # data-path bytes accepted into staging
        self.checksum_failures = 0
        self.held = 0  # chunks whose bytes landed before their sum (``sums_follow``)
        self._credit = credit
        self._requests = credit.requests
        self._report = report
        self._deltas = deltas
        self._listeners = listeners
        self._target = target
        self._complete = complete
        self._delta_failed = delta_failed

    def receive(self, header: chunk_frame.ChunkHeader, frame: zmq.Frame, source: ChunkSource,
                via: object) -> None:
        """Handle one parsed chunk (its payload in ``frame``: ``chunk_frame.payload``) that
        ``source`` delivered through ``via`` (what it tracked the request under)."""
        target = self._target()
        table = self._requests
        request = table.get(header.req)
        if not (
            target is not None and request is not None and request.source is via
            and header.version == target.fetch_version and header.chunk in request.chunks
            and target.accepts(header.chunk, header.size)
        ):
            return  # stale (conflated / timed out) or not ours
        table.chunk_done(header.req, request, header.chunk)
        if header.chunk not in target.missing:  # already here from another source
            return
        # the one copy, out of ZeroMQ's frame, checksummed in the same pass
        digest = target.place(header.chunk, chunk_frame.payload(frame.buffer, header))
        self._landed(target, header.chunk, header.version, header.size, digest, source, via)

    def in_place(self, req: int, version: int, chunk: int, source: ChunkSource,
                 via: object, digest: int | None = None) -> bool | None:
        """A chunk ``source`` wrote straight into the target's buffer (a one-sided read, a
        stream's ``recv_into``; no frame): verify it there, as ``receive`` does a copied
        one (``digest``: its checksum, taken as the bytes landed; None: taken here). True:
        verified; False: refused (its checksum, or not a full version's bytes); None:
        stale."""
        target = self._target()
        request = self._requests.get(req)
        if target is None or request is None or request.source is not via \
                or version != target.fetch_version or chunk not in request.chunks:
            return None
        self._requests.chunk_done(req, request, chunk)
        if chunk not in target.missing:
            return None
        if target.fetch_base:
            return False  # a delta step's bytes are decoded from scratch, never read in place
        return self._landed(target, chunk, version, target.in_place_bytes(chunk), digest,
                            source, via)

    def _landed(self, target: Assembly, chunk: int, version: int, size: int,
                digest: int | None, source: ChunkSource, via: object) -> bool:
        """A chunk's bytes are in place: verify, then route on (both kinds of arrival). A
        chunk whose sum has not come yet (``Manifest.sums_follow``) is held until it does
        (``sums_arrived``): neither verified nor asked again meanwhile."""
        self.received_bytes += size
        target.count_received(source.kind, size)
        self._deltas.count(target, size)
        if not target.sum_known(chunk):
            if digest is None:
                digest = chunk_checksum(target.chunk_target(chunk))
            target.hold(chunk, digest, size, source, via)
            self.held += 1
            self._credit.top_up(time.monotonic())
            return True
        return self._judge(target, chunk, version, size, digest, source, via)

    def sums_arrived(self, target: Assembly, chunks: tuple[int, ...],
                     sums: tuple[int, ...]) -> None:
        """Sums that followed the manifest (``weightpub_wire.sum_messages``, over the
        ROUTER): learn them, then judge every held chunk they cover."""
        for chunk, value in zip(chunks, sums, strict=True):
            if not target.learn_sum(chunk, value):
                self._report.bad(ProtocolError(f"chunk_sums_rep: chunk {chunk} of version "
                                               f"{target.manifest.version} got two sums"))
        for chunk in chunks:
            held = target.awaiting.pop(chunk, None)
            if held is None:
                continue
            digest, size, source, via = held
            self._judge(target, chunk, target.fetch_version, size, digest, source, via,
                        held=True)
            if self._target() is not target:
                return  # staged, or given up

    def _judge(self, target: Assembly, chunk: int, version: int, size: int,
               digest: int | None, source: ChunkSource, via: object,
               held: bool = False) -> bool:
        """Verify a chunk in place against its sum; route on (``held``: it waited for its
        sum, and is missing again if it fails it)."""
        final = final_bytes(target)
        if not target.verify(chunk, size, digest):
            self.checksum_failures += 1
            if held:
                target.unhold(chunk)
            if target.fetch_base:  # a delta step (whole or slices): fetch it raw instead
                self._delta_failed(target,
                                   target.error or ChecksumError("delta chunk refused"))
                return False
            why = f"chunk {chunk} of version {version}: checksum mismatch"
            if source.refused(via, chunk, why, time.monotonic()):
                if held:
                    self._credit.top_up(time.monotonic())
                return False  # the source dealt with it (a peer: banned, its chunks go elsewhere)
            self._report.bad(ChecksumError(f"{why}, refetching"))
            self._credit.count_retry(chunk, "failed its checksum", ChecksumError)
            if held:
                self._credit.top_up(time.monotonic())
            return False
        source.arrived(via, size, time.monotonic())
        if final and self._listeners:
            start, span = target.manifest.chunk_span(chunk)
            data = target.view[start: start + span]
            for listener in self._listeners:
                try:
                    listener.chunk_verified(target.manifest, chunk, data)
                except Exception:
                    log.exception("chunk listener failed")
        if target.done:
            self._complete(target)
        else:
            self._credit.top_up(time.monotonic())
        return True
