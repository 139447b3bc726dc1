"""Chunk replies held back on the serving thread until they can go, bounded per peer.

A delta chunk still being encoded (``delta_serving.py``) and a slice whose chunk is
still being copied (``slice_serving.py``) wait the same way, as does any reply a
peer has no credit for yet: the request is checked against the bounds once
(``room``: past either, the caller answers ``bad_request`` and the subscriber
fetches another way), each chunk is tried at once (``offer``), and what could not
go is retried every loop turn (``flush``) until it goes or is answered with an
error (``try_send`` returns True for both). Bounded in all and per peer, so what a
subscriber asks can hold at most ``max_per_peer`` entries here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

__all__ = ["DeferredSends"]

T = TypeVar("T")

#: (identity, req, what the chunk is served from, chunk) -> done (sent or answered)
TrySend = Callable[[bytes, int, T, int], bool]


class DeferredSends(Generic[T]):
    """Chunks waiting to be sent, per peer and in all (module text)."""

    def __init__(self, max_deferred: int, max_per_peer: int) -> None:
        self.max_deferred = max_deferred
        self.max_per_peer = max_per_peer
        self._items: list[tuple[bytes, int, T, int]] = []
        self._per_peer: Counter[bytes] = Counter()

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def room(self, identity: bytes, chunks: int) -> bool:
        """Whether ``chunks`` more may wait for ``identity`` (in all and for that peer)."""
        return len(self._items) + chunks <= self.max_deferred and \
            self._per_peer[identity] + chunks <= self.max_per_peer

    def offer(self, identity: bytes, req: int, source: T, chunks: Iterable[int],
              try_send: TrySend[T]) -> None:
        """Try each chunk now; those that cannot go yet wait (``room`` checked first)."""
        for chunk in chunks:
            if not try_send(identity, req, source, chunk):
                self._items.append((identity, req, source, chunk))
                self._per_peer[identity] += 1

    def flush(self, try_send: TrySend[T]) -> None:
        """Try every waiting chunk again; those done leave."""
        if not self._items:
            return
        waiting = []
        for item in self._items:
            if try_send(*item):
                self._per_peer[item[0]] -= 1
                if not self._per_peer[item[0]]:
                    del self._per_peer[item[0]]
            else:
                waiting.append(item)
        self._items = waiting
