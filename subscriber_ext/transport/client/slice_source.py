"""One receiver's slices of each version (issue 30), as a ``ChunkSource`` and its picker.

``SliceFetcher`` is what ``WeightSubscriber(slice_plan=...)`` adds to its client: the
picker (``staging/chunk_source.py``), the maker of each target (a ``SparseAssembly``:
``SyncClient(targets=...)``) and the status of the plan. ``SliceSource`` is the serving
source: one DEALER of its own to the publisher's ROUTER (``MonitoredDealer``), on
which it registers the plan once per publisher instance (``slice_reg`` in parts,
``slice_ack``), asks each version's ``slice_sums``, then ``slice_fetch``es the chunks
the plan touches under the client's credit. Replies are chunk frames handed to the
client like any source's (``sink.chunk``): ``ChunkReceiver`` places them (the
assembly hashes the bytes as they came and scatters the planned ones) and verifies
them against the sums before the version can be staged; a mismatch counts a try.

Fallbacks, each counted by cause (``FALLBACK_CAUSES``, in ``status()["slice_plan"]``):
the publisher does not answer the registration (a publisher before issue 30 drops
the message) or refuses it (the plan is bad, too big, or for another model), or
refuses a fetch for its bounds: whole chunks from the same publisher, still only the
touched ones, each verified against the manifest and only its planned bytes kept. A
sharded version (``Manifest.shards``): each trainer rank serves its own part of the
plan (``shard_slices.py``, a ``SliceSource`` per rank). Deltas: a sliced subscriber keeps
its last staged version (only the plan's bytes, counted in the staging budget as a
whole subscriber's base is) as its delta base; a version whose manifest offers a
delta against it comes as the delta payloads of the chunks the plan touches (``fetch``
with ``base`` and ``plan``, from the publisher or each trainer rank: a chunk whose
delta is not shorter than its slice comes as the slice), decoded over the base,
applied to the planned bytes only and checked against the version's slice sums
(``staging/sparse_delta.py``). A delta that is not served, does not decode
or does not match, one that costs more bytes than the raw slices (then the next
``DELTA_PAUSE`` versions too), or a base that is not in the version's chain, falls
back to raw slices for that version, counted by cause (``DELTA_FALLBACK_CAUSES``, in
``status()["slice_plan"]["delta_fallbacks"]``). With ``peer_share`` the client's
``Peering`` (a first source) is offered this source's next chunks once the sums are
in and asks members of the same plan (``peers/peering.py``); raw slices only (not a
delta step, not a whole-chunk fallback; a sharded version too). The collective path
is not offered to a sliced subscriber (``slice_plan`` with ``collective`` is a
``ConfigError``). Conflation is the client's, as for any target.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any

import zmq

from subscriber_ext.transport.client.dealer_source import DealerSource
from subscriber_ext.transport.client.stream_source import StreamSource
from subscriber_ext.transport.staging.assembly import Assembly, DeltaStart
from subscriber_ext.transport.staging.chunk_source import ChunkSource, Retry, SourceSink
from subscriber_ext.transport.staging.sparse_assembly import SparseAssembly
from subscriber_ext.transport.staging.sparse_delta import SparseDeltaAssembly
from weightpub_wire import chunk_frame, stream_link
from weightpub_wire import protocol as wire
from weightpub_wire.buffers import BufferPool
from weightpub_wire.errors import ProtocolError, VersionUnavailable, WeightPubTimeout
from weightpub_wire.monitored_dealer import (
    LINK_EVENTS,
    MonitoredDealer,
    SocketHook,
    chunk_reply_bytes,
)
from weightpub_wire.slice_layout import SliceLayout
from weightpub_wire.slice_messages import (
    MAX_PART_BYTES,
    SLICE_REPLIES,
    SliceAck,
    SliceFetch,
    SliceRegister,
    SliceSums,
    SliceSumsReply,
)
from weightpub_wire.slice_plan import SlicePlan, SliceRuns

__all__ = ["CONTROL_TRIES", "DELTA_FALLBACK_CAUSES", "DELTA_PAUSE", "FALLBACK_CAUSES",
           "SliceFetcher", "SliceSource", "register_parts"]

FALLBACK_CAUSES = (
    "no_answer",  # the publisher did not answer the registration (it predates slices)
    "refused",  # the publisher refused the plan (bad, too big, another model)
    "busy",  # the publisher refused a slice fetch for its bounds
    "sums",  # the slice checksums did not come (or did not fit the plan)
    "sharded",  # a trainer rank of a sharded version serves whole chunks (shard_slices.py)
    "evicted",  # the publisher kept dropping the plan (more plans than it holds)
)
CONTROL_TRIES = 3  # a registration or sums request asked this often before falling back
DELTA_FALLBACK_CAUSES = (
    "no_base",  # the manifest offers a delta, but not against the base held (or none held)
    "unserved",  # the publisher (a trainer rank) did not serve the delta
    "decode",  # a delta payload did not decode
    "checksum",  # the rebuilt planned bytes failed the version's slice sums
    "sums",  # no slice sum to check a rebuilt chunk against (whole chunks came instead)
    "too_big",  # the delta cost more than the raw slices (raw chunks, a thin plan)
    "paused",  # a delta offered after a ``too_big``: raw slices for ``DELTA_PAUSE`` versions
)
DELTA_PAUSE = 4  # versions fetched as raw slices after a delta that cost more than them


def register_parts(plan: SlicePlan, digest: str, req: int) -> list[SliceRegister]:
    """The plan as ``slice_reg`` messages, each under ``MAX_PART_BYTES`` encoded (a tensor
    with more runs than fit one part continues in the next under the same name)."""
    budget = MAX_PART_BYTES - 256 - len(plan.layout.encode())
    groups: list[list[SliceRuns]] = [[]]
    used = 0
    for entry in plan.tensors:
        runs = list(entry.runs)
        name = len(entry.tensor.encode()) + 16
        while True:
            room = (budget - used - name) // 40  # an encoded run: at most 37 bytes
            if room < 1 and groups[-1]:
                groups.append([])
                used = 0
                continue
            take, runs = runs[: max(room, 1)], runs[max(room, 1):]
            groups[-1].append(SliceRuns(entry.tensor, take))
            used += name + 40 * len(take)
            if not runs:
                break
            groups.append([])
            used = 0
    groups = [g for g in groups if g] or [[]]
    return [SliceRegister(req=req, digest=digest, layout=plan.layout, part=index,
                          parts=len(groups), tensors=tuple(group))
            for index, group in enumerate(groups)]


class SliceSource(DealerSource):
    """The publisher's ROUTER asked for one plan's slices, on a DEALER of its own."""

    def __init__(self, fetcher: SliceFetcher, dealer: MonitoredDealer, sink: SourceSink, *,
                 chunks_per_request: int, request_timeout: float, limits: wire.Limits) -> None:
        super().__init__(dealer, sink, chunks_per_request=chunks_per_request,
                         request_timeout=request_timeout, limits=limits)
        self.fetcher = fetcher
        #: the plan this source registers (a trainer rank's: its part, ``shard_slices.py``)
        self.plan = fetcher.plan
        self.digest = fetcher.digest
        self._target: weakref.ref[SparseAssembly] | None = None
        self._whole: str | None = None  # the target's chunks come whole here (the cause)
        self._mine: tuple[int, ...] = ()  # the target's touched chunks this source serves
        #: publisher instances that hold this plan, and that will not (with the cause)
        self.registered: set[str] = set()
        self.refusing: dict[str, str] = {}
        #: a trainer rank's stream source (``shard_slices.py``): its token is asked over
        #: this DEALER, and the reply (or an error instead) read back here
        self.stream: StreamSource | None = None
        #: the control request in flight: (kind, req, publisher_id, sent_at, tries)
        self._control: tuple[str, int, str, float, int] | None = None
        self._forgotten = 0  # ``unknown_plan`` replies for the current target

    @property
    def label(self) -> str:
        return "publisher (slices)"

    # -- the target and its control requests ---------------------------------------------------
    # -- its scope: the whole plan at the publisher (a trainer rank's source narrows it) ------
    def publisher_id(self, target: Assembly) -> str:
        """The instance its requests name."""
        return target.manifest.publisher_id

    def serves(self, target: SparseAssembly) -> tuple[int, ...]:
        """The target's touched chunks this source serves (and has the sums of)."""
        return target.layout.chunks

    def wire_chunk(self, chunk: int) -> int:
        """A chunk's id in this source's requests and replies (the union's, here)."""
        return chunk

    def _follow(self, target: Assembly) -> SparseAssembly | None:
        if not isinstance(target, SparseAssembly):
            return None
        if self._target is None or self._target() is not target:
            self._target = weakref.ref(target)
            self._control = None
            self._forgotten = 0
            self._whole = None
            self._mine = self.serves(target)
            publisher = self.publisher_id(target)
            if publisher in self.refusing:
                self._fall_back(target, self.refusing[publisher])
        return target

    def _fall_back(self, target: SparseAssembly, cause: str) -> None:
        if self._whole is None:
            self._whole = cause
            if target.whole_cause is None:
                target.whole_cause = cause
            self.fetcher.count_fallback(cause)

    def _slicing(self, target: SparseAssembly) -> bool:
        """Its chunks of ``target`` come as slices (not whole) from this source."""
        return self._whole is None

    def _want_sums(self, target: SparseAssembly, now: float) -> None:
        """Register the plan, then ask the target's sums (one control request at a time)."""
        if self._control is not None:
            return
        publisher = self.publisher_id(target)
        if publisher not in self.registered:
            req = self._sink.requests.next_id()
            for part in register_parts(self.plan, self.digest, req):
                self.send(part)
            self._control = ("reg", req, publisher, now, 1)
            return
        req = self._sink.requests.next_id()
        self.send(SliceSums(req=req, publisher_id=publisher, version=target.manifest.version,
                             digest=self.digest))
        self._control = ("sums", req, publisher, now, 1)

    def tick(self, now: float) -> float:
        """A control request unanswered for ``request_timeout`` is asked again; after
        ``CONTROL_TRIES`` the target's chunks come whole."""
        control = self._control
        target = None if self._target is None else self._target()
        if control is None or target is None:
            return 0.1 if target is not None and not target.has_sums(self._mine) else 1.0
        kind, _, publisher, sent_at, tries = control
        if now - sent_at < self.request_timeout:
            return self.request_timeout - (now - sent_at)
        self._control = None
        if tries >= CONTROL_TRIES:
            cause = "no_answer" if kind == "reg" else "sums"
            if kind == "reg":
                self.refusing[publisher] = cause
            self._fall_back(target, cause)
            return 0.0
        self._want_sums(target, now)
        if self._control is not None:
            self._control = (*self._control[:4], tries + 1)
        return 0.0

    # -- asking ----------------------------------------------------------------------------------
    def candidates(self, target: Assembly, asked: set[int], limit: int) -> list[int]:
        sparse = self._follow(target)
        if sparse is not None and self._slicing(sparse) and (
                not sparse.has_sums(self._mine) or
                self.publisher_id(sparse) not in self.registered):
            self._want_sums(sparse, time.monotonic())  # (again, after an unknown_plan)
            return []
        return self.next_chunks(target, asked, limit)

    def next_chunks(self, target: Assembly, asked: set[int], limit: int) -> list[int]:
        """Up to ``limit`` missing chunks it serves, not ``asked``, in fetch order."""
        return target.next_chunks(asked, limit)

    def ask(self, target: Assembly, chunks: Sequence[int], now: float) -> list[int]:
        sparse = self._follow(target)
        version, publisher = target.manifest.version, self.publisher_id(target)

        def request(req: int, batch: list[int]) -> Any:
            chunks = tuple(self.wire_chunk(chunk) for chunk in batch)
            if target.fetch_base:  # a delta step: delta payloads (slices where not shorter)
                return wire.FetchRequest(req=req, publisher_id=publisher,
                                         version=target.fetch_version, chunks=chunks,
                                         base=target.fetch_base, plan=self.digest)
            if sparse is not None and self._slicing(sparse):
                return SliceFetch(req=req, publisher_id=publisher, version=version,
                                  digest=self.digest, chunks=chunks)
            return wire.FetchRequest(req=req, publisher_id=publisher, version=version,
                                     chunks=chunks)

        return self.ask_batches(chunks, now, request)

    def expire(self, now: float, retry: Retry) -> bool:
        """Re-ask what the publisher left unanswered too long; each chunk counts a try."""
        for request in self._sink.requests.timed_out(now, self.request_timeout, self,
                                                     self.answered):
            for chunk in sorted(request.chunks):
                if retry(chunk, "timed out at the publisher (slices)", WeightPubTimeout):
                    return True
        return False

    # -- replies ---------------------------------------------------------------------------------
    def read(self, now: float) -> None:
        sink = self._sink
        for _ in range(256):
            try:
                first = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            more = int(self.sock.getsockopt(zmq.RCVMORE))
            try:
                if self.pairing.due is not None:
                    if chunk_frame.is_chunk(first.buffer) and \
                            len(first.buffer) == chunk_frame.HEADER_BYTES and not more:
                        # a reconnect lost the payload due: say so, and read the new header
                        lost, self.pairing.due = self.pairing.due, None
                        sink.bad(ProtocolError(f"slice source: the payload of chunk "
                                               f"{lost.chunk} never came (a reconnect)"))
                    else:
                        header = self.pairing.take(first.buffer, more)
                        self.answered = now
                        sink.chunk(self.union_header(header), first, self, self)
                        continue
                if chunk_frame.is_chunk(first.buffer):
                    header = chunk_frame.parse(first.buffer)
                    if more:
                        raise ProtocolError(f"chunk {header.chunk}: more frames follow")
                    if header.follows:
                        self.pairing.expect(header)
                    else:
                        self.answered = now
                        sink.chunk(self.union_header(header), first, self, self)
                    continue
                message = wire.decode(first.buffer, expect=(
                    wire.ErrorReply, *SLICE_REPLIES, stream_link.StreamToken),
                                      limits=self.limits)
            except ProtocolError as exc:
                sink.discard_rest(more, self.sock)
                sink.bad(ProtocolError(f"slice source: bad reply: {exc}"))
                continue
            sink.discard_rest(more, self.sock)
            self._on_message(message, now)

    def union_header(self, header: chunk_frame.ChunkHeader) -> chunk_frame.ChunkHeader:
        """A reply's header in the union's chunk ids (as it came, here)."""
        return header

    def _on_message(self, message: Any, now: float) -> None:
        stream = self.stream
        if isinstance(message, (stream_link.StreamToken, wire.ErrorReply)) \
                and stream is not None and stream.owns(message):
            stream.on_reply(message)  # the token (or no token: frames serve)
            return
        if isinstance(message, stream_link.StreamToken):
            return  # a token nobody waits for: dropped
        control = self._control
        target = None if self._target is None else self._target()
        mine = control is not None and getattr(message, "req", None) == control[1]
        if isinstance(message, SliceAck) and mine and control is not None:
            self._control = None
            if message.digest == self.digest:
                self.registered.add(control[2])
                if target is not None:
                    self._want_sums(target, now)
        elif isinstance(message, SliceSumsReply) and mine:
            self._control = None
            if target is None or message.version != target.manifest.version:
                return
            if message.digest != self.digest or len(message.sums) != len(self._mine):
                self._sink.bad(ProtocolError(
                    f"slice_sums_rep: {len(message.sums)} sums for the "
                    f"{len(self._mine)} chunks plan {self.digest} touches"))
                self._fall_back(target, "sums")
                return
            target.set_sums(message.sums, self._mine)
        elif isinstance(message, wire.ErrorReply):
            self._on_error(message, mine, target)

    def _on_error(self, error: wire.ErrorReply, mine: bool,
                  target: SparseAssembly | None) -> None:
        table = self._sink.requests
        if not mine and target is not None and target.fetch_base and error.req in table:
            # a delta step not served (none held, or the publisher's bounds): the client
            # fetches the version as raw slices (``SyncClient._delta_failed``)
            if isinstance(target, SparseDeltaAssembly) and target.cause is None:
                target.cause = "unserved"
                self.fetcher.count_delta_fallback("unserved")
            self._sink.error(error)
            return
        if error.code == "unknown_plan":  # the publisher forgot it (its LRU): register again
            if target is not None:
                self.registered.discard(self.publisher_id(target))
                self._forgotten += 1
                if self._forgotten > CONTROL_TRIES:  # it keeps dropping it: whole chunks
                    self.fetcher.last_refusal = error.message
                    self._fall_back(target, "evicted")
            if mine:
                self._control = None
            elif error.req in table:
                table.forget(error.req)  # its chunks are asked again once registered
            return
        if mine:
            self._control = None
            if target is None:
                return
            if error.code == "version_unavailable":
                self._sink.give_up(VersionUnavailable(f"publisher: {error.message}"))
                return
            self.refusing[self.publisher_id(target)] = "refused"
            self.fetcher.last_refusal = error.message
            self._fall_back(target, "refused")
            return
        if error.code == "bad_request" and error.req in table and target is not None \
                and self._slicing(target):
            table.forget(error.req)  # the publisher's bounds: fetch whole chunks instead
            self.fetcher.last_refusal = error.message
            self._fall_back(target, "busy")
            return
        self._sink.error(error)


