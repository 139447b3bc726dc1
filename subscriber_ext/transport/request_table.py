"""The fetch requests a ``SyncClient`` has out, and what it asks for next.

Split from ``sync_client.py``: which chunks each request asked for and of whom
(the publisher, or a peer for ``peering.py``), how often each chunk has been
tried, the credit (chunks in flight to the publisher, bounded by the window and
``MAX_CHUNKS_IN_FLIGHT``) and the timeouts are bookkeeping over one table. The
state machine decides what a timeout or a failed chunk means for its target.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightpub_wire import protocol as wire
from weightpub_wire.errors import WeightPubTimeout

if TYPE_CHECKING:  # pragma: no cover - typing only (sync_client imports this module)
    from subscriber_ext.transport.sync_client import SyncClient

__all__ = ["Request", "RequestTable", "expire_requests", "top_up"]


@dataclass(slots=True)
class Request:
    chunks: set[int]
    sent_at: float
    source: Any = None  # the peer asked (a ``sources.PeerLink``); None: the publisher


class RequestTable:
    """Requests in flight by id, and tries per chunk of the current target."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.requests: dict[int, Request] = {}
        self.retries: dict[int, int] = {}

    def next_id(self) -> int:
        """A fresh request id (shared by fetches, ``latest`` requests and peers' fetches)."""
        return next(self._ids)

    def track(self, req: int, chunks: tuple[int, ...] | list[int], now: float,
              source: Any = None) -> None:
        self.requests[req] = Request(set(chunks), now, source)

    def get(self, req: int) -> Request | None:
        return self.requests.get(req)

    def __contains__(self, req: int) -> bool:
        return req in self.requests

    def forget(self, req: int) -> None:
        del self.requests[req]

    def clear(self) -> None:
        """A new target (or none): nothing asked, nothing tried."""
        self.requests.clear()
        self.retries.clear()

    def chunk_done(self, req: int, request: Request, chunk: int) -> None:
        request.chunks.discard(chunk)
        if not request.chunks:
            del self.requests[req]

    def count_try(self, chunk: int) -> int:
        """One more try of ``chunk``; returns how many it has had."""
        tries = self.retries.get(chunk, 0) + 1
        self.retries[chunk] = tries
        return tries

    def asked(self) -> set[int]:
        """Chunks asked of anyone and not yet answered."""
        return set().union(*(r.chunks for r in self.requests.values())) if self.requests \
            else set()

    def in_flight(self) -> int:
        """Chunks asked of the publisher (what its credit counts)."""
        return sum(len(r.chunks) for r in self.requests.values() if r.source is None)

    def peer_in_flight(self) -> dict[Any, int]:
        counts: dict[Any, int] = {}
        for request in self.requests.values():
            if request.source is not None:
                counts[request.source] = counts.get(request.source, 0) + len(request.chunks)
        return counts

    def peer_requests(self, source: Any) -> set[int]:
        return {req for req, r in self.requests.items() if r.source is source}

    def drop(self, source: Any) -> None:
        """Forget what ``source`` was asked: its chunks are asked of the next source."""
        for req in self.peer_requests(source):
            del self.requests[req]

    def timed_out(self, now: float, timeout: float) -> Iterator[Request]:
        """Publisher requests older than ``timeout``, each removed before it is yielded
        (peers' requests: peering.py gives up on a peer that stalls)."""
        for req, request in list(self.requests.items()):
            if request.source is not None or now - request.sent_at < timeout:
                continue
            del self.requests[req]
            yield request


def credit(client: SyncClient) -> int:
    """Chunks the client may have in flight to the publisher for its target."""
    if client.target is None:
        return 0
    chunks = client.options.window_bytes // client.target.manifest.chunk_size
    return max(1, min(chunks, wire.MAX_CHUNKS_IN_FLIGHT))


def top_up(client: SyncClient, now: float) -> None:
    """Ask for more chunks of the target while there is credit (peers first, if sharing)."""
    target = client.target
    if target is None:
        return
    table = client.requests
    asked = table.asked()
    room = credit(client) - table.in_flight()
    if client.peering is not None:  # what peers serve is asked of them, the rest of us
        todo = [c for c in target.order if c in target.missing and c not in asked]
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


def expire_requests(client: SyncClient, now: float) -> None:
    """Re-ask (or, after too many tries, abandon) what the publisher did not answer in time."""
    for request in client.requests.timed_out(now, client.options.request_timeout):
        for chunk in request.chunks:
            if client._count_retry(chunk, "timed out", WeightPubTimeout):
                return
