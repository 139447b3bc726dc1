"""Serving early checksums (``announce_early``, issue 29) on the serving thread.

A version announced before its hashes ended (``Manifest.sums_follow``) hands its sums on
over the ROUTER as they end (``weightpub_wire.sum_messages``): a ``chunk_sums`` request
is answered at once when the version has sums past the asker's ``have``, else held here
until it does (retried every loop turn, like ``DeferredSends``), or until the version is
gone (``version_unavailable``). What a peer can make this hold is bounded: one waiting
request per (peer, version), the newest replacing an older one (a re-ask after a
timeout), and ``max_waiting`` in all (past it: ``bad_request``).
"""

from __future__ import annotations

from collections.abc import Callable

from publisher.store.version_store import VersionStore
from weightpub_wire import protocol as wire
from weightpub_wire.sum_messages import MAX_SUMS_PER_REPLY, ChunkSums, ChunkSumsReply

__all__ = ["SumServing"]


class SumServing:
    """``chunk_sums`` answered from each version's ``SumFeed`` (module text)."""

    def __init__(self, store: VersionStore, publisher_id: str,
                 reply: Callable[[bytes, bytes], bool], *, max_waiting: int = 4096) -> None:
        self._store = store
        self._publisher_id = publisher_id
        self._reply = reply
        self.max_waiting = max_waiting
        self._waiting: dict[tuple[bytes, int], ChunkSums] = {}
        self.replies = 0  # chunk_sums_rep sent (status, tests)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def handle(self, identity: bytes, request: ChunkSums) -> None:
        key = (identity, request.version)
        self._waiting.pop(key, None)  # a re-ask replaces what waited
        if self._answer(identity, request):
            return
        if len(self._waiting) >= self.max_waiting:
            self._error(identity, request, "bad_request",
                        f"too many chunk_sums waiting here ({self.max_waiting}); ask again")
            return
        self._waiting[key] = request

    def flush(self) -> None:
        """Answer what waited and can be answered now."""
        if not self._waiting:
            return
        for key, request in list(self._waiting.items()):
            if self._answer(key[0], request):
                del self._waiting[key]

    def _answer(self, identity: bytes, request: ChunkSums) -> bool:
        """Reply (sums or an error) and return True, or False: nothing new yet."""
        version = self._store.get(request.version)
        if version is None or version.failed or request.publisher_id != self._publisher_id:
            self._error(identity, request, "version_unavailable",
                        f"version {request.version} of publisher {request.publisher_id} is "
                        f"not held here (held: {list(self._store.versions())})")
            return True
        manifest = version.manifest
        if request.have >= manifest.num_chunks:
            self._error(identity, request, "bad_request",
                        f"chunk_sums.have: {request.have}, the version has "
                        f"{manifest.num_chunks} sums")
            return True
        feed = version.sums
        if feed is not None:
            chunks, sums = feed.since(request.have, MAX_SUMS_PER_REPLY)
        elif manifest.sums_follow:
            return False  # cannot happen: an early version always has its feed
        else:  # announced complete: its sums in chunk order
            end = min(manifest.num_chunks, request.have + MAX_SUMS_PER_REPLY)
            chunks = tuple(range(request.have, end))
            sums = manifest.checksums[request.have: end]
        if not chunks:
            return False
        reply = ChunkSumsReply(req=request.req, version=request.version, first=request.have,
                               chunks=chunks, sums=sums)
        self._reply(identity, wire.encode(reply))
        self.replies += 1
        return True

    def _error(self, identity: bytes, request: ChunkSums, code: str, message: str) -> None:
        self._reply(identity, wire.encode(wire.ErrorReply(
            req=request.req, code=code, message=message, version=request.version)))

    def close(self) -> None:
        self._waiting.clear()
