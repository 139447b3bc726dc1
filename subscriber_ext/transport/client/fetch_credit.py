"""What a ``SyncClient`` asks the publisher (or its peers) for next, and when it gives up.

Split from ``sync_client.py``: the credit (chunks in flight to the publisher,
bounded by ``window_bytes`` and ``MAX_CHUNKS_IN_FLIGHT``), batching into
``fetch`` requests, routing through peers when sharing, re-asking what timed
out, and the tries per chunk after which the version is given up. The table
itself is ``request_table.py``.
"""

from __future__ import annotations

from collections.abc import Callable

from subscriber_ext.transport.client.shard_links import ShardLinks
from subscriber_ext.transport.peers.peering import Peering
from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.request_table import RequestTable
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ConfigError, WeightPubError, WeightPubTimeout

__all__ = ["FetchCredit"]


class FetchCredit:
    """Fills the window of chunks in flight for the target; counts each chunk's tries."""

    def __init__(self, requests: RequestTable, peering: Peering | None, *,
                 target: Callable[[], Assembly | None], send: Callable[[wire.Message], bool],
                 give_up: Callable[[WeightPubError], None], window_bytes: int,
                 chunks_per_request: int, request_timeout: float,
                 max_chunk_retries: int, shards: ShardLinks | None = None) -> None:
        """``target()``: the version being fetched; ``send``: to the publisher;
        ``give_up(why)``: abandon the target (a chunk failed too often); ``shards``:
        the trainer ranks a sharded version's chunks are asked of (``shard_links.py``)."""
        self.requests = requests
        self.peering = peering
        self._target = target
        self._send = send
        self._give_up = give_up
        self.window_bytes = window_bytes
        self.chunks_per_request = chunks_per_request
        self.request_timeout = request_timeout
        self.max_chunk_retries = max_chunk_retries
        self.shards = shards

    def credit(self) -> int:
        """Chunks the client may have in flight to the publisher for its target."""
        target = self._target()
        if target is None:
            return 0
        chunks = self.window_bytes // target.manifest.chunk_size
        return max(1, min(chunks, wire.MAX_CHUNKS_IN_FLIGHT))

    def top_up(self, now: float) -> None:
        """Ask for more chunks of the target while there is credit (peers first, if sharing)."""
        target = self._target()
        if target is None:
            return
        if target.manifest.shards is not None:
            self._top_up_shards(target, now)
            return
        table = self.requests
        asked = table.asked()
        room = self.credit() - table.in_flight()
        if self.peering is not None:  # what peers serve is asked of them, the rest of us
            # enough to fill the publisher's credit and every peer's window, not the whole
            # version: this runs after every chunk (4,096 chunks: 16 M checks per version)
            sources = self.peering.sources
            limit = max(room, 0) + sources.window * max(1, len(sources.links))
            todo = target.next_chunks(asked, limit)
            todo = self.peering.route(target, todo, now) if todo else todo
        else:
            todo = target.next_chunks(asked, room) if room > 0 else []
        while todo and room > 0:
            batch = todo[: min(room, self.chunks_per_request)]
            todo = todo[len(batch):]
            req = table.next_id()
            request = wire.FetchRequest(req=req, publisher_id=target.manifest.publisher_id,
                                        version=target.fetch_version, chunks=tuple(batch),
                                        base=target.fetch_base)
            if not self._send(request):
                return
            table.track(req, batch, now)
            room -= len(batch)

    def _top_up_shards(self, target: Assembly, now: float) -> None:
        """A sharded version: each rank gets the publisher's credit for its own chunks;
        when sharing, peers are asked first for what the plan has them serve."""
        if self.shards is None:  # pragma: no cover (a SyncClient always has its links)
            self._give_up(ConfigError(f"version {target.manifest.version} is sharded over "
                                      "trainer ranks and this client has no links to them"))
            return
        peering = self.peering
        if peering is None:
            self.shards.top_up(target, self.credit(), now)
            return
        # per rank, its next chunks up to its credit and every peer's window: peers get
        # theirs, the rank what is left (as the publisher gets it when not sharded)
        sources = peering.sources
        self.shards.top_up(target, self.credit(), now,
                           route=lambda todo: peering.route(target, todo, now),
                           ahead=sources.window * max(1, len(sources.links)))

    def expire(self, now: float) -> None:
        """Re-ask (or, after too many tries, abandon) what the publisher did not answer in time."""
        if self.shards is not None and self.shards.links:
            target = self._target()
            self.shards.expire(now, lambda chunk: self.count_retry(
                chunk, "timed out at its trainer rank", WeightPubTimeout)
                or self._target() is not target, self._give_up)
            target = self._target()
            stalled = None if target is None or target.manifest.shards is None \
                else self.shards.stalled(target, now)
            if stalled is not None:
                self._give_up(stalled)
                return
        for request in self.requests.timed_out(now, self.request_timeout):
            for chunk in request.chunks:
                if self.count_retry(chunk, "timed out", WeightPubTimeout):
                    return

    def count_retry(self, chunk: int, why: str, error: type[WeightPubError]) -> bool:
        """Count one more try of a chunk; abandon the version when it has failed too often."""
        tries = self.requests.count_try(chunk)
        target = self._target()
        if tries <= self.max_chunk_retries or target is None:
            return False
        self._give_up(error(f"chunk {chunk} of version {target.manifest.version} "
                            f"{why} {tries} times"))
        return True
