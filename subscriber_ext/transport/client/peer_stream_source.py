"""Peers over the stream, the asking side (``docs/peer-stream.md``): a peer's chunks on its
plain TCP stream port.

A member with ``stream=True`` and ``peer_share=True`` asks each peer its plan routes
chunks to for a one-time token over that peer's (CURVE) DEALER (``PeerStreamRequest``,
scoped to the publisher instance), connects to the port in the answer at the peer's
host, and from then on asks the chunks the plan gives that peer there. It is a
``StreamSource`` (``stream_source.py``): replies ``recv_into``'d straight into staging,
hashed as they land, verified against the manifest's checksums; the connection kept
across versions. What differs: the token is asked as soon as the plan names the peer
(``warm``: the connection comes up before the first version's chunks are planned); the
chunks of a peer whose connection is not up yet go as frames meanwhile (a member from
before drops the token request: it costs a counted ``no_answer``, never a wait);
``refused``/``no_answer`` keep that peer on frames for ``QUIET_S``, and its bytes count
as the peers' (``kind``). Any failure gives the chunks back with a named, counted cause
(``status()["peers"]["stream_fallback_causes"]``); they go to the peer's frames, then
the next source, as every peer chunk does.

A sliced member (``slice_plan``) asks its peers' planned chunks the same way, as
``slices`` requests (``StreamSource``'s slices path: scatter-read into its sparse staging,
verified against the version's slice sums), once the peer's ``ACCEPTED`` says it serves
them; a peer whose stream does not (or whose port is off: ``refused``) costs a counted
fallback to ``slice_fetch`` frames.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from subscriber_ext.transport.client.stream_source import StreamPicker, StreamRoute, StreamSource
from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.chunk_source import Retry, SourceSink
from weightpub_wire import protocol as wire
from weightpub_wire import stream_link
from weightpub_wire.buffers import BufferPool
from weightpub_wire.endpoints import parse_endpoint

__all__ = ["QUIET_S", "RETOKEN_S", "WARM_RETRY_S", "PeerStreamSource", "PeerStreams"]

#: a peer that refused a token (or never answered: one from before) is not asked again
#: for this long; its chunks go as frames meanwhile
QUIET_S = 30.0
#: a token asked ahead (``warm``) that could not go yet (the peer's DEALER not connected)
#: is tried again this often
WARM_RETRY_S = 0.05
#: a token request not answered this long is sent again (a fresh ``req``) until
#: ``request_timeout`` from the first: one sent while the peer's CURVE handshake was still
#: refused (it had not learnt this member's key) went with the DEALER the redial replaced
RETOKEN_S = 1.0
_MAX_PEERS = 64  # peer stream sources kept (the plan names a few)


class PeerStreamSource(StreamSource):
    """One connection to one peer's stream port."""

    kind = "peers"

    def __init__(self, picker: StreamPicker, sink: SourceSink, endpoint: str,
                 send: Callable[[Any], bool]) -> None:
        super().__init__(picker, sink)
        self.endpoint = endpoint
        self.host = parse_endpoint(endpoint).host
        self._send_peer = send
        self.port = 0  # learnt from the first token
        self.quiet_until = 0.0
        self._asked_at = 0.0  # when the token was last asked
        self.instance = ""  # the publisher instance its tokens are scoped to
        self.warming = False  # a token to ask before any chunk (``warm``), not sent yet
        self.bytes_received = 0
        self.chunks_received = 0

    @property
    def label(self) -> str:
        return f"stream of peer {self.endpoint}"

    def follow_version(self, manifest: wire.Manifest) -> None:
        self.instance = manifest.publisher_id
        self.follow(manifest, StreamRoute(
            host=self.host, port=self.port, publisher_id=self.endpoint, first_chunk=0,
            num_chunks=manifest.num_chunks, send=self._ask_peer))

    def _ask_peer(self, message: Any) -> bool:
        """The token request, as a peer's ROUTER takes it (scoped to the instance)."""
        if not self.instance:
            return False
        try:
            return self._send_peer(stream_link.PeerStreamRequest(
                req=message.req, publisher_id=self.instance))
        except zmq.ZMQError:
            return False

    def _ask_token(self, now: float) -> bool:
        self._asked_at = now
        return super()._ask_token(now)

    def warm(self, instance: str, now: float) -> None:
        """The plan names this peer: ask its token now, before any version's chunk is
        planned on it (the first one's would otherwise go as frames while the token and
        the connection come). Once: only from ``idle`` and outside ``QUIET_S``."""
        self.instance = instance
        if self.route is None:  # no version yet: the port comes with the token
            self.route = StreamRoute(host=self.host, port=self.port, publisher_id=self.endpoint,
                                     first_chunk=0, num_chunks=0, send=self._ask_peer)
        self.warming = True
        self.warm_again(now)

    def warm_again(self, now: float) -> bool:
        """Ask the token ``warm`` wants if it can go now; whether it is still to ask."""
        if self.warming and (self.state != "idle" or now < self.quiet_until
                             or self._ask_token(now)):
            self.warming = False  # under way, asked, or this peer is quiet
        return self.warming

    def ask_again(self, now: float) -> None:
        """Ask the token again if the last ask is ``RETOKEN_S`` old (``since`` stays the
        first ask's: ``no_answer`` still comes ``request_timeout`` after it)."""
        if self.state != "token" or now - self._asked_at < RETOKEN_S or self.route is None:
            return
        req = self.sink.requests.next_id()
        if self.route.send(stream_link.StreamTokenRequest(req=req)):
            self.token_req, self._asked_at = req, now

    def ask(self, target: Assembly, chunks: Sequence[int], now: float) -> list[int]:
        if self.down:
            return list(chunks)
        if self.state != "up":  # frames meanwhile: an old peer never answers
            if self.state == "idle" and now >= self.quiet_until:
                self._ask_token(now)
            return list(chunks)
        return super().ask(target, chunks, now)

    def on_reply(self, message: Any) -> None:
        if isinstance(message, stream_link.StreamToken) and self.route is not None:
            self.port = message.port  # the peer's port: known once its token came
            self.route = dataclasses.replace(self.route, port=message.port)
        super().on_reply(message)

    def arrived(self, via: Any, size: int, now: float) -> None:
        self.verified += 1
        self.bytes_received += size
        self.chunks_received += 1

    def fall_back(self, cause: str, why: str) -> None:
        super().fall_back(cause, why)
        if cause in ("refused", "no_answer"):
            self.quiet_until = time.monotonic() + QUIET_S

    def count(self, cause: str, why: str) -> None:
        why = why.replace("the publisher", "the peer")  # (the stream source's wording)
        self.picker.count(cause, f"peer {self.endpoint}: {why}", self.manifest)


