"""A serving ``ChunkSource`` on one DEALER of its own: the lifecycle its kinds share.

A trainer rank's link (``shard_links.py``) and a slice source (``slice_source.py``)
each own one ``MonitoredDealer``: its socket and monitor polled by the client,
handshakes read from the monitor, replies paired (``chunk_frame.PayloadPairing``),
the time of the last answer (a request's silence counts from it, ``RequestTable
.timed_out``), requests sent in batches of ``chunks_per_request`` without blocking
and tracked under the client's credit, and one close. ``DealerSource`` is that
once; a kind says what its requests are (``ask_batches``' ``request``), what its
replies mean (``read``) and what a handshake means to it (``on_handshakes``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from subscriber_ext.transport.staging.chunk_source import ChunkSource, SourceSink
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.errors import TransportError
from weightpub_wire.monitored_dealer import MonitoredDealer

__all__ = ["DealerSource", "rank_handshakes"]


class DealerSource(ChunkSource):
    """One DEALER's lifecycle as a serving source (module text)."""

    def __init__(self, dealer: MonitoredDealer, sink: SourceSink, *, chunks_per_request: int,
                 request_timeout: float, limits: wire.Limits) -> None:
        self.dealer = dealer
        self.endpoint = dealer.endpoint
        self.sock = dealer.sock
        self._sink = sink
        self.chunks_per_request = chunks_per_request
        self.request_timeout = request_timeout
        self.limits = limits
        #: a header (``chunk_frame.FOLLOWS``) whose payload is this socket's next message
        self.pairing = chunk_frame.PayloadPairing()
        self.answered = time.monotonic()  # the last reply: silence counts from here
        self._poller: zmq.Poller | None = None

    # -- asking --------------------------------------------------------------------------------
    def in_flight(self) -> int:
        """Chunks asked of this source and not yet in."""
        return self._sink.requests.peer_in_flight().get(self, 0)

    def room(self, window: int) -> int:
        return window - self.in_flight()

    def send(self, message: Any) -> bool:
        """``message`` sent without blocking; False when the socket has no room."""
        try:
            self.sock.send(wire.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def ask_batches(self, chunks: Sequence[int], now: float,
                    request: Callable[[int, list[int]], Any]) -> list[int]:
        """Ask ``chunks`` in batches, ``request(req, batch)`` each, tracked under the
        client's credit; returns those not sent (the socket was full)."""
        todo = list(chunks)
        if todo and not self.in_flight():
            self.answered = now  # an idle source's silence counts from now
        requests = self._sink.requests
        while todo:
            batch = todo[: self.chunks_per_request]
            req = requests.next_id()
            if not self.send(request(req, batch)):
                return todo
            requests.track(req, batch, now, source=self)
            todo = todo[len(batch):]
        return todo

    # -- replies -------------------------------------------------------------------------------
    def register(self, poller: zmq.Poller) -> None:
        self._poller = poller
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.dealer.monitor, zmq.POLLIN)

    def on_events(self, events: dict[Any, int], now: float) -> None:
        if self.dealer.monitor in events:
            self.on_handshakes(self.dealer.handshakes())
        if self.sock in events:
            self.read(now)

    def on_handshakes(self, results: list[str | None]) -> None:
        """Handshakes finished (``MonitoredDealer.handshakes``); nothing by default."""

    def read(self, now: float) -> None:
        """Read the replies waiting on the socket (without blocking)."""
        raise NotImplementedError

    def close(self) -> None:
        self._sink.requests.drop(self)
        if self._poller is not None:
            self._poller.unregister(self.sock)
            self._poller.unregister(self.dealer.monitor)
            self._poller = None
        self.dealer.close()


def rank_handshakes(rank: int, refused_by: TransportError | None, results: list[str | None],
                    on_handshake: Callable[[TransportError, bool], None]
                    ) -> TransportError | None:
    """A trainer rank's link (whole chunks or slices): a refused handshake (CURVE) is the
    client's ``last_error`` at once, naming the rank; the next good one clears it.
    Returns the refusal still standing."""
    for why in results:
        if why is None:
            if refused_by is not None:
                on_handshake(refused_by, False)
                refused_by = None
            continue
        refused_by = TransportError(f"trainer rank {rank}'s shard: {why}")
        on_handshake(refused_by, True)
    return refused_by
