"""Where the chunks of a version come from: the one interface the fetch path talks to.

A ``SyncClient`` asks its target's chunks of ``ChunkSource``s and of nothing else
(``client/fetch_credit.py`` is the one loop; ``client/source_choice.py`` picks
the sources once per version). Built in: the publisher's ROUTER
(``client/publisher_source.py``), each rank of a sharded trainer
(``client/shard_links.py: ShardRankSource``) and the peers of a peer-sharing
subscriber (``peers/peering.py: Peering``). Lives in ``staging/`` beside
``ChunkListener`` for the same reason: ``peers/`` and ``client/`` both build on
it.

Two kinds, by ``first``:

- a *serving* source (``first`` False) serves a range of the version under the
  client's credit: each top-up it is asked for its next missing chunks
  (``candidates``), at most ``room`` of them. The publisher serves every chunk;
  a trainer rank its ``Manifest.shards`` range.
- a *first* source (``first`` True, peers) sees each serving source's
  candidates before that source is asked, plus ``ahead`` more, takes what it
  can (``ask`` returns the rest) and the serving source gets what is left.

The client's side of the contract (``SourceSink``): a source records each request
it sends in the client's ``RequestTable`` (``track(req, chunks, now, via)``, ids
from ``next_id``); ``via`` is what the reply will come back through (the source
itself, or one of its links; None is reserved for the client's own DEALER to the
publisher). Replies go to ``sink.chunk(header, frame, source, via)``: the client
places and verifies the bytes (checksums, conflation, all-or-nothing staging are
the client's, whatever the source); a source that wrote a chunk straight into the
target's buffer itself (one-sided reads) calls ``sink.in_place(req, version, chunk,
source, via)`` instead and the client verifies it there, then tells the source ``arrived`` or, on a
checksum mismatch, ``refused`` (True: the source dealt with it, e.g. a peer is
banned and its chunks asked elsewhere; False: the chunk counts a try). An
``error`` reply goes to ``sink.error``, an undecodable one to ``sink.bad``.
Sources never touch the target's bytes or the client's state otherwise.

Plugging in a new source (a slice source of issue 30, a NIXL reader of issue 31)
touches no client code: subclass ``ChunkSource`` (one file, in the package of its
transport), and give the client a ``SourcePicker`` that returns it for the
manifests it can serve (``SyncClient(..., pickers=[...])``; pickers given there
are asked before the built-in ones). ``tests/unit/test_chunk_source.py`` does
exactly that with a source that lives in the test.

A slice source (issue 30) narrows ``candidates`` to the chunks its rank needs
(and its picker answers only for the layouts it has recorded). A NIXL reader
(issue 31) is a serving source whose picker answers for manifests that announce
NIXL; ``usable`` is False when its agent cannot reach the announced memory, so
the publisher serves that version. Its ``ask`` starts one-sided reads of the
chunks and tracks them, ``tick`` polls the transfers and hands each finished
chunk to ``sink.chunk`` as a one-frame chunk (``chunk_frame.build``), ``expire``
counts a try of what did not finish in ``request_timeout``. To fall back to
ZeroMQ frames chunk by chunk instead, its picker can return it as a first
source: offered each serving source's next chunks, it hands back those it cannot
read, as peers do, and the next picker's serving sources (trainer ranks, the
publisher) get them.
The interface is on purpose about chunks of the target:
what a version is, how it is verified and when it is staged stay the client's.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import zmq

from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.request_table import RequestTable
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ProtocolError, WeightPubError

__all__ = ["SOURCE_KINDS", "ChunkSource", "Retry", "SourcePicker", "SourceSink"]

#: what a version's bytes are counted under (``ChunkSource.kind``; status and reports):
#: chunk frames over ZeroMQ from the publisher (whole or slices), from trainer ranks
#: (a sharded version) or from peers; one-sided NIXL reads; a collective round
SOURCE_KINDS = ("publisher", "shard_ranks", "peers", "nixl", "collective", "stream")

#: ``retry(chunk, why, error_type)``: count one more try of ``chunk``; True when the
#: version was given up (stop working on it)
Retry = Callable[[int, str, type[WeightPubError]], bool]


class InPlace(Protocol):
    """``SourceSink.in_place``'s signature (``digest`` optional)."""

    def __call__(self, req: int, version: int, chunk: int, source: ChunkSource, via: Any,
                 digest: int | None = None) -> bool | None: ...