class PeerStreams:
    """A member's stream sources, one per peer its plan names (the client's thread)."""

    def __init__(self, *, request_timeout: float, window_bytes: int,
                 pool: BufferPool | None = None) -> None:
        #: what the sources share: the timeout, the window, the scratch budget, the counts
        self.picker = StreamPicker(True, "", request_timeout=request_timeout,
                                   window_bytes=window_bytes, pool=pool)
        self._poller: zmq.Poller | None = None
        self._gone_bytes = 0  # received by sources closed since
        self._gone_chunks = 0

    @property
    def sources(self) -> dict[str, PeerStreamSource]:
        return self.picker.ranks  # type: ignore[return-value]  # (the picker sheds them)

    def route(self, endpoint: str, send: Callable[[Any], bool], sink: SourceSink,
              target: Assembly, chunks: Sequence[int], now: float) -> list[int]:
        """The chunks the plan gives peer ``endpoint``: those its stream takes are asked
        there; the rest are returned (for its frames)."""
        source = self._source(endpoint, send, sink)
        if source is None:
            return list(chunks)
        source.follow_version(target.manifest)
        return source.ask(target, chunks, now)

    def warm(self, endpoint: str, send: Callable[[Any], bool], sink: SourceSink,
             instance: str, now: float) -> None:
        """The plan names peer ``endpoint`` (of publisher ``instance``): its token is asked
        now, so its connection is up before the first version's chunks are planned."""
        source = self._source(endpoint, send, sink)
        if source is not None:
            source.warm(instance, now)

    def _source(self, endpoint: str, send: Callable[[Any], bool],
                sink: SourceSink) -> PeerStreamSource | None:
        source = self.sources.get(endpoint)
        if source is None:
            if len(self.sources) >= _MAX_PEERS:
                return None
            source = self.sources[endpoint] = PeerStreamSource(self.picker, sink, endpoint,
                                                               send)
            if self._poller is not None:
                source.register(self._poller)
        return source

    def in_flight(self, endpoint: str, counts: dict[Any, int]) -> int:
        source = self.sources.get(endpoint)
        return 0 if source is None else counts.get(source, 0)

    def owns(self, endpoint: str, message: Any) -> bool:
        source = self.sources.get(endpoint)
        return source is not None and source.owns(message)

    def on_reply(self, endpoint: str, message: Any) -> None:
        source = self.sources.get(endpoint)
        if source is not None:
            source.on_reply(message)

    def keep(self, endpoints: set[str]) -> None:
        """Close the sources of peers the plan no longer names."""
        for endpoint in [e for e in self.sources if e not in endpoints]:
            self._close(self.sources.pop(endpoint))

    def _close(self, source: PeerStreamSource) -> None:
        self._gone_bytes += source.bytes_received
        self._gone_chunks += source.chunks_received
        source.close()

    def register(self, poller: zmq.Poller) -> None:
        self._poller = poller
        for source in self.sources.values():
            source.register(poller)

    def on_events(self, events: dict[Any, int], now: float) -> None:
        for source in list(self.sources.values()):
            source.on_events(events, now)

    def tick(self, now: float) -> float:
        """The sources' own work; a token or connect that is due ends here too (between
        versions nothing else would end it)."""
        wake = float("inf")
        for source in list(self.sources.values()):
            if source.warm_again(now):
                wake = min(wake, WARM_RETRY_S)
            if source.state in ("token", "connect"):
                source.ask_again(now)
                source.expire(now, _no_retry)
                if source.state in ("token", "connect"):
                    wake = min(wake, RETOKEN_S, max(
                        0.0, source.since + self.picker.request_timeout - now) + 0.01)
            wake = min(wake, source.tick(now))
        return wake

    def expire(self, now: float, retry: Retry) -> None:
        for source in list(self.sources.values()):
            source.expire(now, retry)

    def stats(self) -> dict[str, Any]:
        sources = list(self.sources.values())
        picker = self.picker
        return {
            "stream_bytes_from_peers": self._gone_bytes + sum(s.bytes_received for s in sources),
            "stream_chunks_from_peers": self._gone_chunks
            + sum(s.chunks_received for s in sources),
            "stream_peers_up": sum(s.state == "up" for s in sources),
            "stream_fallbacks": sum(picker.fallback_causes.values()),
            "stream_fallback_causes": dict(picker.fallback_causes),
            "stream_last_error": picker.last_error,
        }

    def close(self) -> None:
        for source in list(self.sources.values()):
            self._close(source)
        self.picker.close()


def _no_retry(chunk: int, why: str, error_type: Any) -> bool:
    return False  # a stream source gives its chunks back itself (never counts a try)
