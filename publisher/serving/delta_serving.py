"""Serving delta chunks (``FetchRequest.base`` set) on the publisher's serving thread.

A chunk still being encoded is held back and sent once ready (checked every
loop turn, like chunks still being copied); a chunk where the delta did not
pay is sent from the version's full bytes; either way as one chunk frame
(``weightpub_wire.chunk_frame``). The held-back requests
are bounded, per peer and in all: past either bound a request gets a
``bad_request`` error (the subscriber then fetches the full version). They
drain on their own: every encoding ends, or is cut short and served raw.
A fetch naming a slice plan (``FetchRequest.plan``, a sliced subscriber: issue 30)
gets, for each chunk whose delta payload is not shorter than the plan's bytes of that
chunk (a chunk sent raw, a plan touching it thinly), those bytes gathered instead
(``SliceServing.layout_for``; one copy, as a slice reply): each chunk costs the
smaller of the two. The subscriber tells them apart by size.
Every frame goes out through the server's per-peer credit
(``publisher/serving/connection_credit.py``):
a chunk a peer has no room for waits here like one still being encoded
(``deferred_sends.py``, as slices do).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from publisher.deltas.delta_encoder import RAW, DeltaPublisher, EncodedDelta
from publisher.serving.deferred_sends import DeferredSends
from publisher.store.version_store import PublishedVersion, VersionStore
from weightpub_wire import protocol as wire
from weightpub_wire.chunk_frame import ChunkHeader
from weightpub_wire.slice_layout import SliceLayout

__all__ = ["DeltaServing"]

log = logging.getLogger("weightpub.publisher")

#: (identity, chunk header, payload, version it points into, owned) -> sent (or peer gone)
Send = Callable[[bytes, ChunkHeader, "memoryview | bytes", "PublishedVersion | None", bool],
                bool]
Reply = Callable[[bytes, bytes], bool]
#: (plan digest, version) -> the plan's layout in that version, or None
SliceLayouts = Callable[[str, int], "SliceLayout | None"]


@dataclass(frozen=True, slots=True)
class _Fetch:
    """One delta fetch's source: the encoded delta, and the plan's layout if it named one."""

    delta: EncodedDelta
    layout: SliceLayout | None


class DeltaServing:
    """Answers delta fetches; owned by ``ServingThread`` and used only on its thread."""

    def __init__(self, deltas: DeltaPublisher | None, store: VersionStore, publisher_id: str,
                 send: Send, reply: Reply, *, max_chunks_per_request: int = 256,
                 max_deferred: int = 65_536, max_deferred_per_peer: int = 4096,
                 slice_layouts: SliceLayouts | None = None) -> None:
        self._deltas = deltas
        self._slice_layouts = slice_layouts
        self._send = send
        self._reply = reply
        self._store = store
        self._publisher_id = publisher_id
        self._max_chunks = max_chunks_per_request
        self._deferred: DeferredSends[_Fetch] = DeferredSends(max_deferred,
                                                              max_deferred_per_peer)
        self.bytes_sent = 0
        self.slice_chunks = 0  # chunks sent as the plan's slice instead of their delta

    @property
    def waiting(self) -> bool:
        """Whether chunks are held back until encoded (the loop then polls often)."""
        return bool(self._deferred)

    def serve(self, identity: bytes, request: wire.FetchRequest) -> None:
        delta = None
        if self._deltas is not None and request.publisher_id == self._publisher_id:
            delta = self._deltas.lookup(request.version, request.base)
        if delta is None:
            self._error(identity, request, "version_unavailable",
                        f"no delta of version {request.version} against version {request.base} "
                        "is held here; fetch it in full")
            return
        if len(request.chunks) > self._max_chunks or \
                any(c >= len(delta.payloads) for c in request.chunks):
            self._error(identity, request, "bad_request",
                        "chunk ids out of range or too many in one request")
            return
        if not self._deferred.room(identity, len(request.chunks)):
            self._error(identity, request, "bad_request",
                        "too many delta chunks are waiting to be encoded; fetch it in full")
            return
        layout = None
        if request.plan and self._slice_layouts is not None:
            layout = self._slice_layouts(request.plan, request.version)
        self._deferred.offer(identity, request.req, _Fetch(delta, layout), request.chunks,
                             self._try_send)

    def flush(self) -> None:
        """Send the held-back chunks that are encoded (and have credit) by now."""
        self._deferred.flush(self._try_send)

    def _try_send(self, identity: bytes, req: int, fetch: _Fetch, chunk: int) -> bool:
        """Send one chunk if its payload is final; False to try again later."""
        delta = fetch.delta
        payload = delta.payload(chunk)
        if payload is None:
            return False
        planned = None if fetch.layout is None else fetch.layout.sizes.get(chunk)
        if planned is not None and (payload is RAW or len(payload) >= planned):
            return self._send_slice(identity, req, delta.version, fetch.layout, chunk)
        data: memoryview | bytes = payload
        version = None
        if payload is RAW:
            version = self._store.get(delta.version)
            if version is None or version.failed:
                error = wire.ErrorReply(req=req, code="version_unavailable", version=delta.version,
                                        message=f"version {delta.version} is no longer held")
                self._reply(identity, wire.encode(error))
                return True
            if not version.chunk_ready(chunk):
                return False
            data = version.chunk_view(chunk)
        header = ChunkHeader(req=req, version=delta.version, chunk=chunk, size=len(data))
        # one frame: the payload is copied behind the header (a raw chunk while its
        # version is held), the same form as full chunks (chunk_frame.py)
        if not self._send(identity, header, data, version, False):
            return False
        self.bytes_sent += len(data)
        return True

    def _send_slice(self, identity: bytes, req: int, number: int, layout: SliceLayout | None,
                    chunk: int) -> bool:
        """The plan's bytes of ``chunk`` of version ``number``, gathered (one copy)."""
        assert layout is not None
        version = self._store.get(number)
        if version is None or version.failed:
            self._reply(identity, wire.encode(wire.ErrorReply(
                req=req, code="version_unavailable", version=number,
                message=f"version {number} is no longer held")))
            return True
        if not version.chunk_ready(chunk):
            return False
        data = layout.gather(chunk, np.frombuffer(version.view, dtype=np.uint8))
        if not version.intact(chunk):  # a newer snapshot began to overwrite it meanwhile
            self._reply(identity, wire.encode(wire.ErrorReply(
                req=req, code="version_unavailable", version=number,
                message=f"version {number} was overwritten by a newer one")))
            return True
        header = ChunkHeader(req=req, version=number, chunk=chunk, size=len(data))
        if not self._send(identity, header, data.data, None, True):
            return False
        self.bytes_sent += len(data)
        self.slice_chunks += 1
        return True

    def _error(self, identity: bytes, request: wire.FetchRequest, code: str,
               message: str) -> None:
        error = wire.ErrorReply(req=request.req, code=code, message=message,
                                version=request.version)
        self._reply(identity, wire.encode(error))