@dataclass(frozen=True, slots=True)
class SourceSink:
    """What the client gives its sources: the request table and where replies go."""

    requests: RequestTable
    #: ``chunk(header, frame, source, via)``: a one-frame chunk reply (payload in ``frame``)
    chunk: Callable[[chunk_frame.ChunkHeader, zmq.Frame, ChunkSource, Any], None]
    error: Callable[[wire.ErrorReply], None]  # an ``error`` reply to a request of ours
    bad: Callable[[ProtocolError], None]  # a reply that does not decode (counted, dropped)
    discard_rest: Callable[[int, zmq.Socket], None]  # drop the frames after the first
    #: ``give_up(why)``: the target cannot complete through this source (named in ``why``)
    give_up: Callable[[WeightPubError], None] = lambda why: None
    #: ``in_place(req, version, chunk, source, via, digest)``: a chunk the source wrote
    #: straight into ``target.chunk_target(chunk)`` (a one-sided read, a stream's
    #: ``recv_into``): verified there, no copy; ``digest``: its xxh3-64 when the source
    #: hashed the bytes as they landed (None: hashed there); True verified, False refused
    #: (``refused`` was told), None stale
    in_place: InPlace = lambda req, version, chunk, source, via, digest=None: None
    #: ``send(message)``: a control message to the publisher over the client's own DEALER
    #: (a stream source asks its token so); False when it is not connected yet
    send: Callable[[Any], bool] = lambda message: False


class ChunkSource(ABC):
    """Something the client can ask chunks of its target from (see the module text)."""

    #: True: asked before the serving sources, of what they are about to be asked
    first: ClassVar[bool] = False
    #: what its bytes are counted under, per version (``Assembly.received_by``; SOURCE_KINDS)
    kind: ClassVar[str] = "publisher"

    @property
    @abstractmethod
    def label(self) -> str:
        """Who this is, for errors and status ("publisher", "trainer rank 1", "peers")."""

    def usable(self, manifest: wire.Manifest) -> bool:
        """Whether this source can serve ``manifest`` now (False: the next picker's)."""
        return True

    def room(self, window: int) -> int:
        """Chunks it may be asked now, given the client's ``window`` (its credit in
        chunks); a first source's room is its own (``ahead``)."""
        return window

    def ahead(self) -> int:
        """A first source: how many chunks beyond a serving source's room it could take."""
        return 0

    def candidates(self, target: Assembly, asked: set[int], limit: int) -> list[int]:
        """Up to ``limit`` chunks it serves that are missing and not ``asked``, in
        fetch order (default: every chunk of the version)."""
        return target.next_chunks(asked, limit)

    @abstractmethod
    def ask(self, target: Assembly, chunks: Sequence[int], now: float) -> list[int]:
        """Ask for (some of) ``chunks`` of ``target`` and track the requests; return
        those it did not ask for (the next source's, or the next top-up's)."""

    @abstractmethod
    def expire(self, now: float, retry: Retry) -> bool:
        """Give up on what it left unanswered too long (each chunk ``retry``-counted, or
        moved on to another source); True when the version was given up."""

    def idle_limit(self) -> float | None:
        """Seconds a target with chunks missing and nothing asked of any source may stay
        so before it is given up (None: never for this source; the publisher may hold a
        version back for a collective round, a trainer rank's range is asked or lost)."""
        return None

    def tick(self, now: float) -> float:
        """Periodic work of its own; seconds until it needs the next call."""
        return math.inf

    def register(self, poller: zmq.Poller) -> None:
        """Poll the sockets it reads (now, and those it opens later)."""
        return None

    def on_events(self, events: dict[Any, int], now: float) -> None:
        """Read what ``poller`` found ready on its sockets (replies go to the sink)."""
        return None

    def arrived(self, via: Any, size: int, now: float) -> None:
        """A chunk it sent through ``via`` verified."""
        return None

    def refused(self, via: Any, chunk: int, why: str, now: float) -> bool:
        """A chunk it sent through ``via`` failed its checksum; True when the source
        handled that (its chunks go elsewhere), False: count it as a try."""
        return False

    def close(self) -> None:
        """Close its sockets; the client is closing or no longer needs it."""
        return None


#: ``picker(manifest, sink)``: the sources for ``manifest`` (built with the client's
#: ``sink``, or ones it built before), or None when this picker has none. First sources
#: in the answer are added and the next picker is asked; serving ones end the search
#: (``client/source_choice.py``); when no picker has any, the publisher serves. It owns
#: the sources it made: it closes those a later manifest no longer needs, and its own
#: ``close`` (if any) runs when the client closes.
SourcePicker = Callable[[wire.Manifest, SourceSink], Sequence[ChunkSource] | None]
