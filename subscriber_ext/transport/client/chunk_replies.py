"""One chunk reply, from the publisher or a peer: receive it into place, verify, route on.

Split from ``sync_client.py``: the two-frame ``chunk`` reply is the data path's
hot spot and has the most outcomes (stale, duplicate, truncated, checksum
mismatch, a delta that does not decode, verified), each with its own
consequence for the request table, the peer that sent it and the target. The
bytes go straight into the target's buffer (``recv_into``), never copied.
"""

from __future__ import annotations

import logging
import time

import zmq

from subscriber_ext.transport.client.fetch_credit import top_up
from subscriber_ext.transport.client.sync_state import SyncState
from subscriber_ext.transport.staging.chunk_listener import final_bytes
from subscriber_ext.transport.staging.delta_assembly import DeltaAssembly
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ChecksumError, ProtocolError

__all__ = ["discard_rest", "receive_chunk"]

log = logging.getLogger("weightpub.subscriber")


def discard_rest(sock: zmq.Socket, more: int) -> None:
    """Read and drop the remaining frames of a multipart message."""
    while more:
        sock.recv(copy=False)
        more = int(sock.getsockopt(zmq.RCVMORE))


def receive_chunk(client: SyncState, header: wire.ChunkHeader, more: int,
                  sock: zmq.Socket) -> None:
    """Handle one ``chunk`` header whose payload frame is next on ``sock``."""
    target = client.target
    table = client.requests
    request = table.get(header.req)
    source = None if request is None else request.source
    if not (
        more and target is not None and request is not None
        and sock is (client.dealer if source is None else source.sock)
        and header.version == target.fetch_version and header.chunk in request.chunks
        and target.accepts(header.chunk, header.size)
    ):
        discard_rest(sock, more)
        return  # stale (conflated / timed out) or not ours
    if header.chunk not in target.missing:  # already here from another source
        discard_rest(sock, more)
        table.chunk_done(header.req, request, header.chunk)
        return
    size = sock.recv_into(target.chunk_target(header.chunk))
    client.received_bytes += size
    extra = int(sock.getsockopt(zmq.RCVMORE))
    table.chunk_done(header.req, request, header.chunk)
    if size != header.size or extra:
        discard_rest(sock, extra)
        why = f"chunk {header.chunk}: {size} bytes received, header said {header.size}"
        if source is not None and client.peering is not None:
            client.peering.chunk_failed(source, "truncated", why, time.monotonic())
            return
        client._bad(ProtocolError(why))
        client._count_retry(header.chunk, "arrived truncated", ProtocolError)
        return
    client.deltas.count(target, size)
    final = final_bytes(target)
    if not target.verify(header.chunk, size):
        client.checksum_failures += 1
        if isinstance(target, DeltaAssembly):
            client._delta_failed(target, target.error or ChecksumError("delta chunk refused"))
            return
        why = f"chunk {header.chunk} of version {header.version}: checksum mismatch"
        if source is not None and client.peering is not None:
            client.peering.chunk_failed(source, "checksum", why, time.monotonic())
            return
        client._bad(ChecksumError(f"{why}, refetching"))
        client._count_retry(header.chunk, "failed its checksum", ChecksumError)
        return
    if source is not None and client.peering is not None:
        client.peering.arrived(source, size, time.monotonic())
    if final and client.listeners:
        start, span = target.manifest.chunk_span(header.chunk)
        data = target.view[start: start + span]
        for listener in client.listeners:
            try:
                listener.chunk_verified(target.manifest, header.chunk, data)
            except Exception:
                log.exception("chunk listener failed")
    if not target.missing:
        client._complete(target)
    else:
        top_up(client, time.monotonic())
