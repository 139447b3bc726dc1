"""What a ``SyncClient`` asks the publisher (or its peers) for next, and when it gives up.

Split from ``sync_client.py``: the credit (chunks in flight to the publisher,
bounded by ``window_bytes`` and ``MAX_CHUNKS_IN_FLIGHT``), batching into
``fetch`` requests, routing through peers when sharing, and re-asking what
timed out. The table itself is ``request_table.py``.
"""

from __future__ import annotations

from subscriber_ext.transport.client.sync_state import SyncState
from weightpub_wire import protocol as wire
from weightpub_wire.errors import WeightPubTimeout

__all__ = ["credit", "expire_requests", "top_up"]


def credit(client: SyncState) -> int:
    """Chunks the client may have in flight to the publisher for its target."""
    if client.target is None:
        return 0
    chunks = client.options.window_bytes // client.target.manifest.chunk_size
    return max(1, min(chunks, wire.MAX_CHUNKS_IN_FLIGHT))


def top_up(client: SyncState, now: float) -> None:
    """Ask for more chunks of the target while there is credit (peers first, if sharing)."""
    target = client.target
    if target is None:
        return
    table = client.requests
    asked = table.asked()
    room = credit(client) - table.in_flight()
    if client.peering is not None:  # what peers serve is asked of them, the rest of us
        # enough to fill the publisher's credit and every peer's window, not the whole
        # version: this runs after every chunk (4,096 chunks: 16 M checks per version)
        sources = client.peering.sources
        limit = max(room, 0) + sources.window * max(1, len(sources.links))
        todo = target.next_chunks(asked, limit)
        todo = client.peering.route(target, todo, now) if todo else todo
    else:
        todo = target.next_chunks(asked, room) if room > 0 else []
    while todo and room > 0:
        batch = todo[: min(room, client.options.chunks_per_request)]
        todo = todo[len(batch):]
        req = table.next_id()
        request = wire.FetchRequest(req=req, publisher_id=target.manifest.publisher_id,
                                    version=target.fetch_version, chunks=tuple(batch),
                                    base=target.fetch_base)
        if not client.send(request):
            return
        table.track(req, batch, now)
        room -= len(batch)


def expire_requests(client: SyncState, now: float) -> None:
    """Re-ask (or, after too many tries, abandon) what the publisher did not answer in time."""
    for request in client.requests.timed_out(now, client.options.request_timeout):
        for chunk in request.chunks:
            if client._count_retry(chunk, "timed out", WeightPubTimeout):
                return