class SliceFetcher:
    """A sliced subscriber's part of its client: picker, target maker, status."""

    def __init__(self, plan: SlicePlan, ctx: zmq.Context, endpoint: str, *,
                 limits: wire.Limits, chunks_per_request: int, request_timeout: float,
                 hooks: Sequence[SocketHook] = ()) -> None:
        self.plan = plan
        self.digest = plan.digest()
        self.needed_bytes = plan.needed_bytes
        self.ctx = ctx
        self.endpoint = endpoint
        self.limits = limits
        self.chunks_per_request = chunks_per_request
        self.request_timeout = request_timeout
        self.hooks = list(hooks)
        self.source: SliceSource | None = None
        self.fallbacks: Counter[str] = Counter()
        self.last_refusal = ""
        self.version_bytes = 0
        self.slice_bytes = 0
        self.whole_bytes = 0
        self.delta_bytes = 0
        self.delta_fallbacks: Counter[str] = Counter()
        self._delta_pause = 0  # versions still fetched raw after a ``too_big``
        self._layouts: dict[tuple[str, int], SliceLayout] = {}

    @property
    def delta_plan(self) -> str:
        """The plan its delta bases hold (``TargetMaker``): its own."""
        return self.digest

    # -- the target maker (``SyncClient(targets=...)``) ----------------------------------------
    def layout(self, manifest: wire.Manifest) -> SliceLayout:
        """The plan in ``manifest``'s layout (cached for the newest two); ``ProtocolError``
        when the plan does not fit the model."""
        key = (manifest.publisher_id, manifest.version)
        layout = self._layouts.get(key)
        if layout is None:
            layout = SliceLayout.build(self.plan, manifest)
            self._layouts = {k: v for k, v in list(self._layouts.items())[-1:]}
            self._layouts[key] = layout
        return layout

    def staged_bytes(self, manifest: wire.Manifest) -> int:
        """What staging ``manifest`` costs against the budget: the pages the plan touches."""
        try:
            return self.layout(manifest).resident_bytes
        except ProtocolError:
            return manifest.total_bytes  # refused by ``assembly`` with the reason

    def assembly(self, manifest: wire.Manifest, pool: BufferPool, start: DeltaStart) -> Assembly:
        """Raw slices, or (``start`` has a base) the plan's bytes rebuilt from deltas."""
        layout = self.layout(manifest)
        self.version_bytes = manifest.total_bytes
        if start.base is not None and self._delta_pause:
            self._delta_pause -= 1
            self.count_delta_fallback("paused")
        elif start.base is not None:
            return SparseDeltaAssembly(manifest, pool, layout, self.digest, start.base,
                                       start.steps, on_bytes=self.delta_received,
                                       on_failed=self.count_delta_fallback)
        if start.why == "no_base":
            self.count_delta_fallback("no_base")
        return SparseAssembly(manifest, pool, layout, self.digest, on_bytes=self.received)

    def delta_received(self, nbytes: int) -> None:
        """A delta reply's payload bytes (``SparseDeltaAssembly.place``)."""
        self.delta_bytes += nbytes

    def count_delta_fallback(self, cause: str) -> None:
        self.delta_fallbacks[cause] += 1
        if cause == "too_big":
            self._delta_pause = DELTA_PAUSE

    def received(self, whole: bool, nbytes: int) -> None:
        """A reply's payload bytes, by form (``SparseAssembly.place``)."""
        if whole:
            self.whole_bytes += nbytes
        else:
            self.slice_bytes += nbytes

    def count_fallback(self, cause: str) -> None:
        self.fallbacks[cause] += 1

    # -- the picker ------------------------------------------------------------------------------
    def __call__(self, manifest: wire.Manifest, sink: SourceSink) -> list[ChunkSource] | None:
        if manifest.shards is not None:
            return None  # the trainer ranks serve (``shard_slices.ShardSlices``)
        if self.source is None:
            dealer = MonitoredDealer(self.ctx, self.endpoint, hooks=self.hooks,
                                     events=LINK_EVENTS,
                                     handshake_timeout=self.request_timeout,
                                     max_message_bytes=chunk_reply_bytes(
                                         self.limits.max_control_bytes))
            self.source = SliceSource(self, dealer, sink,
                                      chunks_per_request=self.chunks_per_request,
                                      request_timeout=self.request_timeout,
                                      limits=self.limits)
        return [self.source]

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None

    def status(self) -> dict[str, Any]:
        return {
            "layout": self.plan.layout,
            "digest": self.digest,
            "needed_bytes": self.needed_bytes,
            "version_bytes": self.version_bytes,
            "fraction": None if not self.version_bytes
            else round(self.needed_bytes / self.version_bytes, 4),
            "slice_bytes": self.slice_bytes,
            "whole_chunk_bytes": self.whole_bytes,
            "delta_bytes": self.delta_bytes,
            "fallbacks": dict(self.fallbacks),
            "delta_fallbacks": dict(self.delta_fallbacks),
            "last_refusal": self.last_refusal or None,
        }
