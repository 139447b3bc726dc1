"""Serving slices (issue 30): registered plans, their per-version checksums, their bytes.

On the serving thread, beside ``DeltaServing``: a subscriber registers its plan
(``slice_reg`` parts, ``weightpub_wire.slice_messages``), asks ``slice_sums`` for a
version, then ``slice_fetch``es the chunks its plan touches; each reply is one chunk
frame carrying the plan's bytes of that chunk gathered back to back
(``SliceLayout.gather``: one copy of only the requested bytes; small runs cannot go
without a copy anyway, and one frame per chunk keeps the reply pairing of
``chunk_frame`` as it is).

Checksums: per (version, plan) the plan's bytes of each touched chunk are hashed
once, on the ``weightpub-slice-sums`` thread (xxh3 and numpy copies release the
GIL; the serving loop never waits for it), after every touched chunk is final, and
kept while the version is held. A chunk the plan covers whole reuses the manifest's
checksum. Cost: one hash of the planned bytes per layout per version; over the ranks
of one replica that is about one pass over the version.

Bounds: ``SliceLimits``: plans kept (LRU, by count and encoded bytes), registrations
being assembled, (version, plan) entries cached, chunks waiting to be served (per
peer and in all: past either, a ``bad_request`` and the subscriber fetches whole
chunks). A bad plan is refused with an ``error`` naming what is wrong (the field, the
tensor, the run); nothing a subscriber sends here can stop the serving thread.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import numpy as np

from publisher.serving.deferred_sends import DeferredSends
from publisher.store.version_store import PublishedVersion, VersionStore
from weightpub_wire import protocol as wire
from weightpub_wire.chunk_frame import ChunkHeader
from weightpub_wire.errors import ProtocolError
from weightpub_wire.slice_layout import SliceLayout
from weightpub_wire.slice_messages import (
    SliceAck,
    SliceFetch,
    SliceRegister,
    SliceSums,
    SliceSumsReply,
)
from weightpub_wire.slice_plan import MAX_PLAN_TENSORS, SlicePlan, SliceRuns, encode_plan

__all__ = ["SliceLimits", "SliceServing"]

log = logging.getLogger("weightpub.publisher")

#: (identity, chunk header, payload, version it points into, owned) -> sent (or peer gone)
Send = Callable[[bytes, ChunkHeader, "memoryview | bytes", "PublishedVersion | None", bool],
                bool]
Reply = Callable[[bytes, bytes], bool]


@dataclass(frozen=True, slots=True)
class SliceLimits:
    max_plans: int = 64  # registered plans kept (LRU)
    max_plan_bytes: int = 64 << 20  # their encoded bytes, and those being assembled
    max_pending: int = 16  # registrations whose parts are still coming
    max_entries: int = 64  # (version, plan) layouts and checksums cached
    max_deferred: int = 65_536  # slice chunks waiting for their bytes or credit, in all
    max_deferred_per_peer: int = 4096


@dataclass(slots=True)
class _Pending:
    layout: str
    parts: int
    received: dict[int, tuple[SliceRuns, ...]] = field(default_factory=dict)
    nbytes: int = 0


@dataclass(slots=True)
class _Entry:
    """One plan in one version: its layout, and its checksums once hashed."""

    version: PublishedVersion
    layout: SliceLayout
    sums: tuple[int, ...] | None = None
    future: Future[tuple[int, ...] | None] | None = None
    waiters: list[tuple[bytes, int]] = field(default_factory=list)  # (identity, req)
    eager: bool = False  # hashed ahead of any request (``SliceServing._hash_ahead``)

    @property
    def nbytes(self) -> int:
        blocks = sum(len(b) for b in self.layout.blocks.values())
        return 64 * blocks + 16 * len(self.layout.chunks)


class SliceServing:
    """Answers slice requests; owned by ``ServingThread`` and used only on its thread."""

    def __init__(self, store: VersionStore, publisher_id: str, send: Send, reply: Reply, *,
                 limits: SliceLimits | None = None, max_chunks_per_request: int = 256) -> None:
        self._store = store
        self._publisher_id = publisher_id
        self._send = send
        self._reply = reply
        self.limits = limits or SliceLimits()
        self._max_chunks = max_chunks_per_request
        self._plans: OrderedDict[str, tuple[SlicePlan, int]] = OrderedDict()
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._refused: OrderedDict[str, None] = OrderedDict()  # its later parts: dropped
        self._entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()
        self._deferred: DeferredSends[_Entry] = DeferredSends(
            self.limits.max_deferred, self.limits.max_deferred_per_peer)
        self._executor: ThreadPoolExecutor | None = None
        #: plans whose sums were asked for the newest version seen: hashed ahead for the
        #: next one, as soon as its bytes are final (no round trip waits for the hash)
        self._eager: dict[str, int] = {}  # digest -> version it was last asked for
        self._seen_latest = 0
        self.bytes_sent = 0
        self.refused = 0  # requests refused (bad plan, unknown plan, bounds)
        #: ``held_bytes`` as of the last request or flush: read by other threads (the host
        #: budget's scratch), which must not walk this thread's tables
        self.held = 0

    # -- what status and memory see ------------------------------------------------------------
    @property
    def waiting(self) -> bool:
        """Chunks wait for bytes or credit, or checksums are being computed."""
        return bool(self._deferred) or any(e.waiters for e in self._entries.values())

    @property
    def held_bytes(self) -> int:
        """Bytes this part holds: plans, registrations being assembled, layouts, sums."""
        plans = sum(size for _, size in self._plans.values())
        pending = sum(p.nbytes for p in self._pending.values())
        entries = sum(e.nbytes for e in self._entries.values())
        return plans + pending + entries

    @property
    def plans(self) -> int:
        return len(self._plans)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # -- requests ------------------------------------------------------------------------------
    def handle(self, identity: bytes, request: wire.Message | SliceRegister | SliceSums
               | SliceFetch, frame_bytes: int) -> None:
        if isinstance(request, SliceRegister):
            self._register(identity, request, frame_bytes)
        elif isinstance(request, SliceSums):
            self._sums(identity, request)
        elif isinstance(request, SliceFetch):
            self._fetch(identity, request)
        self.held = self.held_bytes

    def _error(self, identity: bytes, req: int, code: str, message: str,
               version: int = 0) -> None:
        self.refused += code != "version_unavailable"
        error = wire.ErrorReply(req=req, code=code, message=message[:4000], version=version)
        self._reply(identity, wire.encode(error))

    def _register(self, identity: bytes, part: SliceRegister, frame_bytes: int) -> None:
        held = self._plans.get(part.digest)
        if held is not None:
            self._plans.move_to_end(part.digest)
            if part.part == part.parts - 1:
                self._ack(identity, part.req, part.digest, held[0])
            return
        if part.digest in self._refused:
            return  # one error per refused plan, not one per part
        pending = self._pending.get(part.digest)
        if pending is None or (pending.layout, pending.parts) != (part.layout, part.parts):
            pending = self._pending[part.digest] = _Pending(part.layout, part.parts)
        self._pending.move_to_end(part.digest)
        if part.part not in pending.received:
            pending.received[part.part] = part.tensors
            pending.nbytes += frame_bytes
        while len(self._pending) > self.limits.max_pending or \
                self.held_bytes > self.limits.max_plan_bytes and len(self._pending) > 1:
            self._pending.popitem(last=False)  # the oldest half-registered plan goes
        if self.held_bytes > self.limits.max_plan_bytes:
            del self._pending[part.digest]
            self._refuse(part.digest)
            self._error(identity, part.req, "bad_request",
                        f"slice_reg: plan {part.digest} is larger than this publisher holds "
                        f"({self.limits.max_plan_bytes} bytes of plans)")
            return
        if len(pending.received) < pending.parts:
            return
        del self._pending[part.digest]
        try:
            plan = _assemble(part.digest, pending)
        except ProtocolError as exc:
            log.warning("refused a slice plan: %s", exc)
            self._refuse(part.digest)
            self._error(identity, part.req, "bad_request", str(exc))
            return
        self._plans[part.digest] = (plan, len(encode_plan(plan)))
        while len(self._plans) > self.limits.max_plans or \
                self.held_bytes > self.limits.max_plan_bytes and len(self._plans) > 1:
            gone, _ = self._plans.popitem(last=False)
            for key in [k for k in self._entries if k[0] == gone]:
                for waiter, req in self._entries.pop(key).waiters:  # they register again
                    self._error(waiter, req, "unknown_plan",
                                f"slice plan {gone} was dropped here (too many plans)", key[1])
        self._ack(identity, part.req, part.digest, plan)

    def _refuse(self, digest: str) -> None:
        self._refused[digest] = None
        while len(self._refused) > self.limits.max_plans:
            self._refused.popitem(last=False)

    def _ack(self, identity: bytes, req: int, digest: str, plan: SlicePlan) -> None:
        ack = SliceAck(req=req, digest=digest, needed_bytes=plan.needed_bytes)
        self._reply(identity, wire.encode(ack))

    def _entry(self, identity: bytes, req: int, digest: str, publisher_id: str,
               number: int) -> _Entry | None:
        """The (version, plan) entry, built on first use; None after an error reply."""
        held = self._plans.get(digest)
        if held is None:
            self._error(identity, req, "unknown_plan",
                        f"slice plan {digest} is not registered here (register it again)",
                        number)
            return None
        self._plans.move_to_end(digest)
        version = self._store.get(number)
        if version is None or version.failed or publisher_id != self._publisher_id:
            self._error(identity, req, "version_unavailable",
                        f"version {number} of publisher {publisher_id} is not held here "
                        f"(held: {list(self._store.versions())})", number)
            return None
        if version.manifest.shards is not None:
            self._error(identity, req, "bad_request",
                        f"version {number} is served by its trainer ranks (manifest.shards): "
                        "fetch its chunks there", number)
            return None
        key = (digest, number)
        entry = self._entries.get(key)
        if entry is not None and entry.version is not version:
            del self._entries[key]  # a version of the same number from a failed publish
            entry = None
        if entry is None:
            try:
                layout = SliceLayout.build(held[0], version.manifest)
            except ProtocolError as exc:
                self._error(identity, req, "bad_request", str(exc), number)
                return None
            entry = self._entries[key] = _Entry(version, layout)
            self._evict_entries()
        self._entries.move_to_end(key)
        return entry

    def layout_for(self, digest: str, number: int) -> SliceLayout | None:
        """The plan's layout in held version ``number``, for a delta fetch that names the
        plan (``FetchRequest.plan``: ``delta_serving.py`` sends a chunk's slice where its
        delta would not be shorter); None when the plan is not held or does not fit."""
        held = self._plans.get(digest)
        version = self._store.get(number)
        if held is None or version is None or version.failed:
            return None
        key = (digest, number)
        entry = self._entries.get(key)
        if entry is None or entry.version is not version:
            try:
                layout = SliceLayout.build(held[0], version.manifest)
            except ProtocolError:
                return None
            entry = self._entries[key] = _Entry(version, layout)
            self._evict_entries()
        return entry.layout

    def _evict_entries(self) -> None:
        for key, entry in list(self._entries.items()):
            if self._store.get(key[1]) is not entry.version and not entry.waiters:
                del self._entries[key]  # the version is gone: so are its checksums
        while len(self._entries) > self.limits.max_entries:
            key = next(iter(self._entries))
            for identity, req in self._entries.pop(key).waiters:
                self._error(identity, req, "version_unavailable",
                            f"slice checksums of version {key[1]} were dropped (too many "
                            "plans and versions at once); ask again", key[1])

    def _sums(self, identity: bytes, request: SliceSums) -> None:
        entry = self._entry(identity, request.req, request.digest, request.publisher_id,
                            request.version)
        if entry is None:
            return
        self._eager[request.digest] = max(self._eager.get(request.digest, 0), request.version)
        if entry.sums is not None:
            self._sums_reply(identity, request.req, entry, request.digest)
            return
        if len(entry.waiters) < self.limits.max_deferred_per_peer:
            entry.waiters.append((identity, request.req))
        self._start_sums(entry)

    def _start_sums(self, entry: _Entry) -> None:
        if entry.future is not None:
            return
        version = entry.version
        if version.manifest.sums_follow or \
                not all(version.chunk_ready(chunk) for chunk in entry.layout.chunks):
            return  # copy (or early sums) still running: started from ``flush`` once final
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="weightpub-slice-sums")
        entry.future = self._executor.submit(_hash_slices, entry.version, entry.layout)

    def _sums_reply(self, identity: bytes, req: int, entry: _Entry, digest: str) -> None:
        assert entry.sums is not None
        reply = SliceSumsReply(req=req, version=entry.version.manifest.version, digest=digest,
                               sums=entry.sums)
        self._reply(identity, wire.encode(reply))

    def _fetch(self, identity: bytes, request: SliceFetch) -> None:
        entry = self._entry(identity, request.req, request.digest, request.publisher_id,
                            request.version)
        if entry is None:
            return
        sizes = entry.layout.sizes
        if len(request.chunks) > self._max_chunks or any(c not in sizes for c in request.chunks):
            self._error(identity, request.req, "bad_request",
                        "slice_fetch.chunks: a chunk the plan does not touch, or too many in "
                        "one request", request.version)
            return
        if not self._deferred.room(identity, len(request.chunks)):
            self._error(identity, request.req, "bad_request",
                        "too many slice chunks are waiting here; fetch whole chunks",
                        request.version)
            return
        self._deferred.offer(identity, request.req, entry, request.chunks, self._try_send)

    def _try_send(self, identity: bytes, req: int, entry: _Entry, chunk: int) -> bool:
        """Send one chunk's slice if its bytes are final and the peer has room; False:
        try again later."""
        version = entry.version
        number = version.manifest.version
        if version.failed or self._store.get(number) is not version:
            self._error(identity, req, "version_unavailable",
                        f"version {number} is no longer held", number)
            return True
        if not version.chunk_ready(chunk):
            return False
        data = entry.layout.gather(chunk, np.frombuffer(version.view, dtype=np.uint8))
        if not version.intact(chunk):  # a newer snapshot began to overwrite it meanwhile
            self._error(identity, req, "version_unavailable",
                        f"version {number} was overwritten by a newer one", number)
            return True
        header = ChunkHeader(req=req, version=number, chunk=chunk, size=len(data))
        if not self._send(identity, header, data.data, None, True):
            return False
        self.bytes_sent += len(data)
        return True

    def _hash_ahead(self) -> None:
        """A new version: start the checksums of the plans asked for the one before, so a
        sliced subscriber's ``slice_sums`` finds them ready (or nearly)."""
        latest = self._store.latest()
        if latest is None or latest.manifest.version == self._seen_latest:
            return
        previous, number = self._seen_latest, latest.manifest.version
        self._seen_latest = number
        for digest, asked in list(self._eager.items()):
            if digest not in self._plans or asked < previous:
                del self._eager[digest]  # nobody asked for a while: no hashing ahead
                continue
            key = (digest, number)
            if key in self._entries or latest.failed or latest.manifest.shards is not None:
                continue
            try:
                layout = SliceLayout.build(self._plans[digest][0], latest.manifest)
            except ProtocolError:
                continue  # another model now: the subscriber's own request says so
            self._entries[key] = _Entry(latest, layout, eager=True)
            self._evict_entries()

    def flush(self) -> None:
        """Reply the checksums computed by now; send the chunks that have bytes and room."""
        if self._eager:
            self._hash_ahead()
        for digest_version, entry in list(self._entries.items()):
            if entry.future is None:
                if (entry.waiters or entry.eager) and entry.sums is None:
                    self._start_sums(entry)
                continue
            if not entry.future.done():
                continue
            future, entry.future = entry.future, None
            try:
                sums = future.result()
            except Exception as exc:  # never the serving thread's end
                log.warning("slice checksums failed: %s: %s", type(exc).__name__, exc)
                sums = None
            waiters, entry.waiters = entry.waiters, []
            if sums is None:
                self._entries.pop(digest_version, None)
                for identity, req in waiters:
                    self._error(identity, req, "version_unavailable",
                                f"version {digest_version[1]} was overwritten while its slice "
                                "checksums were computed", digest_version[1])
                continue
            entry.sums = sums
            for identity, req in waiters:
                self._sums_reply(identity, req, entry, digest_version[0])
            self.held = self.held_bytes
        self._deferred.flush(self._try_send)


