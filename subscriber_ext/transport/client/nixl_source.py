"""The NIXL data path, subscriber side: chunks READ one-sided into the staging buffer.

Why a *first* source (``staging/chunk_source.py``): a manifest with an offer
(``Manifest.nixl``) names the publisher's snapshot buffer; ``NixlSource`` takes the
chunks the serving sources (the publisher, trainer ranks) are about to be asked,
READs them straight into the assembly's buffer (registered once per pooled buffer,
reused for later versions, deregistered when the pool drops it) and hands each
finished chunk to the client (``SourceSink.in_place``), which verifies it in place
exactly as it does a ZeroMQ chunk. What it cannot read goes back to the serving
sources chunk by chunk, with a named, counted cause (``FALLBACK_CAUSES``, in
``status()`` as ``fallback_causes``, as the collective path counts its own): the
version still completes over ZeroMQ frames and nothing unverified is staged.

A sharded trainer (``Manifest.shards``) offers each rank's snapshot on that rank's
own agent (``ShardSource.nixl``): the source has one ``NixlHolder`` per rank and
READs each chunk from the rank that holds it (at its offset in that rank's buffer),
a READ never spanning two ranks. A rank that offers nothing (``unoffered``) or whose
offer does not fit (``bad_offer``) serves its range as frames from the start;
everything below is per holder, counted per rank too (``rank_fallbacks``).

After a transfer error, a timeout or an unreachable offer the source stops taking
that holder's chunks for that version (the next version's offer is tried afresh;
other ranks' reads go on); a chunk that fails its checksum is never read over NIXL
again for that version. Where the holder reused its buffer for a newer version
under the READ (``keep_versions`` 1: the reads are one-sided, the holder does not
wait for them), the torn chunk is told from a corrupt one by the holder's claims
words (``NixlClaims``, READ for that chunk then): ``reused``, counted once, and the
holder is not READ again for the version (its other chunks are being overwritten). A
version whose chunks all came one-sided is staged with ``data_path`` "nixl", one
with some over ZeroMQ "nixl+zmq".

Read deadlines (``ReadPace.deadline``) scale with the bytes in flight: a READ is
given ``SLACK`` times what the bytes posted up to it (every holder's: they share
the link) take at the measured rate, at least ``request_timeout`` and at most
``max(request_timeout, DEADLINE_MAX_S)``, counted from when it was posted or when a
READ last finished, whichever is later (a link that moves is not stuck; a holder
that stops answering is cut once the others' READs are done). So a large window
on a loaded box is not cut as ``timeout`` for being slow, and a holder that stops
answering is still left within a bound.

Memory safety: a READ writes into staging behind the client's back, so no transfer
may be in flight when its buffer changes hands. A chunk goes back to another source
only once its transfer is finished or cancelled, and ``target_dropped`` (the
picker is a ``ChunkListener``, told before the assembly's buffer returns to the
pool) waits for every transfer into it (bounded by ``request_timeout``).
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy
import torch

from subscriber_ext.transport.client.nixl_agent_start import AgentStart
from subscriber_ext.transport.client.peer_words import PeerWords
from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.chunk_source import ChunkSource, Retry, SourceSink
from subscriber_ext.transport.staging.delta_assembly import DeltaAssembly
from subscriber_ext.transport.staging.sparse_assembly import SparseAssembly
from weightpub_wire import protocol as wire
from weightpub_wire.bounded_counts import count_bounded
from weightpub_wire.buffers import Allocator, HostAllocator
from weightpub_wire.errors import ProtocolError, TransportError
from weightpub_wire.nixl_link import (
    NixlClaims,
    NixlOffer,
    NixlReader,
    NixlRegion,
    NixlTransfer,
    NixlWords,
    nixl_error,
)
from weightpub_wire.ratelog import RateLimitedLog
from weightpub_wire.slice_layout import PAGE, SliceLayout

__all__ = ["FALLBACK_CAUSES", "NixlHolder", "NixlPicker", "NixlSource", "PeerNixlSource",
           "ReadPace", "RegisteringAllocator", "offer_misfit"]

log = logging.getLogger("weightpub.subscriber")

#: why chunks of a version offered over NIXL came over ZeroMQ frames instead
FALLBACK_CAUSES = (
    "off",  # this subscriber's ``nixl`` option is False
    "missing",  # NIXL does not import here (or its agent did not start)
    "starting",  # its agent had not started after ``AGENT_WAIT_S`` (chunks held that long)
    "bad_offer",  # the offer does not fit the manifest, or its agent is not who it says
    "unreachable",  # the offer's agent could not be added or a READ could not be posted
    "transfer",  # a READ failed (the holder died, UCX reported an error)
    "timeout",  # a READ was not done by its deadline (``ReadPace.deadline``)
    "checksum",  # a chunk read one-sided failed its checksum (torn or corrupted region)
    "register",  # a staging buffer could not be registered
    "unoffered",  # a sharded trainer's rank offers no NIXL (off or missing there)
    "reused",  # the holder reused the version's buffer for a newer one under a READ
    "unready",  # a cut-through holder's chunks did not become ready by the deadline
    "unanswered",  # a READ of the holder's claims words or readiness map was not done in time
    "peer_unoffered",  # a peer offered no NIXL for the version (peers over NIXL: frames then)
)
#: most seconds a READ of a holder's claims words (``NixlSource.refused``) or readiness
#: map (``NixlSource._readiness``) may stay in flight (at most ``request_timeout``): past
#: it the holder is given up (``unanswered``). Such a READ is posted and looked at with
#: the transfers, never waited for on the loop beyond ``WORDS_WAIT_S``
CLAIMS_TIMEOUT_S = 5.0
#: most seconds the loop waits for a words READ it just posted (a live holder answers in
#: well under a millisecond on one host: the answer is then used at once)
WORDS_WAIT_S = 0.005
#: a readiness map is READ again after this long while chunks are not final, doubling
#: to ``READY_MAX_S`` while none becomes final
READY_MIN_S = 0.002
READY_MAX_S = 0.05
_MAX_CAUSES = 16
_MAX_RANKS = 64  # ranks named in ``rank_fallbacks`` (more are counted in the causes only)
_MAX_PEER_AGENTS = 64  # ``MAX_STRIPES`` x ``MAX_CHAIN`` peers in a plan
#: ranges of a sparse staging buffer registered at most (``touched_ranges``)
MAX_SPARSE_RANGES = 1024
#: most seconds a version's chunks wait for the agent while it starts (on its own thread,
#: ``nixl_agent_start.py``: about 0.5 s here); past it they come as frames (``starting``)
AGENT_WAIT_S = 5.0
#: how often a source waiting for the agent looks whether it is up (the loop goes on)
_AGENT_POLL_S = 0.01
_READ_BYTES = 16 << 20  # bytes per READ: large enough to stream, small enough to hand back
#: how often a READ still in flight is looked at when waited for (``drain``: closing,
#: dropping a target) or due (a words READ)
_POLL_S = 0.0005


def _base(buffer: torch.Tensor) -> torch.Tensor:
    return buffer if buffer._base is None else buffer._base


def touched_ranges(layout: SliceLayout, limit: int) -> list[tuple[int, int]]:
    """The pages a plan's blocks touch as ``(offset, length)`` ranges of the flat buffer,
    in order, merged where they meet, each ending by ``limit`` (the buffer's end). More
    than ``MAX_SPARSE_RANGES`` (a plan of many small scattered pieces): ranges closer
    than a gap are merged too, the gap growing 4x until they fit, so registrations stay
    few (each is a call into UCX) at the cost of some untouched pages pinned."""
    extents = sorted((start // PAGE * PAGE, start + (count - 1) * stride + length)
                     for blocks in layout.blocks.values()
                     for start, length, stride, count in blocks)
    gap = 0
    while True:
        merged: list[list[int]] = []
        for low, high in extents:
            high = min(-(-high // PAGE) * PAGE, limit)
            if merged and low <= merged[-1][1] + gap:
                merged[-1][1] = max(merged[-1][1], high)
            else:
                merged.append([low, high])
        if len(merged) <= MAX_SPARSE_RANGES:
            return [(low, high - low) for low, high in merged if high > low]
        gap = max(PAGE, 4 * gap)


def _wait_words(reader: NixlReader, transfer: Any) -> None:
    """Wait ``WORDS_WAIT_S`` at most for a words READ just posted (or being dropped); a
    failure is told by the answer (``_words_answer``), not here."""
    until = time.monotonic() + WORDS_WAIT_S
    try:
        while not reader.poll(transfer) and time.monotonic() < until:
            time.sleep(_POLL_S)
    except TransportError:
        pass


def offer_misfit(offer: NixlOffer, need: int, chunk_size: int, version: int,
                 whose: str = "the version's") -> str | None:
    """Why ``offer`` cannot serve ``need`` bytes of ``version`` (chunks of ``chunk_size``), naming
    the field (None: it fits). Its words are READ by the numbers it gives, so they are
    held to the offer: claims words cover every ``region`` bytes of the range, a
    readiness map one word per chunk (``region`` the chunk size), neither inside the
    offered bytes (a map over data bytes would read data as versions), both for the
    manifest's version."""
    regions = offer.regions
    if len(regions) != 1 or regions[0].length < need:
        return f"regions {list(regions)[:4]} do not hold {whose} {need} bytes"
    data = regions[0]
    for field, words in (("claims", offer.claims), ("ready", offer.ready)):
        if words is None:
            continue
        if field == "ready" and words.region != chunk_size:
            return (f"ready.region {words.region} is not the chunk size {chunk_size} (one "
                    "word per chunk)")
        needed = -(-need // words.region)
        if words.length % 8 or words.length < 8 * needed:
            return (f"{field}.length {words.length} bytes do not hold {needed} words (one per "
                    f"{words.region} of {whose} {need} bytes)")
        if words.address < data.address + data.length \
                and data.address < words.address + words.length:
            return (f"{field}.address {words.address:#x} ({words.length} bytes) lies inside "
                    f"the offered region at {data.address:#x} ({data.length} bytes)")
        if words.version != version:
            return f"{field}.version {words.version} is not the manifest's version {version}"
    return None


class NixlHolder:
    """One agent a version's chunks are READ from: the publisher (every chunk), or a
    trainer rank (its ``ShardSource`` range, chunk ``first_chunk + i`` at ``i *
    chunk_size`` of its region)."""

    __slots__ = ("base", "claims_read", "first_chunk", "mute", "num_chunks", "offer", "rank",
                 "reused", "suspects", "up")

    def __init__(self, offer: NixlOffer, first_chunk: int, num_chunks: int, chunk_size: int,
                 rank: int | None = None) -> None:
        self.offer = offer
        self.first_chunk = first_chunk
        self.num_chunks = num_chunks
        self.base = first_chunk * chunk_size  # the union's offset of the region's byte 0
        self.rank = rank  # None: not sharded
        self.up = True  # False after a failure: its rest of the version goes to ZeroMQ
        self.reused = False  # its buffer was reused for a newer version under a READ
        #: chunks that failed their checksum, not judged yet (reused or corrupt?): each
        #: ``(chunk, why)``; judged by the claims READ in flight, else by the next one
        self.suspects: list[tuple[int, str]] = []
        self.claims_read: _Words | None = None
        self.mute = False  # its claims words went unanswered: not READ again this version


class _Words:
    """A READ of a holder's words in flight: its claims words over ``chunks`` (judged
    when it is done) or its readiness map over chunks ``low`` .. (``need``)."""

    __slots__ = ("chunks", "holder", "low", "need", "posted", "read")

    def __init__(self, read: NixlWords, holder: NixlHolder, posted: float, *,
                 chunks: list[tuple[int, str]] | None = None, low: int = 0,
                 need: list[int] | None = None) -> None:
        self.read = read
        self.holder = holder
        self.posted = posted
        self.chunks = chunks or []
        self.low = low
        self.need = need or []


class _Read:
    """One READ in flight: NIXL's transfer, the chunks it fills, where, from whom."""

    __slots__ = ("chunks", "holder", "posted", "target", "transfer")

    def __init__(self, transfer: NixlTransfer, chunks: list[int], target: Assembly,
                 posted: float, holder: NixlHolder) -> None:
        self.transfer = transfer
        self.chunks = chunks
        self.target = target
        self.posted = posted
        self.holder = holder


class _Queued:
    """A READ taken (its chunks tracked as asked) but not posted yet (``NixlSource._post``)."""

    __slots__ = ("chunks", "holder", "req", "spans", "target")

    def __init__(self, req: int, target: Assembly, holder: NixlHolder, chunks: list[int],
                 spans: list[tuple[int, int]]) -> None:
        self.req = req
        self.target = target
        self.holder = holder
        self.chunks = chunks
        self.spans = spans  # (offset in the version, length)


class NixlSource(ChunkSource):
    """Reads one version's chunks from its holders; hands back what it cannot read."""

    first = True
    kind = "nixl"  # one-sided reads (its chunks that fall back come as frames, elsewhere)

    def __init__(self, picker: NixlPicker, sink: SourceSink, manifest: wire.Manifest,
                 holders: Sequence[NixlHolder | None]) -> None:
        """``holders``: one (the publisher's) or, sharded, one per ``manifest.shards``
        entry (None where that rank's range comes as frames)."""
        self.picker = picker
        self.sink = sink
        self.manifest = manifest
        self.holders = list(holders)
        self._firsts = [0] if manifest.shards is None \
            else [shard.first_chunk for shard in manifest.shards]
        self.refused_chunks: set[int] = set()  # failed their checksum once: ZeroMQ's
        self.verified = 0  # chunks of this version verified in place
        self.pending: dict[int, _Read] = {}  # req -> its READ, in posting order
        self.queued: collections.deque[_Queued] = collections.deque()  # taken, not posted
        self.last_done = 0.0  # when a READ last finished (``expire``: the link moves)
        self.pace = ReadPace(picker.rate)
        # a version offered before its copy is complete (``NixlOffer.ready``; a relay's,
        # never sharded): chunks seen final, when to READ the map next, since when the
        # head of ``queued`` waits without a chunk becoming final (``expire``)
        self.ready_known: set[int] = set()
        self.ready_waiting = False
        self.ready_next = 0.0
        self.ready_wait = READY_MIN_S
        self.ready_since = 0.0
        self.ready_read: _Words | None = None  # the readiness map's READ in flight

    @property
    def label(self) -> str:
        return "nixl"

    @property
    def up(self) -> bool:
        """Some holder still serves this version one-sided."""
        return any(h is not None and h.up for h in self.holders)

    def holder(self, chunk: int) -> NixlHolder | None:
        """Who holds ``chunk`` (None: nobody offers it over NIXL)."""
        if len(self.holders) == 1:
            return self.holders[0]
        return self.holders[bisect.bisect_right(self._firsts, chunk) - 1]

    def _in_flight(self) -> int:
        return sum(len(read.chunks) for read in self.pending.values()) + \
            sum(len(queued.chunks) for queued in self.queued)

    def ahead(self) -> int:
        if not self.up:
            return 0
        return max(0, self._window() - self._in_flight())

    def ask(self, target: Assembly, chunks: Sequence[int], now: float) -> list[int]:
        if not self.up or target.manifest is not self.manifest \
                or isinstance(target, DeltaAssembly) or target.fetch_base:
            return list(chunks)
        sparse = target if isinstance(target, SparseAssembly) else None
        # while up it takes every chunk it is offered that an up holder has (the serving
        # sources get none: a cap here handed a sharded version's later ranks the excess
        # as frames); a slice target's only once it can be verified in place (its sums
        # are here, or the plan covers the chunk whole). What is beyond ``_cap`` waits in
        # ``queued``, asked (tracked) but not posted: READs in flight stay bounded, so a
        # holder that dies mid-version leaves the rest unread (and unstaged)
        take = [c for c in chunks if c not in self.refused_chunks
                and (holder := self.holder(c)) is not None and holder.up
                and (sparse is None or sparse.readable_in_place(c))]
        if not take:
            return list(chunks)
        taken = set(take)
        rest = [c for c in chunks if c not in taken]
        if self.picker.reader is not None and not self._register(target):
            return list(chunks)
        # while the agent starts (its own thread) they wait in ``queued``: ``_await_agent``
        for holder, batch, spans in self._batches(take, sparse):
            req = self.sink.requests.next_id()
            self.sink.requests.track(req, batch, now, source=self)
            self.queued.append(_Queued(req, target, holder, batch, spans))
        self._post(now)
        return rest

    def _register(self, target: Assembly) -> bool:
        """Register ``target``'s staging (once per buffer); False: it failed (counted, every
        holder falls back for the version)."""
        base = _base(target.buffer)
        try:
            if isinstance(target, SparseAssembly):
                self.picker.register_sparse(target)
            else:
                self.picker.register(base)
        except Exception as exc:
            self.fall_back("register", f"registering {base.numel()} bytes of staging: {exc}")
            return False
        return True

    def _await_agent(self, now: float) -> float:
        """The agent is starting on its thread: chunks taken meanwhile wait in ``queued``
        while the loop goes on; once it is up they are posted; if it failed, or is not up
        ``AGENT_WAIT_S`` after its start began, they go to frames (``missing``,
        ``starting``). Returns when to look again."""
        up = self.picker.started()
        if up is None:
            waited = now - self.picker.start_began
            if waited < AGENT_WAIT_S:
                return _AGENT_POLL_S
            self.fall_back("starting", f"the NIXL agent had not started after {waited:.1f} s")
            return float("inf")
        if not up:
            self.fall_back("missing", self.picker.unavailable or "NIXL cannot run here")
            return float("inf")
        self.picker.keep_holders(self.holders)
        self._post(now)
        return 0.0

    def _window(self) -> int:
        """The client's window in chunks (``window_bytes``, at most the protocol's)."""
        return max(1, min(self.picker.window_bytes // self.manifest.chunk_size,
                          wire.MAX_CHUNKS_IN_FLIGHT))

    def _cap(self) -> int:
        """Chunks posted at most at once: twice the window (the link stays busy while a
        finished READ is verified, and a dead holder costs what is in flight only)."""
        return 2 * self._window()

    def _post(self, now: float) -> None:
        """Post queued READs while fewer than ``_cap`` chunks are in flight; a queued READ
        whose holder fell back (or that cannot be posted) is forgotten: its chunks go to
        the serving sources at the next top-up."""
        reader = self.picker.reader
        if reader is None:
            return  # its agent is starting: posted once it is up (``_await_agent``)
        posted = sum(len(read.chunks) for read in self.pending.values())
        while self.queued and posted < self._cap():
            queued = self.queued.popleft()
            req, holder, target = queued.req, queued.holder, queued.target
            if req not in self.sink.requests:
                continue  # the target was given up or dropped meanwhile
            if not holder.up or target.manifest is not self.manifest \
                    or not self._register(target):
                self.sink.requests.forget(req)
                continue
            ready = self._readiness(queued, now)
            if ready is None:
                self.sink.requests.forget(req)
                continue
            if not ready:  # not final yet at the holder: looked at again at ``ready_next``
                self.queued.appendleft(queued)
                break
            address = target.buffer.data_ptr()
            pieces = [(0, start - holder.base, address + start, size)
                      for start, size in queued.spans]
            try:
                transfer = reader.start(holder.offer, pieces)
            except ProtocolError as exc:
                self.sink.requests.forget(req)
                self.fall_back("bad_offer", str(exc), holder)
                continue
            except TransportError as exc:
                self.sink.requests.forget(req)
                self.fall_back("unreachable", str(exc), holder)
                continue
            if transfer is None:
                self.sink.requests.forget(req)
                continue
            self.pending[req] = _Read(transfer, queued.chunks, target, now, holder)
            self.pace.posted(req, transfer.nbytes, now)
            self.picker.bytes_asked += transfer.nbytes
            posted += len(queued.chunks)

    def _readiness(self, queued: _Queued, now: float) -> bool | None:
        """Whether every chunk of a queued READ is final at its holder (a version offered
        before its copy is complete: ``NixlOffer.ready``; always, without a map). The
        words are READ for the chunks not yet seen final, at most once per ``ready_wait``
        (from ``READY_MIN_S``, doubling to ``READY_MAX_S`` while nothing new is final):
        posted, waited for ``WORDS_WAIT_S`` at most, then looked at with the transfers
        (a map READ not done in ``_words_deadline`` gives the holder up, ``expire``).
        None: the holder fell back (its map could not be read)."""
        holder = queued.holder
        if holder.offer.ready is None:
            return True
        need = [c for c in queued.chunks if c not in self.ready_known]
        if not need:
            return True
        if self.ready_read is None:
            if now < self.ready_next:
                return False
            low = min(need)
            self.ready_read = self._post_words(
                holder, holder.offer.ready, low - holder.first_chunk, max(need) - low + 1,
                now, "its readiness map", low=low, need=need)
            if self.ready_read is None:
                return None
        read = self.ready_read
        words = self._words_answer(read, "its readiness map")
        if words is None:
            return None if not read.holder.up else False
        ready = read.holder.offer.ready
        assert ready is not None
        mask = words >= ready.version
        self._end_words(read)
        fresh = {c for c in read.need if mask[c - read.low]}
        if not self.ready_waiting or fresh:  # the wait's deadline counts from progress
            self.ready_since = now
        self.ready_known |= fresh
        if all(c in self.ready_known for c in need):
            self.ready_waiting = False
            self.ready_wait = READY_MIN_S
            return True
        self.ready_waiting = True
        self.ready_wait = READY_MIN_S if fresh else min(2 * self.ready_wait, READY_MAX_S)
        self.ready_next = now + self.ready_wait
        return False

    # -- READs of a holder's words (claims, readiness): never waited for on the loop ----------
    def _words_deadline(self) -> float:
        return min(self.picker.request_timeout, CLAIMS_TIMEOUT_S)

    def _post_words(self, holder: NixlHolder, where: Any, first: int, count: int, now: float,
                    what: str, **judge: Any) -> _Words | None:
        """Post a READ of ``count`` of ``where``'s words from ``first`` and wait for it
        ``WORDS_WAIT_S`` at most; None when it could not be posted (the holder fell back)."""
        reader = self.picker.reader
        assert reader is not None
        try:
            read = reader.start_words(holder.offer, where, first, count)
        except ProtocolError as exc:
            self.fall_back("bad_offer", f"{what}: {exc}", holder)
            return None
        except TransportError as exc:
            self.fall_back("unreachable", f"{what}: {exc}", holder)
            return None
        words = _Words(read, holder, now, **judge)
        _wait_words(reader, read.transfer)
        return words

    def _words_answer(self, read: _Words, what: str) -> Any:
        """The words once READ (None while in flight, or when the READ failed: then the
        holder fell back, ``transfer``, and the READ is released)."""
        reader = self.picker.reader
        assert reader is not None
        try:
            return reader.words_done(read.read)
        except TransportError as exc:
            self._end_words(read)
            self.fall_back("transfer", f"{what}: {exc}", read.holder)
            return None

    def _end_words(self, read: _Words) -> None:
        if self.ready_read is read:
            self.ready_read = None
        if read.holder.claims_read is read:
            read.holder.claims_read = None
        if self.picker.reader is not None:
            self.picker.reader.release_words(read.read)

    def _unqueue(self, holder: NixlHolder | None = None) -> None:
        """Forget the queued READs (of ``holder``; None: all): their chunks are unasked."""
        keep: collections.deque[_Queued] = collections.deque()
        for queued in self.queued:
            if holder is not None and queued.holder is not holder:
                keep.append(queued)
            elif queued.req in self.sink.requests:
                self.sink.requests.forget(queued.req)
        self.queued = keep

    def _batches(self, chunks: list[int], sparse: SparseAssembly | None
                 ) -> list[tuple[NixlHolder, list[int], list[tuple[int, int]]]]:
        """Chunks grouped into READs of about ``_READ_BYTES`` (at most ``_cap`` chunks)
        from one holder each, with
        their byte ranges in the version (a whole chunk, or a slice target's planned
        ranges of it)."""
        out: list[tuple[NixlHolder, list[int], list[tuple[int, int]]]] = []
        size = _READ_BYTES
        cap = self._cap()
        for chunk in chunks:
            holder = self.holder(chunk)
            assert holder is not None
            spans = [self.manifest.chunk_span(chunk)] if sparse is None \
                else sparse.read_pieces(chunk)
            nbytes = sum(n for _, n in spans)
            if not out or out[-1][0] is not holder or size + nbytes > _READ_BYTES \
                    or len(out[-1][1]) >= cap:
                out.append((holder, [], []))
                size = 0
            out[-1][1].append(chunk)
            out[-1][2].extend(spans)
            size += nbytes
        return out

    def tick(self, now: float) -> float:
        """Verify the chunks of every READ that is done (in posting order per holder: NIXL
        moves one agent's in that order, so its first one not done ends its pass); return
        when the next one is due (``ReadPace``: its bytes at the measured rate, then
        backing off)."""
        reader = self.picker.reader
        if reader is None:
            return self._await_agent(now) if self.up and self.queued else float("inf")
        waiting: set[int] = set()  # holders (by id) with a READ not done yet
        for req, read in list(self.pending.items()):
            if req not in self.pending or id(read.holder) in waiting:
                continue  # drained meanwhile (the target was given up or dropped), or behind
            transfer, chunks, target = read.transfer, read.chunks, read.target
            try:
                done = reader.poll(transfer)
            except TransportError as exc:
                self._end(req, give_back=True)
                self.fall_back("transfer", str(exc), read.holder)
                continue
            if not done:
                waiting.add(id(read.holder))
                continue
            self._end(req, give_back=False)
            self.last_done = time.monotonic()
            self.pace.done(req, transfer.nbytes)
            self.picker.bytes_read += transfer.nbytes
            needed = len(target.layout.chunks) if isinstance(target, SparseAssembly) \
                else self.manifest.num_chunks
            for chunk in chunks:
                # said before the chunk verifies: the last one stages the version at once
                # (counted over every NIXL source of the version: the publisher's, peers')
                last = self.picker.in_place(self.manifest) + 1 == needed
                target.data_path = "nixl" if last else "nixl+zmq"
                if self.sink.in_place(req, target.fetch_version, chunk, self, self):
                    self.verified += 1
                    self.picker.note_in_place(self.manifest)
                else:
                    target.data_path = "nixl+zmq" if self.picker.in_place(self.manifest) \
                        else "zmq"
        for holder in self.holders:  # claims READs done: their chunks judged
            if holder is not None and holder.claims_read is not None:
                self._judge(holder.claims_read)
        now = time.monotonic()
        self.pace.measure(now)
        self._post(now)
        due = max(0.0, self.ready_next - now) if self.ready_waiting and self.queued \
            else float("inf")
        if self.ready_read is not None or any(
                h is not None and h.claims_read is not None for h in self.holders):
            due = min(due, _POLL_S)  # a words READ in flight: looked at soon
        if not self.pending:
            self.pace.idle()
            return due
        return min(self.pace.wait(now), due)

    def _end(self, req: int, *, give_back: bool) -> bool:
        """Release a transfer; ``give_back``: its chunks go back to the serving sources
        (only once NIXL let go of it: a READ still in flight would land on their bytes)."""
        transfer = self.pending.pop(req).transfer
        self.pace.dropped(req)
        released = self.picker.reader is None or self.picker.reader.release(transfer)
        if give_back and req in self.sink.requests:
            if released:
                self.sink.requests.forget(req)
            else:  # cannot be handed on safely: the version is given up, never torn
                self.sink.give_up(TransportError(
                    f"nixl: a READ of version {self.manifest.version} could not be cancelled"))
        return released

    def expire(self, now: float, retry: Retry) -> bool:
        """Give up the READs past their deadline (``ReadPace.deadline``): their holder
        falls back to frames for the rest of the version."""
        floor = self.picker.request_timeout
        self._unanswered(now)
        if self.ready_waiting and self.queued and now - self.ready_since >= floor:
            self.ready_waiting = False
            self.fall_back("unready", f"no chunk of version {self.manifest.version} became "
                                      f"final at the holder in {floor:.1f} s (its copy "
                                      "stalled or failed)", self.queued[0].holder)
        ahead = 0  # bytes posted up to each READ, every holder's
        for req, read in list(self.pending.items()):
            ahead += read.transfer.nbytes
            if req not in self.pending:
                continue
            start = max(read.posted, self.last_done)
            allowed = self.pace.deadline(ahead, floor)
            if now - start >= allowed:
                self._end(req, give_back=True)
                self.fall_back("timeout", f"a READ of version {self.manifest.version} was not "
                                          f"done after {allowed:.1f} s ({ahead} bytes in "
                                          "flight up to it)", read.holder)
        return False

    def refused(self, via: Any, chunk: int, why: str, now: float) -> bool:
        """A chunk READ here failed its checksum: it goes to the serving sources. Counted
        as ``reused`` when the holder's buffer now holds a newer version there (the holder
        recycled it under the READ; its other chunks will be torn too, so the holder
        falls back for the rest of the version, counted once), else as ``checksum``.
        Which one is told by the holder's claims words (``NixlClaims``), READ for the
        chunk now: posted, waited for ``WORDS_WAIT_S`` at most, else judged when done
        (``tick``); a holder that does not answer in ``_words_deadline`` is given up
        (``unanswered``) and its chunks counted as ``checksum``."""
        self.refused_chunks.add(chunk)
        holder = self.holder(chunk)
        if holder is not None and holder.reused:
            return True  # counted once, when the holder fell back
        if holder is None or holder.offer.claims is None or self.picker.reader is None \
                or holder.mute:
            self._corrupt(chunk, why, holder)
            return True
        holder.suspects.append((chunk, why))
        if holder.claims_read is None:
            self._ask_claims(holder, now)
        if holder.claims_read is not None:
            self._judge(holder.claims_read)
        return True  # not a try: the chunk goes to the serving sources

    def _corrupt(self, chunk: int, why: str, holder: NixlHolder | None) -> None:
        self.picker.count("checksum", why, version=self.manifest.version, once=False,
                          rank=None if holder is None else holder.rank)

    def _ask_claims(self, holder: NixlHolder, now: float) -> None:
        """Post a READ of the claims words over every suspect chunk of ``holder``."""
        claims = holder.offer.claims
        assert claims is not None
        suspects, holder.suspects = holder.suspects, []
        spans = [self.manifest.chunk_span(chunk) for chunk, _ in suspects]
        low = min(start for start, _ in spans) - holder.base
        high = max(start + size for start, size in spans) - holder.base
        first = low // claims.region
        holder.claims_read = self._post_words(
            holder, claims, first, -(-high // claims.region) - first, now,
            "its claims words", chunks=suspects, low=first)
        if holder.claims_read is None:
            for chunk, why in suspects:
                self._corrupt(chunk, why, holder)

    def _judge(self, read: _Words) -> None:
        """A claims READ done: each of its chunks was overwritten by a newer version under
        the READ (``reused``, the holder falls back, counted once) or is corrupt
        (``checksum``); suspects that came meanwhile get a READ of their own."""
        holder = read.holder
        claims = holder.offer.claims
        assert claims is not None
        words = self._words_answer(read, "its claims words")
        if words is None:
            if read.read.released:  # the READ failed: nothing tells what the chunks were
                for chunk, why in read.chunks:
                    self._corrupt(chunk, why, holder)
            return
        for chunk, why in read.chunks:
            start, size = self.manifest.chunk_span(chunk)
            start -= holder.base
            first = start // claims.region - read.low
            newest = int(words[first:-(-(start + size) // claims.region) - read.low].max())
            if newest <= claims.version:
                self._corrupt(chunk, why, holder)
            elif not holder.reused:
                holder.reused = True
                if holder.up:
                    self.fall_back("reused", f"chunk {chunk} was overwritten by version "
                                             f"{newest} while it was read (the holder "
                                             "reused its buffer)", holder)
                else:
                    self.picker.count("reused", f"chunk {chunk}: overwritten by version "
                                                f"{newest}", version=self.manifest.version,
                                      rank=holder.rank)
        self._end_words(read)
        if holder.reused:
            holder.suspects.clear()  # torn by the reuse, counted with it
        elif holder.suspects:
            self._ask_claims(holder, time.monotonic())

    def _unanswered(self, now: float) -> None:
        """Give up the holders whose words READ was not done in ``_words_deadline``."""
        limit = self._words_deadline()
        reads = [self.ready_read] + [h.claims_read for h in self.holders if h is not None]
        for read in reads:
            if read is None or now - read.posted < limit:
                continue
            try:
                if self.picker.reader is not None and \
                        self.picker.reader.words_done(read.read) is not None:
                    continue  # done, not looked at yet (the window was full)
            except TransportError:
                pass
            self._end_words(read)
            holder = read.holder
            if read.chunks:  # claims: not asked again for this version
                holder.mute = True
                for chunk, why in read.chunks + holder.suspects:
                    self._corrupt(chunk, why, holder)
                holder.suspects.clear()
            what = "readiness map" if not read.chunks else "claims words"
            self.fall_back("unanswered", f"a READ of its {what} was not done after "
                                         f"{limit:.1f} s (the holder does not answer)",
                           read.holder)

    def fall_back(self, cause: str, why: str, holder: NixlHolder | None = None) -> None:
        """Stop reading this version one-sided from ``holder`` (None: from every one);
        their remaining chunks go to ZeroMQ."""
        self._unqueue(holder)
        if self.ready_read is not None and holder in (None, self.ready_read.holder):
            self._end_words(self.ready_read)
        for each in self.holders if holder is None else [holder]:
            if each is not None and each.up:
                each.up = False
                self.picker.count(cause, why, version=self.manifest.version, rank=each.rank)

    def drain(self, timeout: float) -> None:
        """Drop what is queued; wait (bounded) for every READ in flight, then release them
        all."""
        self._unqueue()
        reader = self.picker.reader
        self._drop_words()
        deadline = time.monotonic() + timeout
        for req in list(self.pending):
            if req not in self.pending:
                continue
            transfer = self.pending[req].transfer
            while reader is not None and time.monotonic() < deadline:
                try:
                    if reader.poll(transfer):
                        break
                except TransportError:
                    break
                time.sleep(_POLL_S)
            self._end(req, give_back=True)

    def _drop_words(self) -> None:
        """Release every words READ: a claims READ is given ``WORDS_WAIT_S`` more to judge
        its chunks (else they count as ``checksum``); nothing waits for a readiness map."""
        if self.ready_read is not None:
            self._end_words(self.ready_read)
        reader = self.picker.reader
        for holder in self.holders:
            if holder is None or holder.claims_read is None or reader is None:
                continue
            read = holder.claims_read
            _wait_words(reader, read.read.transfer)
            unasked, holder.suspects = holder.suspects, []
            self._judge(read)
            if holder.claims_read is read:  # still in flight: released, not judged
                self._end_words(read)
                unasked = read.chunks + unasked
            if not holder.reused:
                for chunk, why in unasked:
                    self._corrupt(chunk, why, holder)

    def close(self) -> None:
        self.drain(self.picker.request_timeout)


class PeerNixlSource(NixlSource):
    """A version READ from a peer's staging (peers over NIXL, issue 31): one holder, the
    peer's offer (chunk ``c`` at ``c * chunk_size``; a readiness map while the peer is
    still receiving it). Owned and ticked by ``Peering``, which routes it the chunks
    its plan gives that peer; what it cannot read goes back as frames, counted as for
    the publisher's."""

    kind = "nixl_peer"

    def __init__(self, picker: NixlPicker, sink: SourceSink, manifest: wire.Manifest,
                 holder: NixlHolder, peer: str, arrived: Callable[[int], None]) -> None:
        super().__init__(picker, sink, manifest, [holder])
        self.peer = peer
        self._arrived = arrived

    @property
    def label(self) -> str:
        return "nixl-peer"

    def arrived(self, via: Any, size: int, now: float) -> None:
        self._arrived(size)


class ReadPace:
    """When to look at the READs in flight next, instead of a fixed short poll.

    Why: every look is a whole turn of the client's loop (sockets, credit, reports), and
    a 0.5 ms poll turned 2,000 times a second while the bytes moved on NIXL's own
    thread. A READ posted behind others starts when they end, so the oldest one's end
    is expected at ``max(posted, previous end) + bytes / rate``, the rate measured over
    the READs done so far (shared across versions by the picker) and aimed a little
    early (``AIM``: a look that finds it done cannot tell how early it ended, so the
    estimate only errs towards fast, and then one look more). Past that, the wait
    doubles from ``MIN_S`` (the estimate was early: a loaded box, a slower link) up to
    ``MAX_S``, and starts again at each READ done.
    """

    MIN_S = 0.0002
    MAX_S = 0.005
    FIRST_RATE = 1e9  # bytes/s before anything was measured
    AIM = 1.25
    #: a READ's deadline (``deadline``): this many times its expected time, at most
    #: ``DEADLINE_MAX_S`` (or the floor given, when that is longer)
    SLACK = 4.0
    DEADLINE_MAX_S = 60.0

    def __init__(self, rate: list[float]) -> None:
        self._rate = rate  # [bytes/s], the picker's, updated in place
        self._ends: dict[int, float] = {}  # req -> expected end of each READ, posting order
        self._late = 0  # looks since the oldest READ's expected end without it done
        self._last_done = 0.0
        self._done_bytes = 0  # READs found done since the last ``measure``

    def posted(self, req: int, nbytes: int, now: float) -> None:
        if not self._ends:
            self._last_done = now
        start = max(now, max(self._ends.values(), default=now))
        self._ends[req] = start + nbytes / (self._rate[0] * self.AIM)

    def dropped(self, req: int) -> None:
        self._ends.pop(req, None)

    def done(self, req: int, nbytes: int) -> None:
        self._ends.pop(req, None)
        self._done_bytes += nbytes

    def measure(self, now: float) -> None:
        """After a look: the bytes found done since the previous find, as one sample."""
        if not self._done_bytes:
            return
        took = now - self._last_done
        if took > 0:  # a moving average, each sample from the previous find
            self._rate[0] = 0.7 * self._rate[0] + 0.3 * max(self._done_bytes / took, 1e6)
        self._done_bytes = 0
        self._last_done = now
        self._late = 0

    def idle(self) -> None:
        self._ends.clear()
        self._late = 0

    def deadline(self, nbytes: int, floor: float) -> float:
        """Seconds a READ may take with ``nbytes`` in flight up to and including it:
        ``SLACK`` times their time at the measured rate, bounded below by ``floor`` (the
        client's ``request_timeout``) and above by ``DEADLINE_MAX_S``."""
        expected = nbytes / max(self._rate[0], 1e6)
        return max(floor, min(self.SLACK * expected, self.DEADLINE_MAX_S))

    def wait(self, now: float) -> float:
        due = next(iter(self._ends.values())) - now if self._ends else 0.0
        if due > self.MIN_S:
            return min(due, 10 * self.MAX_S)
        self._late += 1
        return min(self.MIN_S * (1 << min(self._late - 1, 8)), self.MAX_S)


class NixlPicker:
    """Gives a manifest with a NIXL offer a ``NixlSource`` (a ``SourcePicker``), counts
    why one was not given, and owns the reader (one NIXL agent per subscriber)."""

    def __init__(self, mode: bool | None, *, request_timeout: float, window_bytes: int) -> None:
        """``mode``: True (use it; a WARNING where NIXL cannot run), False (never), None
        (use it where NIXL imports)."""
        self.mode = mode
        self.request_timeout = request_timeout
        self.window_bytes = window_bytes
        self.reader: NixlReader | None = None
        self.fallback_causes: dict[str, int] = {}
        self.rank_fallbacks: dict[int, int] = {}  # sharded: fallbacks per trainer rank
        self.last_error: str | None = None
        self.bytes_asked = 0
        self.bytes_read = 0
        self.rate = [ReadPace.FIRST_RATE]  # READ bytes/s measured so far (``ReadPace``)
        self._source: NixlSource | None = None
        self._sizes: dict[int, int] = {}  # staging base address -> bytes registered
        self._gone: list[int] = []  # sparse staging bases dropped, to deregister
        self._sparse: dict[int, list[tuple[int, int]]] = {}  # sparse base -> ranges registered
        self._unavailable: str | None = None
        self._checked = False  # NIXL imported (seconds) only once a manifest offers it
        #: the agent's start on its own thread (``nixl_agent_start.py``): with the option
        #: True at once, auto at the first manifest offering NIXL; kept for its figures
        self._agent: AgentStart | None = None
        self._warn = RateLimitedLog(log)
        self._sink: SourceSink | None = None
        #: chunks of a version verified in place by any of its NIXL sources (``data_path``)
        self._in_place: tuple[wire.Manifest | None, int] = (None, 0)
        #: peers over NIXL, serving side: a claims word and a readiness map per staging
        #: buffer, registered with the reader's agent, counted in the staging budget
        #: (``peer_words.py``; the client sets ``words.pool``); offers per (buffer, version)
        self.words = PeerWords()
        #: peers' agents READ from lately, newest last (kept across versions, at most
        #: ``_MAX_PEER_AGENTS``: a plan's chains)
        self._peer_agents: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._peer_offers: collections.OrderedDict[tuple[int, int], NixlOffer] = \
            collections.OrderedDict()
        self._offers_lock = threading.Lock()  # ``freed`` runs on whichever thread drops
        if mode is True:  # it will be used: up before the first offer comes, most likely
            self._begin()

    # -- the picker --------------------------------------------------------------------------
    def __call__(self, manifest: wire.Manifest, sink: SourceSink) -> list[ChunkSource] | None:
        self._sink = sink
        offered = manifest.nixl is not None if manifest.shards is None \
            else any(shard.nixl is not None for shard in manifest.shards)
        if not offered or manifest.num_chunks == 0:
            return None
        old = self._source
        if old is not None and old.manifest is not manifest:
            self._source = None
            old.close()
        if self._source is not None:
            return [self._source]
        if self.mode is False:
            self.count("off", "this subscriber's nixl option is off", version=manifest.version)
            return None
        if manifest.adapters is not None:
            return None  # adapters are small
        holders = self._holders(manifest)
        if not any(holders):
            return None
        if self.started() is False:
            self.count("missing", self._unavailable or "NIXL cannot run here",
                       version=manifest.version)
            return None
        # while the agent starts the source holds what it takes (``NixlSource._await_agent``)
        self.keep_holders(holders)
        self._source = NixlSource(self, sink, manifest, holders)
        return [self._source]

    def _begin(self) -> None:
        if self._agent is None and self.reader is None and self._unavailable is None:
            self._agent = AgentStart("weightpub-subscriber", nixl_error)

    def started(self) -> bool | None:
        """Whether the reader is up: True, None while its agent starts (begun here if not
        yet; ``nixl_agent_start.py``), False if NIXL cannot run here (``unavailable`` says
        why: logged once). Never blocks."""
        if self.reader is not None:
            return True
        if self._unavailable is not None:
            return False
        self._begin()
        agent = self._agent
        assert agent is not None
        if not agent.done():
            return None
        self._checked = True
        self.reader = agent.take()
        if self.reader is None:
            self._unavailable = agent.error or "NIXL cannot run here"
            log.warning("nixl: %s%s; fetching over ZeroMQ frames (counted as missing)",
                        "asked for but " if self.mode else "", self._unavailable)
            return False
        return True

    def wait_started(self, timeout: float) -> bool:
        """``started``, waiting for the agent at most ``timeout`` seconds (not on a loop)."""
        if self.started() is None and self._agent is not None:
            self._agent.wait(timeout)
        return self.started() is True

    @property
    def start_began(self) -> float:
        """When the agent's start began (``AGENT_WAIT_S`` counts from it)."""
        return time.monotonic() if self._agent is None else self._agent.began

    @property
    def unavailable(self) -> str | None:
        return self._unavailable

    def keep_holders(self, holders: Sequence[NixlHolder | None]) -> None:
        """Holders of earlier versions (a restarted rank's old agent) are not kept (once
        the reader is up)."""
        if self.reader is not None:
            self.reader.keep({h.offer.agent for h in holders if h is not None}
                             | set(self._peer_agents))

    def in_place(self, manifest: wire.Manifest) -> int:
        held, count = self._in_place
        return count if held is manifest else 0

    def note_in_place(self, manifest: wire.Manifest) -> None:
        self._in_place = (manifest, self.in_place(manifest) + 1)

    # -- peers over NIXL (issue 31, ``docs/peers-over-nixl.md``) -------------------------------
    @property
    def peers_on(self) -> bool:
        """Peers over NIXL run only where the ``nixl`` option is True (not auto): a first
        slice (whole-version members whose version came over NIXL)."""
        return self.mode is True

    def peer_offer(self, buffer: torch.Tensor, manifest: wire.Manifest,
                   verified: Callable[[int], bool] | None) -> tuple[NixlOffer | None, str]:
        """This member's staging of ``manifest``'s version offered to a peer, or None and
        the cause: ``later`` (its own NIXL read has not registered the buffer yet: ask
        again), ``frames`` (it came over frames: staging not registered), ``off``.
        ``verified``: which chunks are final (None: all, a complete version); while some
        are not, the offer carries a readiness map (one word per chunk, the version's
        number once the chunk verified: ``chunk_verified``). Made on the client's thread
        (the agent is not thread-safe), cached per (buffer, version)."""
        if not self.peers_on or self.started() is False:
            return None, "off"
        reader = self.reader
        if reader is None:  # its agent is starting (own thread): its READs will register it
            return None, "later"
        base = _base(buffer).data_ptr()
        if base not in self._sizes:
            source = self._source
            if source is not None and source.manifest is manifest and source.up or \
                    verified is not None and not any(map(verified, range(manifest.num_chunks))):
                return None, "later"  # its READs may register the buffer: ask again
            return None, "frames"
        key = (buffer.data_ptr(), manifest.version)
        with self._offers_lock:  # ``freed`` may drop offers from another thread
            cached = self._peer_offers.get(key)
        if cached is not None and (verified is None or cached.ready is not None):
            return cached, ""
        ready = None
        if verified is not None:
            words = self.words.ready_map(reader, buffer.data_ptr(), manifest.num_chunks)
            if words is None:
                return None, "budget (no room in the staging budget for its readiness map)"
            words[:manifest.num_chunks] = [manifest.version if verified(c) else 0
                                           for c in range(manifest.num_chunks)]
            ready = NixlClaims(words.ctypes.data, words.nbytes, manifest.chunk_size,
                               manifest.version)
        claims = self.words.claim_of(buffer.data_ptr())
        if claims is None:  # not claimed at its start: it holds this version now
            claims = self.claim(buffer, manifest.version)
        try:
            offer = reader.offer([NixlRegion(buffer.data_ptr(), manifest.total_bytes)],
                                 claims=None if claims is None else NixlClaims(
                                     claims.ctypes.data, claims.nbytes,
                                     max(4096, manifest.total_bytes), manifest.version))
        except ProtocolError as exc:
            return None, f"frames ({exc})"
        offer = msgspec.structs.replace(offer, ready=ready)
        with self._offers_lock:
            self._peer_offers[key] = offer
            while len(self._peer_offers) > 8:
                self._peer_offers.popitem(last=False)
        return offer, ""

    def claim(self, buffer: torch.Tensor, version: int) -> numpy.ndarray | None:
        """Store ``version`` in the claims word of the staging buffer (one word for the
        whole buffer: a peer READing an older version there then counts ``reused``, not
        ``checksum``), before its first byte lands (``Peering.target_started``). None
        where NIXL does not run here or the staging budget has no room for the word."""
        reader = self.reader
        if reader is None or not self.peers_on:
            return None
        return self.words.claim(reader, buffer.data_ptr(), version)

    def peer_source(self, manifest: wire.Manifest, offer: NixlOffer, peer: str,
                    arrived: Callable[[int], None]) -> PeerNixlSource | None:
        """A source READing ``manifest``'s version from a peer's offer; None (counted)
        where it does not fit or NIXL cannot run here."""
        if self._sink is None or self.started() is False:
            self.count("missing", self._unavailable or "the client has not started",
                       version=manifest.version)
            return None  # while the agent starts the source holds what it takes
        misfit = offer_misfit(offer, manifest.total_bytes, manifest.chunk_size,
                              manifest.version, "the version's")
        if misfit is not None:
            self.count("bad_offer", f"peer {peer}: the offer's {misfit}",
                       version=manifest.version)
            return None
        self._peer_agents[offer.agent] = None
        self._peer_agents.move_to_end(offer.agent)
        while len(self._peer_agents) > _MAX_PEER_AGENTS:
            self._peer_agents.popitem(last=False)
        holder = NixlHolder(offer, 0, manifest.num_chunks, manifest.chunk_size)
        return PeerNixlSource(self, self._sink, manifest, holder, peer, arrived)

    def _holders(self, manifest: wire.Manifest) -> list[NixlHolder | None]:
        """Who READs come from: the publisher, or each rank offering its range (None for
        a rank that offers none or one that does not fit: counted, frames serve it)."""
        size = manifest.chunk_size
        if manifest.shards is None:
            assert manifest.nixl is not None
            ranges: list[tuple[NixlOffer | None, int, int, int | None]] = \
                [(manifest.nixl, 0, manifest.num_chunks, None)]
        else:
            ranges = [(s.nixl, s.first_chunk, s.num_chunks, s.rank) for s in manifest.shards]
        holders: list[NixlHolder | None] = []
        for offer, first, count, rank in ranges:
            need = min(count * size, manifest.total_bytes - first * size)
            if offer is None:
                self.count("unoffered", "offers no NIXL (off or missing there)",
                           version=manifest.version, rank=rank)
                holders.append(None)
            elif (misfit := offer_misfit(offer, need, size, manifest.version,
                                         "the version's" if rank is None else "its range's")):
                self.count("bad_offer", f"the offer's {misfit}", version=manifest.version,
                           rank=rank)
                holders.append(None)
            else:
                holders.append(NixlHolder(offer, first, count, size, rank))
        return holders

    def count(self, cause: str, why: str, *, version: int, once: bool = True,
              rank: int | None = None) -> None:
        """One more fallback of ``cause`` (a version, or a chunk for ``checksum``), of a
        sharded trainer's ``rank`` (also counted in ``rank_fallbacks``)."""
        count_bounded(self.fallback_causes, cause, _MAX_CAUSES)
        if rank is not None:
            count_bounded(self.rank_fallbacks, rank, _MAX_RANKS)
            why = f"trainer rank {rank}: {why}"
        self.last_error = f"version {version}: {why} ({cause})"[:1024]
        if cause not in ("off", "missing"):  # missing: logged once, by ``started``
            self._warn.warning(f"nixl:{cause}", f"nixl: {self.last_error}; fetching over "
                                                "ZeroMQ frames")

    @property
    def fallbacks(self) -> int:
        return sum(self.fallback_causes.values())

    # -- staging buffers -----------------------------------------------------------------------
    def register(self, base: torch.Tensor) -> None:
        """Register a pooled staging buffer's whole allocation once."""
        assert self.reader is not None
        while self._gone:
            self.freed(self._gone.pop())
        address, length = base.data_ptr(), base.numel()
        if not self.reader.registered(address, length):
            self.reader.register(address, length)
            self._sizes[address] = length

    def register_sparse(self, target: SparseAssembly) -> None:
        """Register the pages a slice target's plan touches (``touched_ranges``), not its
        whole buffer: registering pins pages (RDMA), so registering the version's size
        would make a sparse buffer resident. Once per buffer (a buffer is reused only for
        the same plan and layout). The buffer is anonymous memory the pool never frees
        through the allocator (it goes with its last view): its ranges are deregistered
        once that base tensor has gone (noted by whichever thread drops it, done here on
        the client's: the agent is not thread-safe), before anything new is registered
        at its address."""
        reader = self.reader
        assert reader is not None
        while self._gone:
            self.freed(self._gone.pop())
        base = _base(target.buffer)
        key = base.data_ptr()
        if key in self._sparse:
            return
        start = target.buffer.data_ptr()
        done: list[tuple[int, int]] = []
        try:
            for offset, length in touched_ranges(target.layout, key + base.numel() - start):
                reader.register(start + offset, length)
                done.append((start + offset, length))
        except BaseException:
            for address, length in done:
                reader.forget_local(address, length)
            raise
        self._sparse[key] = done
        weakref.finalize(base, self._gone.append, key)

    def freed(self, address: int) -> None:
        """The pool dropped a staging buffer (or a sparse one went): deregister it, and
        its peers' words go (their offers with them)."""
        self.words.freed(self.reader, address)
        with self._offers_lock:
            for key in [key for key in self._peer_offers if key[0] == address]:
                del self._peer_offers[key]
        ranges = self._sparse.pop(address, [])
        length = self._sizes.pop(address, None)
        if length is not None:
            ranges.append((address, length))
        for start, size in ranges:
            if self.reader is None:
                break
            try:
                self.reader.forget_local(start, size)
            except Exception as exc:
                log.warning("nixl: deregistering a staging buffer failed: %s", exc)

    def allocator(self, inner: Allocator | None) -> Allocator:
        return RegisteringAllocator(self, inner)

    # -- a ChunkListener: no READ may outlive its assembly's buffer ----------------------------
    def target_started(self, manifest: wire.Manifest) -> None:
        return None

    def chunk_verified(self, manifest: wire.Manifest, chunk: int, data: memoryview) -> None:
        """A peer READing this version sees the chunk final (its readiness map)."""
        if not self.words.maps:
            return
        start = numpy.frombuffer(data, dtype=numpy.uint8).ctypes.data \
            - manifest.chunk_span(chunk)[0]
        self.words.verified(start, chunk, manifest.version)

    def target_completed(self, manifest: wire.Manifest) -> None:
        return None

    def target_dropped(self, manifest: wire.Manifest) -> None:
        if self._source is not None:
            self._source.drain(self.request_timeout)

    def status(self) -> dict[str, Any]:
        return {
            "mode": {True: "on", False: "off", None: "auto"}[self.mode],
            # None until a manifest offered NIXL (and never with the option off)
            "available": self._unavailable is None if self._checked else None,
            # the agent's start (its own thread): starting, up, failed, or None (not begun);
            # the seconds it took
            "agent": None if self._agent is None and self.reader is None
            else "up" if self.reader is not None
            else "failed" if self._unavailable is not None else "starting",
            "agent_start_s": None if self._agent is None or self._agent.took is None
            else round(self._agent.took, 3),
            "registered_bytes": 0 if self.reader is None else self.reader.registered_bytes,
            "bytes_read": self.bytes_read,
            "fallbacks": self.fallbacks,
            "fallback_causes": dict(self.fallback_causes),
            # a sharded trainer's ranks whose ranges came (partly) as frames: how often
            "rank_fallbacks": dict(self.rank_fallbacks),
            "last_error": self.last_error,
            # peers over NIXL: the claims words and readiness maps kept for peers (bytes
            # counted in the staging budget), and words not made for want of room there
            **self.words.stats(),
        }

    def close(self) -> None:
        source, self._source = self._source, None
        if source is not None:
            source.close()
        reader, self.reader = self.reader, None
        if self._agent is not None:
            self._agent.close()  # one still starting closes its reader when made
        self._sizes.clear()
        with self._offers_lock:
            self._peer_offers.clear()
        self.words.clear(reader)
        self._sparse.clear()
        if reader is not None:
            reader.close()


class RegisteringAllocator:
    """The staging pool's allocator, telling the picker of each buffer it drops."""

    def __init__(self, picker: NixlPicker, inner: Allocator | None = None) -> None:
        self._picker = picker
        self._inner: Allocator = inner or HostAllocator()

    def allocate(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        return self._inner.allocate(nbytes, pinned=pinned)

    def free(self, key: int) -> None:
        self._picker.freed(key)
        self._inner.free(key)

