"""What peering uses of the client's peer stream reader (``client/peer_stream_source.py``).

Why a protocol: the reader is a ``StreamSource`` (the client layer, above peers); peering
only routes a peer's chunks through it and passes it that peer's token replies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq

from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.chunk_source import Retry, SourceSink

__all__ = ["PeerStreamHost"]


class PeerStreamHost(Protocol):
    """``client/peer_stream_source.PeerStreams``."""

    def route(self, endpoint: str, send: Callable[[Any], bool], sink: SourceSink,
              target: Assembly, chunks: Sequence[int], now: float) -> list[int]: ...

    def warm(self, endpoint: str, send: Callable[[Any], bool], sink: SourceSink,
             instance: str, now: float) -> None: ...

    def in_flight(self, endpoint: str, counts: dict[Any, int]) -> int: ...

    def owns(self, endpoint: str, message: Any) -> bool: ...

    def on_reply(self, endpoint: str, message: Any) -> None: ...

    def keep(self, endpoints: set[str]) -> None: ...

    def register(self, poller: zmq.Poller) -> None: ...

    def on_events(self, events: dict[Any, int], now: float) -> None: ...

    def tick(self, now: float) -> float: ...

    def expire(self, now: float, retry: Retry) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