def _hash_slices(version: PublishedVersion, layout: SliceLayout) -> tuple[int, ...] | None:
    """Per touched chunk, xxh3 of the plan's bytes (None if a newer snapshot overwrote any)."""
    manifest = version.manifest
    data = np.frombuffer(version.view, dtype=np.uint8)
    scratch = np.empty(min(manifest.chunk_size, manifest.total_bytes), dtype=np.uint8)
    sums = []
    for chunk in layout.chunks:
        if layout.whole(manifest, chunk):
            sums.append(manifest.checksums[chunk])
        else:
            sums.append(layout.checksum(chunk, data, scratch))
    if not all(version.intact(chunk) for chunk in layout.chunks):
        return None
    return tuple(sums)


def _assemble(digest: str, pending: _Pending) -> SlicePlan:
    """The plan from its parts (a tensor continued across parts is joined), checked by
    every rule of ``slice_plan`` and against ``digest``."""
    tensors: list[SliceRuns] = []
    for index in range(pending.parts):
        for entry in pending.received[index]:
            if tensors and tensors[-1].tensor == entry.tensor:
                tensors[-1] = SliceRuns(entry.tensor, tensors[-1].runs + list(entry.runs))
            else:
                tensors.append(SliceRuns(entry.tensor, list(entry.runs)))
    if len(tensors) > MAX_PLAN_TENSORS:
        raise ProtocolError(f"slice_reg: {len(tensors)} tensors, more than {MAX_PLAN_TENSORS}")
    try:
        plan = SlicePlan(layout=pending.layout, tensors=tensors)
    except (ValueError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"slice_reg: plan {digest}: {exc}") from exc
    if plan.digest() != digest:
        raise ProtocolError(f"slice_reg.digest: the parts make plan {plan.digest()}, not "
                            f"{digest} (a part is missing, repeated or altered)")
    return plan
