"""Peers over NIXL (issue 31, ``docs/peers-over-nixl.md``): a member READs a version
one-sided where it sits in a planned peer's staging, instead of asking for frames.

Why here and not in the plan: the tracker would carry every member's agent metadata to
every member, and an offer changes whenever a member registers a buffer. So a member
asks each peer its plan routes chunks to, once per version, on that peer's ROUTER
(``PeerNixl``; CURVE: admitted keys only); the answer (``PeerNixlOffer``) is an offer
of the peer's staging (with a readiness map while the peer still receives it: cut-
through stays) or None and why. Until the answer comes (at most ``wait``) the chunks
for that peer wait; with an offer they go to a ``NixlHost.peer_source`` (READs, the
client's ``NixlPicker``), else as frames, the cause counted (``peer_unoffered``). A
chunk the source cannot read goes back to frames with its own counted cause, as for
the publisher's offer.

First slice: whole-version members whose version came over NIXL offer it; sliced
members and members whose version came as frames answer None (counted on their side
in ``nixl_unoffered``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import zmq

from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.chunk_source import ChunkSource, Retry
from weightpub_wire import protocol as wire
from weightpub_wire.nixl_link import NixlOffer
from weightpub_wire.peer_protocol import PeerNixl, PeerNixlOffer

__all__ = ["NixlHost", "PeerNixlReads"]

log = logging.getLogger("weightpub.peers")

VersionKey = tuple[str, int]
#: how soon a peer that has not started the version yet (``later``) is asked again
_AGAIN_S = 0.05


class NixlHost(Protocol):
    """What peering uses of the client's NIXL reader (``client/nixl_source.NixlPicker``)."""

    @property
    def peers_on(self) -> bool: ...

    def peer_offer(self, buffer: torch.Tensor, manifest: wire.Manifest,
                   verified: Callable[[int], bool] | None) -> tuple[NixlOffer | None, str]: ...

    def claim(self, buffer: torch.Tensor, version: int) -> Any: ...

    def peer_source(self, manifest: wire.Manifest, offer: NixlOffer, peer: str,
                    arrived: Callable[[int], None]) -> ChunkSource | None: ...

    def count(self, cause: str, why: str, *, version: int, once: bool = True,
              rank: int | None = None) -> None: ...


@dataclass(slots=True)
class _Ask:
    """A ``peer_nixl`` to one peer for one version: when first asked, the request's id,
    when to ask again (the peer had not started it), the answer's source."""

    first: float
    req: int = 0
    again: float = 0.0
    answered: bool = False
    source: ChunkSource | None = None


class PeerNixlReads:
    """The reading side: per (peer, version) the question, its answer and its source."""

    def __init__(self, host: NixlHost, next_id: Callable[[], int], wait: float) -> None:
        self.host = host
        self.next_id = next_id
        self.wait = wait
        self._asks: dict[tuple[str, VersionKey], _Ask] = {}
        #: peers that did not answer in ``wait`` (one that predates ``peer_nixl`` drops it):
        #: still asked, but their chunks go as frames meanwhile (64 remembered at most)
        self._silent: dict[str, None] = {}
        self.bytes_read = 0  # chunk bytes READ from peers and verified
        self.chunks_read = 0

    def route(self, sock: zmq.Socket, endpoint: str, target: Assembly, chunks: Sequence[int],
              now: float) -> list[int] | None:
        """The chunks the plan gives peer ``endpoint``: READ (taken), held while its answer
        is due (None), or returned for frames."""
        manifest = target.manifest
        key = (manifest.publisher_id, manifest.version)
        ask = self._asks.get((endpoint, key))
        if ask is None:
            ask = self._asks[(endpoint, key)] = _Ask(now)
        if not ask.answered:
            if now - ask.first >= self.wait:
                self._unoffered(ask, endpoint, manifest.version,
                                f"no answer in {self.wait:.2f} s")
                self._silent[endpoint] = None
                while len(self._silent) > 64:
                    del self._silent[next(iter(self._silent))]
                return list(chunks)
            if now >= ask.again:
                self._send(sock, ask, key, now)
            return list(chunks) if endpoint in self._silent else None
        source = ask.source
        if source is None or not getattr(source, "up", False):
            return list(chunks)
        return source.ask(target, chunks, now)

    def _send(self, sock: zmq.Socket, ask: _Ask, key: VersionKey, now: float) -> None:
        ask.req = self.next_id()
        ask.again = now + self.wait  # answered (or given up) by then
        try:
            sock.send(wire.encode(PeerNixl(req=ask.req, publisher_id=key[0], version=key[1])),
                      zmq.NOBLOCK)
        except zmq.Again:  # not connected yet: asked again at the next top-up
            ask.again = now + _AGAIN_S

    def answered(self, endpoint: str, reply: PeerNixlOffer, manifest: wire.Manifest | None,
                 now: float) -> None:
        """A peer's answer (a stale one, or one for another version, is dropped)."""
        if manifest is None or reply.version != manifest.version:
            return
        ask = self._asks.get((endpoint, (manifest.publisher_id, manifest.version)))
        if ask is None or ask.answered or ask.req != reply.req:
            return
        self._silent.pop(endpoint, None)
        if reply.offer is None:
            if reply.why == "later" and now - ask.first < self.wait:
                ask.again = now + _AGAIN_S  # it has not started the version: ask again
                return
            self._unoffered(ask, endpoint, manifest.version, reply.why or "no offer")
            return
        ask.answered = True
        ask.source = self.host.peer_source(manifest, reply.offer, endpoint, self._arrived)

    def _arrived(self, size: int) -> None:
        self.bytes_read += size
        self.chunks_read += 1

    def _unoffered(self, ask: _Ask, endpoint: str, version: int, why: str) -> None:
        ask.answered = True
        self.host.count("peer_unoffered", f"peer {endpoint}: {why}", version=version)

    def sources(self) -> list[ChunkSource]:
        return [ask.source for ask in self._asks.values() if ask.source is not None]

    def tick(self, now: float) -> float:
        return min((source.tick(now) for source in self.sources()), default=float("inf"))

    def expire(self, now: float, retry: Retry) -> None:
        for source in self.sources():
            source.expire(now, retry)

    def forget_all(self) -> None:
        """Forget every version asked: their READs drained first (no READ may outlive the
        staging it writes into)."""
        for ask in self._asks.values():
            if ask.source is not None:
                ask.source.close()
        self._asks.clear()

    def stats(self) -> dict[str, Any]:
        return {"nixl_bytes_from_peers": self.bytes_read,
                "nixl_chunks_from_peers": self.chunks_read}
