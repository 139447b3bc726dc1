"""Serving delta chunks (``FetchRequest.base`` set) on the publisher's serving thread.

A chunk still being encoded is held back and sent once ready (checked every
loop turn, like chunks still being copied); a chunk where the delta did not
pay is sent from the version's full bytes, zero-copy. The held-back requests
are bounded, per peer and in all: past either bound a request gets a
``bad_request`` error (the subscriber then fetches the full version). They
drain on their own: every encoding ends, or is cut short and served raw.
"""

from __future__ import annotations

import logging
from collections import Counter

import zmq

from publisher.delta import RAW, DeltaPublisher, EncodedDelta
from publisher.store import VersionStore
from weightpub_wire import protocol as wire

__all__ = ["DeltaServing"]

log = logging.getLogger("weightpub.publisher")


class DeltaServing:
    """Answers delta fetches; owned by ``ServingThread`` and used only on its thread."""

    def __init__(self, deltas: DeltaPublisher | None, store: VersionStore, publisher_id: str,
                 *, max_chunks_per_request: int = 256, max_deferred: int = 65_536,
                 max_deferred_per_peer: int = 4096, zero_copy_min_bytes: int = 64 << 10) -> None:
        self._deltas = deltas
        self._store = store
        self._publisher_id = publisher_id
        self._max_chunks = max_chunks_per_request
        self._max_deferred = max_deferred
        self._max_per_peer = max_deferred_per_peer
        self._per_peer: Counter[bytes] = Counter()
        self._zero_copy_min = zero_copy_min_bytes
        self._deferred: list[tuple[bytes, int, EncodedDelta, int]] = []
        self.bytes_sent = 0

    @property
    def waiting(self) -> bool:
        """Whether chunks are held back until encoded (the loop then polls often)."""
        return bool(self._deferred)

    def serve(self, router: zmq.Socket, identity: bytes, request: wire.FetchRequest) -> None:
        delta = None
        if self._deltas is not None and request.publisher_id == self._publisher_id:
            delta = self._deltas.lookup(request.version, request.base)
        if delta is None:
            self._error(router, identity, request, "version_unavailable",
                        f"no delta of version {request.version} against version {request.base} "
                        "is held here; fetch it in full")
            return
        if len(request.chunks) > self._max_chunks or \
                any(c >= len(delta.payloads) for c in request.chunks):
            self._error(router, identity, request, "bad_request",
                        "chunk ids out of range or too many in one request")
            return
        if len(self._deferred) + len(request.chunks) > self._max_deferred or \
                self._per_peer[identity] + len(request.chunks) > self._max_per_peer:
            self._error(router, identity, request, "bad_request",
                        "too many delta chunks are waiting to be encoded; fetch it in full")
            return
        for chunk in request.chunks:
            if not self._try_send(router, identity, request.req, delta, chunk):
                self._deferred.append((identity, request.req, delta, chunk))
                self._per_peer[identity] += 1

    def flush(self, router: zmq.Socket) -> None:
        """Send the held-back chunks that are encoded by now."""
        waiting = []
        for item in self._deferred:
            if self._try_send(router, *item):
                self._per_peer[item[0]] -= 1
                if not self._per_peer[item[0]]:
                    del self._per_peer[item[0]]
            else:
                waiting.append(item)
        self._deferred = waiting

    def _try_send(self, router: zmq.Socket, identity: bytes, req: int, delta: EncodedDelta,
                  chunk: int) -> bool:
        """Send one chunk if its payload is final; False to try again later."""
        payload = delta.payload(chunk)
        if payload is None:
            return False
        data: memoryview | bytes = payload
        version = None
        if payload is RAW:
            version = self._store.get(delta.version)
            if version is None or version.failed:
                error = wire.ErrorReply(req=req, code="version_unavailable", version=delta.version,
                                        message=f"version {delta.version} is no longer held")
                router.send_multipart([identity, wire.encode(error)])
                return True
            if not version.chunk_ready(chunk):
                return False
            data = version.chunk_view(chunk)
        header = wire.ChunkHeader(req=req, version=delta.version, chunk=chunk, size=len(data))
        router.send(identity, zmq.SNDMORE)
        router.send(wire.encode(header), zmq.SNDMORE)
        if version is not None and len(data) >= self._zero_copy_min:
            version.track(router.send(data, copy=False, track=True))
        elif len(data) >= self._zero_copy_min:  # an immutable payload: ZeroMQ keeps a reference
            router.send(data, copy=False)
        else:
            router.send(data, copy=True)
        self.bytes_sent += len(data)
        return True

    @staticmethod
    def _error(router: zmq.Socket, identity: bytes, request: wire.FetchRequest, code: str,
               message: str) -> None:
        error = wire.ErrorReply(req=request.req, code=code, message=message,
                                version=request.version)
        router.send_multipart([identity, wire.encode(error)])
