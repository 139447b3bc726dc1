"""The fetch requests a ``SyncClient`` has out, and what it has given up on.

Split from ``sync_client.py``: which chunks each request asked for and of whom
(the publisher, or a peer for ``peering.py``), how often each chunk has been
tried, which requests timed out, and which versions were abandoned recently
(a growing back-off, 1 s .. 30 s) are bookkeeping; the state machine decides
what a timeout or a failed chunk means for its target (``fetch_credit.py``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Request", "RequestTable", "VersionBackoff"]

#: a request the publisher is still working through (chunks keep coming) waits at most
#: this many ``request_timeout``s before it is asked again
QUEUED_TIMEOUT_FACTOR = 10


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
        # when the publisher last answered a chunk: it serves a client's requests in
        # order, so while chunks keep coming the ones queued behind them are not lost
        self.publisher_answered = 0.0

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
        if request.source is None:
            self.publisher_answered = time.monotonic()
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

    def timed_out(self, now: float, timeout: float, source: Any = None,
                  answered: float | None = None) -> Iterator[Request]:
        """Requests sent through ``source`` (None: the publisher's own DEALER) unanswered
        for ``timeout`` while no chunk came from it either (``answered``: when it last
        answered; default the publisher's), each removed before it is yielded (peers'
        requests: peering.py gives up on a peer that stalls).

        Counting from the publisher's last answer, not from the send: on a shared,
        slow uplink (16 replicas behind one 400 Mbit/s link) a full window takes longer
        than ``timeout`` to drain, and re-asking what is merely queued would send it
        twice and collapse the link. Still, nothing waits longer than
        ``QUEUED_TIMEOUT_FACTOR`` timeouts: a publisher that answers others but never
        this one (a reply dropped on its side) cannot hold a chunk forever."""
        last = self.publisher_answered if answered is None else answered
        for req, request in list(self.requests.items()):
            if request.source is not source:
                continue
            waited = now - request.sent_at
            if waited < QUEUED_TIMEOUT_FACTOR * timeout and \
                    now - max(request.sent_at, last) < timeout:
                continue
            del self.requests[req]
            yield request


class VersionBackoff:
    """Versions given up, by (publisher_id, version): how often, and until when to wait."""

    def __init__(self) -> None:
        self._failed: dict[tuple[str, int], tuple[int, float]] = {}

    def record(self, publisher_id: str, version: int, now: float) -> None:
        """The version was given up at ``now``: wait 1 s, 2 s, 4 s ... (at most 30 s)."""
        key = (publisher_id, version)
        count = self._failed.get(key, (0, 0.0))[0] + 1
        self._failed[key] = (count, now + min(30.0, 2.0 ** (count - 1)))

    def forget(self, publisher_id: str, version: int) -> None:
        self._failed.pop((publisher_id, version), None)

    def waiting(self, publisher_id: str, version: int, now: float) -> bool:
        backoff = self._failed.get((publisher_id, version))
        return backoff is not None and now < backoff[1]
