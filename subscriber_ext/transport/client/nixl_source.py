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

After a transfer error, a timeout or an unreachable offer the source stops taking
chunks for that version (the next version's offer is tried afresh); a chunk that
fails its checksum (a torn read of a buffer being overwritten) is never read over
NIXL again for that version. A version whose chunks all came one-sided is staged
with ``data_path`` "nixl", one with some over ZeroMQ "nixl+zmq".

Memory safety: a READ writes into staging behind the client's back, so no transfer
may be in flight when its buffer changes hands. A chunk goes back to another source
only once its transfer is finished or cancelled, and ``target_dropped`` (the
picker is a ``ChunkListener``, told before the assembly's buffer returns to the
pool) waits for every transfer into it (bounded by ``request_timeout``).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.chunk_source import ChunkSource, Retry, SourceSink
from subscriber_ext.transport.staging.delta_assembly import DeltaAssembly
from subscriber_ext.transport.staging.sparse_assembly import SparseAssembly
from weightpub_wire import protocol as wire
from weightpub_wire.buffers import Allocator, HostAllocator
from weightpub_wire.errors import ProtocolError, TransportError
from weightpub_wire.nixl_link import NixlOffer, NixlReader, NixlTransfer, nixl_error
from weightpub_wire.ratelog import RateLimitedLog

__all__ = ["FALLBACK_CAUSES", "NixlPicker", "NixlSource", "ReadPace", "RegisteringAllocator"]

log = logging.getLogger("weightpub.subscriber")

#: why chunks of a version offered over NIXL came over ZeroMQ frames instead
FALLBACK_CAUSES = (
    "off",  # this subscriber's ``nixl`` option is False
    "missing",  # NIXL does not import here (or its agent did not start)
    "bad_offer",  # the offer does not fit the manifest, or its agent is not who it says
    "unreachable",  # the offer's agent could not be added or a READ could not be posted
    "transfer",  # a READ failed (the holder died, UCX reported an error)
    "timeout",  # a READ was not done within request_timeout
    "checksum",  # a chunk read one-sided failed its checksum (torn or corrupted region)
    "register",  # a staging buffer could not be registered
)
_MAX_CAUSES = 16
_READ_BYTES = 16 << 20  # bytes per READ: large enough to stream, small enough to hand back
_POLL_S = 0.0005  # ``drain``'s poll (closing, dropping a target: not the hot path)


def _base(buffer: torch.Tensor) -> torch.Tensor:
    return buffer if buffer._base is None else buffer._base


class NixlSource(ChunkSource):
    """Reads one version's chunks from its offer; hands back what it cannot read."""

    first = True
    kind = "nixl"  # one-sided reads (its chunks that fall back come as frames, elsewhere)

    def __init__(self, picker: NixlPicker, sink: SourceSink, manifest: wire.Manifest,
                 offer: NixlOffer) -> None:
        self.picker = picker
        self.sink = sink
        self.manifest = manifest
        self.offer = offer
        self.up = True  # False after a failure: the rest of the version goes to ZeroMQ
        self.refused_chunks: set[int] = set()  # failed their checksum once: ZeroMQ's
        self.verified = 0  # chunks of this version verified in place
        # req -> (transfer, chunks, target, started)
        self.pending: dict[int, tuple[NixlTransfer, list[int], Assembly, float]] = {}
        self.pace = ReadPace(picker.rate)

    @property
    def label(self) -> str:
        return "nixl"

    def _in_flight(self) -> int:
        return sum(len(chunks) for _, chunks, _, _ in self.pending.values())

    def ahead(self) -> int:
        if not self.up:
            return 0
        window = max(1, self.picker.window_bytes // self.manifest.chunk_size)
        return max(0, min(window, wire.MAX_CHUNKS_IN_FLIGHT) - self._in_flight())

    def ask(self, target: Assembly, chunks: Sequence[int], now: float) -> list[int]:
        if not self.up or target.manifest is not self.manifest \
                or isinstance(target, DeltaAssembly) or target.fetch_base:
            return list(chunks)
        sparse = target if isinstance(target, SparseAssembly) else None
        # while up it takes every chunk it is offered (the serving sources get none), up
        # to twice the client's window in flight; a slice target's only once it can be
        # verified in place (its sums are here, or the plan covers the chunk whole)
        room = self.ahead() + max(1, self.picker.window_bytes // self.manifest.chunk_size)
        take = [c for c in chunks if c not in self.refused_chunks
                and (sparse is None or sparse.readable_in_place(c))][:room]
        if not take:
            return list(chunks)
        taken = set(take)
        rest = [c for c in chunks if c not in taken]
        reader = self.picker.reader
        base = _base(target.buffer)
        try:
            self.picker.register(base, sparse=sparse is not None)
        except Exception as exc:
            self.fall_back("register", f"registering {base.numel()} bytes of staging: {exc}")
            return list(chunks)
        address = target.buffer.data_ptr()
        assert reader is not None
        for batch, spans in self._batches(take, sparse):
            pieces = [(0, start, address + start, size) for start, size in spans]
            try:
                transfer = reader.start(self.offer, pieces)
            except ProtocolError as exc:
                self.fall_back("bad_offer", str(exc))
            except TransportError as exc:
                self.fall_back("unreachable", str(exc))
            else:
                if transfer is None:
                    continue
                req = self.sink.requests.next_id()
                self.sink.requests.track(req, batch, now, source=self)
                self.pending[req] = (transfer, batch, target, now)
                self.pace.posted(req, transfer.nbytes, now)
                self.picker.bytes_asked += transfer.nbytes
                continue
            rest += [c for c in take if c in taken and not self._asked(c)]
            break
        return rest

    def _asked(self, chunk: int) -> bool:
        return any(chunk in chunks for _, chunks, _, _ in self.pending.values())

    def _batches(self, chunks: list[int], sparse: SparseAssembly | None
                 ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Chunks grouped into READs of about ``_READ_BYTES``, each with its byte ranges
        (a whole chunk, or a slice target's planned ranges of it)."""
        out: list[tuple[list[int], list[tuple[int, int]]]] = []
        size = _READ_BYTES
        for chunk in chunks:
            spans = [self.manifest.chunk_span(chunk)] if sparse is None \
                else sparse.read_pieces(chunk)
            nbytes = sum(n for _, n in spans)
            if not out or size + nbytes > _READ_BYTES:
                out.append(([], []))
                size = 0
            out[-1][0].append(chunk)
            out[-1][1].extend(spans)
            size += nbytes
        return out

    def tick(self, now: float) -> float:
        """Verify the chunks of every READ that is done (in posting order: NIXL moves them
        in that order, so the first one not done ends the pass); return when the next one
        is due (``ReadPace``: its bytes at the measured rate, then backing off)."""
        reader = self.picker.reader
        if reader is None:
            return float("inf")
        for req, (transfer, chunks, target, _) in list(self.pending.items()):
            if req not in self.pending:
                continue  # drained meanwhile: the target was given up or dropped
            try:
                done = reader.poll(transfer)
            except TransportError as exc:
                self._end(req, give_back=True)
                self.fall_back("transfer", str(exc))
                continue
            if not done:
                break
            self._end(req, give_back=False)
            self.pace.done(req, transfer.nbytes)
            self.picker.bytes_read += transfer.nbytes
            needed = len(target.layout.chunks) if isinstance(target, SparseAssembly) \
                else self.manifest.num_chunks
            for chunk in chunks:
                # said before the chunk verifies: the last one stages the version at once
                last = self.verified + 1 == needed
                target.data_path = "nixl" if last else "nixl+zmq"
                if self.sink.in_place(req, target.fetch_version, chunk, self, self):
                    self.verified += 1
                else:
                    target.data_path = "nixl+zmq" if self.verified else "zmq"
        now = time.monotonic()
        self.pace.measure(now)
        if not self.pending:
            self.pace.idle()
            return float("inf")
        return self.pace.wait(now)

    def _end(self, req: int, *, give_back: bool) -> bool:
        """Release a transfer; ``give_back``: its chunks go back to the serving sources
        (only once NIXL let go of it: a READ still in flight would land on their bytes)."""
        transfer, _, _, _ = self.pending.pop(req)
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
        limit = self.picker.request_timeout
        for req, (_, _, _, started) in list(self.pending.items()):
            if req in self.pending and now - started >= limit:
                self._end(req, give_back=True)
                self.fall_back("timeout", f"a READ of version {self.manifest.version} was "
                                          f"not done after {limit:.1f} s")
        return False

    def refused(self, via: Any, chunk: int, why: str, now: float) -> bool:
        self.refused_chunks.add(chunk)
        self.picker.count("checksum", why, version=self.manifest.version, once=False)
        return True  # not a try: the chunk goes to the serving sources

    def fall_back(self, cause: str, why: str) -> None:
        """Stop reading this version one-sided; its remaining chunks go to ZeroMQ."""
        if self.up:
            self.up = False
            self.picker.count(cause, why, version=self.manifest.version)

    def drain(self, timeout: float) -> None:
        """Wait (bounded) for every READ in flight, then release them all."""
        reader = self.picker.reader
        deadline = time.monotonic() + timeout
        for req in list(self.pending):
            if req not in self.pending:
                continue
            transfer = self.pending[req][0]
            while reader is not None and time.monotonic() < deadline:
                try:
                    if reader.poll(transfer):
                        break
                except TransportError:
                    break
                time.sleep(_POLL_S)
            self._end(req, give_back=True)

    def close(self) -> None:
        self.drain(self.picker.request_timeout)


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
        self.last_error: str | None = None
        self.bytes_asked = 0
        self.bytes_read = 0
        self.rate = [ReadPace.FIRST_RATE]  # READ bytes/s measured so far (``ReadPace``)
        self._source: NixlSource | None = None
        self._sizes: dict[int, int] = {}  # staging base address -> bytes registered
        self._gone: list[int] = []  # sparse staging bases dropped, to deregister
        self._unavailable: str | None = None
        self._checked = False  # NIXL imported (seconds) only once a manifest offers it
        self._warn = RateLimitedLog(log)

    # -- the picker --------------------------------------------------------------------------
    def __call__(self, manifest: wire.Manifest, sink: SourceSink) -> list[ChunkSource] | None:
        offer = manifest.nixl
        if offer is None or manifest.num_chunks == 0:
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
        if manifest.shards is not None or manifest.adapters is not None:
            return None  # each rank's own buffer (not offered yet); adapters are small
        if len(offer.regions) != 1 or offer.regions[0].length < manifest.total_bytes:
            self.count("bad_offer", f"the offer's regions {list(offer.regions)[:4]} do not "
                       f"hold the version's {manifest.total_bytes} bytes",
                       version=manifest.version)
            return None
        if not self._checked:
            self._checked = True
            self._unavailable = nixl_error()
            if self._unavailable is not None and self.mode:
                log.warning("nixl: asked for but %s", self._unavailable)
        if self._unavailable is None and self.reader is None:
            try:
                self.reader = NixlReader("weightpub-subscriber")
            except Exception as exc:
                self._unavailable = f"NIXL agent did not start ({type(exc).__name__}: {exc})"
        if self._unavailable is not None:
            self.count("missing", self._unavailable, version=manifest.version)
            return None
        self._source = NixlSource(self, sink, manifest, offer)
        return [self._source]

    def count(self, cause: str, why: str, *, version: int, once: bool = True) -> None:
        """One more fallback of ``cause`` (a version, or a chunk for ``checksum``)."""
        if cause in self.fallback_causes or len(self.fallback_causes) < _MAX_CAUSES:
            self.fallback_causes[cause] = self.fallback_causes.get(cause, 0) + 1
        self.last_error = f"version {version}: {why} ({cause})"[:1024]
        if cause != "off":
            self._warn.warning(f"nixl:{cause}", f"nixl: {self.last_error}; fetching over "
                                                "ZeroMQ frames")

    @property
    def fallbacks(self) -> int:
        return sum(self.fallback_causes.values())

    # -- staging buffers -----------------------------------------------------------------------
    def register(self, base: torch.Tensor, *, sparse: bool = False) -> None:
        """Register a pooled staging buffer's whole allocation once. ``sparse``: a slice
        target's anonymous buffer, which the pool never frees through the allocator
        (it goes with its last view): deregistered once that base tensor has gone
        (noted by whichever thread drops it, done here on the client's: the agent
        is not thread-safe), before anything new is registered at its address."""
        assert self.reader is not None
        while self._gone:
            self.freed(self._gone.pop())
        address, length = base.data_ptr(), base.numel()
        if not self.reader.registered(address, length):
            self.reader.register(address, length)
            self._sizes[address] = length
            if sparse:
                weakref.finalize(base, self._gone.append, address)

    def freed(self, address: int) -> None:
        """The pool dropped a staging buffer: deregister it."""
        length = self._sizes.pop(address, None)
        if length is not None and self.reader is not None:
            try:
                self.reader.forget_local(address, length)
            except Exception as exc:
                log.warning("nixl: deregistering a staging buffer failed: %s", exc)

    def allocator(self, inner: Allocator | None) -> Allocator:
        return RegisteringAllocator(self, inner)

    # -- a ChunkListener: no READ may outlive its assembly's buffer ----------------------------
    def target_started(self, manifest: wire.Manifest) -> None:
        return None

    def chunk_verified(self, manifest: wire.Manifest, chunk: int, data: memoryview) -> None:
        return None

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
            "registered_bytes": 0 if self.reader is None else self.reader.registered_bytes,
            "bytes_read": self.bytes_read,
            "fallbacks": self.fallbacks,
            "fallback_causes": dict(self.fallback_causes),
            "last_error": self.last_error,
        }

    def close(self) -> None:
        source, self._source = self._source, None
        if source is not None:
            source.close()
        reader, self.reader = self.reader, None
        self._sizes.clear()
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

