"""The publisher's ROUTER as a ``ChunkSource``: every chunk of a version, under the credit.

Why the client's own DEALER: the publisher answers chunks and control messages
(``latest``, reports, collective polls, peer plans) on one connection, so the
client reads that DEALER itself (``SyncClient.on_dealer``) and hands chunk
replies to the receiver as this source's; requests are tracked with ``via`` None,
the request table's name for this connection (``request_table.py``). It is the
last picker's answer (``source_choice.py``): whatever no other source serves
comes from here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.chunk_source import ChunkSource, Retry
from subscriber_ext.transport.staging.request_table import RequestTable
from weightpub_wire import protocol as wire
from weightpub_wire.errors import WeightPubTimeout

__all__ = ["PublisherSource"]


class PublisherSource(ChunkSource):
    """Asks the publisher, in ``fetch`` requests of ``chunks_per_request``."""

    def __init__(self, requests: RequestTable, send: Callable[[wire.Message], bool], *,
                 chunks_per_request: int, request_timeout: float) -> None:
        """``send``: one message on the client's DEALER, False when it cannot go now."""
        self._requests = requests
        self._send = send
        self.chunks_per_request = chunks_per_request
        self.request_timeout = request_timeout

    @property
    def label(self) -> str:
        return "publisher"

    def room(self, window: int) -> int:
        """Asked in whole requests: while chunks are in flight, less room than one
        request's worth (``chunks_per_request``, or the window when smaller) asks nothing
        yet, so the steady state sends a request per ``chunks_per_request`` chunks that
        land rather than one per chunk (each costs a send and a reply's bookkeeping on
        both sides); the window minus a request still keeps the link busy."""
        in_flight = self._requests.in_flight()
        room = window - in_flight
        if in_flight and room < min(self.chunks_per_request, window):
            return 0
        return room

    def ask(self, target: Assembly, chunks: Sequence[int], now: float) -> list[int]:
        todo = list(chunks)
        table = self._requests
        while todo:
            batch = todo[: self.chunks_per_request]
            req = table.next_id()
            request = wire.FetchRequest(req=req, publisher_id=target.manifest.publisher_id,
                                        version=target.fetch_version, chunks=tuple(batch),
                                        base=target.fetch_base)
            if not self._send(request):
                return todo  # not connected (yet): asked again at the next top-up
            table.track(req, batch, now)
            todo = todo[len(batch):]
        return todo

    def expire(self, now: float, retry: Retry) -> bool:
        """Requests unanswered for ``request_timeout`` while no chunk came from the
        publisher either (``RequestTable.timed_out``): each chunk counts a try."""
        for request in self._requests.timed_out(now, self.request_timeout):
            for chunk in request.chunks:
                if retry(chunk, "timed out", WeightPubTimeout):
                    return True
        return False
