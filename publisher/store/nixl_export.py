"""A publisher's snapshot buffers, registered once for one-sided NIXL reads (issue 31).

Why here, at the allocator: a snapshot buffer lives from the pool's ``allocate`` to
its ``free`` and is reused for version after version in between
(``version_store.make_room``), so registering it when it is made and deregistering it
when the pool drops it registers each buffer exactly once, whatever the versions do.
The registered bytes are the pool's (``host_budget_bytes`` already counts them) and
are shown in ``data_stats`` and ``weightpub status``.

The announce then offers the version's bytes where they are: one region, the
snapshot buffer, chunk ``i`` at ``i * chunk_size`` (the flat layout; headers are
not in the buffer, protocol 4 sends them apart). A reader verifies every chunk
against the manifest's checksums, so a chunk read while the copy or a newer
snapshot writes over it is refused there and fetched over ZeroMQ frames. The offer
also names the buffer's claims words (``buffer_claims.py``, registered once per
buffer beside it): a reader whose chunk failed READs them, and a newer version there
means the buffer was reused under its READ (its cause ``reused``, not ``checksum``).

When NIXL does not import or a registration fails, the path is off for this
publisher (a WARNING naming the cause, counted in ``off_reason``): manifests carry
no offer and ZeroMQ frames serve every version, nothing crashes.

A relay (``weightpub.relay``) offers its copy the same way: its pool buffers are
registered once with the relay's own agent. Every version announced without an
offer is counted by cause (``unoffered``, ``UNOFFERED_CAUSES``): the path is off,
the buffer is not registered, or the copy was not complete (a cut-through relay's
version that failed before its last chunk; a publish whose copy ran past the wait).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import numpy
import torch

from publisher.store.buffer_claims import REGION, BufferClaims
from weightpub_wire import protocol as wire
from weightpub_wire.buffers import Allocator, HostAllocator
from weightpub_wire.message_base import MIN_CHUNK_SIZE
from weightpub_wire.nixl_link import NixlClaims, NixlExporter, NixlOffer, NixlRegion, nixl_error

__all__ = ["UNOFFERED_CAUSES", "WORDS_KINDS", "NixlExport", "RegisteringAllocator"]

#: the words registered beside a buffer (``NixlExport.words_refused``): claims words,
#: the readiness map
WORDS_KINDS = ("claims", "ready")
#: why a version went out without a NIXL offer (``NixlExport.unoffered``)
UNOFFERED_CAUSES = (
    "off",  # NIXL does not run here (missing, agent did not start, a registration failed)
    "unregistered",  # the version's bytes are not in a registered buffer
    "copy",  # the copy was not complete (a relayed version failed, a copy ran past the wait)
)

log = logging.getLogger("weightpub.publisher")


class NixlExport:
    """One ``NixlExporter`` per publisher, or the reason there is none."""

    def __init__(self, prefix: str = "weightpub-publisher") -> None:
        self.off_reason = ""  # why the path is off ("" while on)
        self.offers = 0  # manifests that carried an offer
        self.registrations = 0  # buffers registered (each pool buffer once, whatever the versions)
        self.unoffered: dict[str, int] = dict.fromkeys(UNOFFERED_CAUSES, 0)
        self._exporter: NixlExporter | None = None
        self._sizes: dict[int, int] = {}  # address -> bytes registered
        #: buffer address -> its claims words, registered (``offer``), held while registered
        self._words: dict[int, numpy.ndarray] = {}
        #: buffer address -> (the buffer, its readiness words), registered (``ready_words``)
        self._ready: dict[int, tuple[torch.Tensor, numpy.ndarray]] = {}
        #: ("claims" | "ready", buffer address) -> what UCX refused to register words for
        #: (claims words; a buffer), weakly: not tried again until that has changed
        self._refusals: dict[tuple[str, int], weakref.ref[Any]] = {}
        #: words registrations UCX refused, by kind (each buffer's words once)
        self.words_refused: dict[str, int] = {}
        self._lock = threading.Lock()
        error = nixl_error()
        if error is not None:
            self._off(error)
            return
        try:
            self._exporter = NixlExporter(prefix)
        except Exception as exc:  # UCX could not start (no transport, bad UCX_* settings)
            self._off(f"NIXL agent did not start ({type(exc).__name__}: {exc})")

    @property
    def on(self) -> bool:
        return self._exporter is not None and not self.off_reason

    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def _off(self, why: str) -> None:
        if not self.off_reason:
            self.off_reason = why[:1024]
            log.warning("nixl: off for this publisher, versions go over ZeroMQ frames only: "
                        "%s", why)

    def registered(self, buffer: torch.Tensor) -> None:
        """A new snapshot buffer: register the whole allocation once."""
        exporter = self._exporter
        if exporter is None or self.off_reason:
            return
        address, length = buffer.data_ptr(), buffer.numel()
        try:
            exporter.register(address, length)
            self.registrations += 1
        except Exception as exc:  # pinned-memory limits, UCX refusing the range
            self._off(f"registering a {length}-byte snapshot buffer failed "
                      f"({type(exc).__name__}: {exc})")
            return
        with self._lock:
            self._sizes[address] = length

    def freed(self, address: int) -> None:
        """The pool dropped a buffer: deregister it before its memory can go."""
        with self._lock:
            length = self._sizes.pop(address, None)
            words = self._words.pop(address, None)
            ready = self._ready.pop(address, None)
            self._refusals.pop(("claims", address), None)
            self._refusals.pop(("ready", address), None)
        exporter = self._exporter
        if exporter is None:
            return
        # each on its own: one refused deregistration must not leave the others registered
        for what, start, nbytes in (
                ("a snapshot buffer", address, length),
                ("its claims words", *_span(words)),
                ("its readiness map", *_span(None if ready is None else ready[1]))):
            if nbytes is None:
                continue
            try:
                exporter.forget(start, nbytes)
            except Exception as exc:
                log.warning("nixl: deregistering %s at %#x failed: %s", what, start, exc)

    def unoffer(self, cause: str) -> None:
        """Count a version announced without an offer (``UNOFFERED_CAUSES``)."""
        with self._lock:
            self.unoffered[cause] = self.unoffered.get(cause, 0) + 1

    def offer(self, buffer: torch.Tensor, total_bytes: int, *,
              claims: BufferClaims | None = None, version: int = 0,
              ready: numpy.ndarray | None = None, chunk_size: int = 0) -> NixlOffer | None:
        """The version's bytes in ``buffer`` as one region, or None (off, unregistered:
        counted in ``unoffered``). With the buffer's ``claims`` the offer also carries
        their words (registered once per buffer), so a reader tells a buffer reused for a
        newer version under its READ (``reused``) from corrupt bytes (``NixlClaims``).
        With ``ready`` (``ready_words``: a cut-through relay's version offered before its
        copy is complete) it carries the readiness map: chunk ``i``'s bytes are final
        once word ``i`` holds ``version``."""
        exporter = self._exporter
        if total_bytes == 0:
            return None
        if exporter is None or self.off_reason:
            self.unoffer("off")
            return None
        address = buffer.data_ptr()
        with self._lock:
            inside = any(start <= address and address + total_bytes <= start + length
                         for start, length in self._sizes.items())
        if not inside:
            self.unoffer("unregistered")
            return None
        try:
            offer = exporter.offer(
                [NixlRegion(address, total_bytes)],
                claims=self._claims(buffer, claims, version),
                ready=None if ready is None
                else NixlClaims(ready.ctypes.data, ready.nbytes, chunk_size, version))
        except Exception as exc:
            self._off(f"making an offer failed ({type(exc).__name__}: {exc})")
            self.unoffer("off")
            return None
        self.offers += 1
        return offer

    def _claims(self, buffer: torch.Tensor, claims: BufferClaims | None,
                version: int) -> NixlClaims | None:
        """Register ``claims``' words with the buffer (once; again if the pool made a new
        buffer at the same address) and describe them; None without (or when UCX refused
        them: the offer goes without, a torn read is then counted as ``checksum``). A
        refusal is remembered for those words (counted in ``words_refused``, logged
        once): later offers of the buffer go without, no registration is tried again
        until the buffer, and so its words, change."""
        exporter = self._exporter
        if claims is None or exporter is None:
            return None
        base = buffer if buffer._base is None else buffer._base
        key, words = base.data_ptr(), claims.words
        with self._lock:
            held = self._words.get(key)
            refused = self._refusals.get(("claims", key))
        if refused is not None and refused() is words:
            return None
        if held is not words:
            if not self._swap(exporter, held, words, "claims", key,
                              "a buffer's claims failed, its offers go without them"):
                with self._lock:
                    self._words.pop(key, None)
                return None
            with self._lock:
                self._words[key] = words
        return NixlClaims(words.ctypes.data, words.nbytes, REGION, version)

    def ready_words(self, buffer: torch.Tensor) -> numpy.ndarray | None:
        """The buffer's readiness words (int64, one per chunk at the smallest chunk size,
        zero when made), registered once per buffer; None when off or UCX refuses them
        (remembered for the buffer as for claims words: not tried again until the buffer
        changes). A writer stores a version's number in word ``i`` after chunk ``i``'s
        bytes: an older version's number left there reads as not ready."""
        exporter = self._exporter
        if exporter is None or self.off_reason:
            return None
        base = buffer if buffer._base is None else buffer._base
        key = base.data_ptr()
        with self._lock:
            held = self._ready.get(key)
            refused = self._refusals.get(("ready", key))
        if held is not None and held[0] is base:
            return held[1]
        if refused is not None and refused() is base:
            return None
        words = numpy.zeros(max(1, -(-base.numel() // MIN_CHUNK_SIZE)), dtype="<i8")
        if not self._swap(exporter, None if held is None else held[1], words, "ready", key,
                          "a readiness map failed, versions are offered once complete",
                          owner=base):
            with self._lock:
                self._ready.pop(key, None)
            return None
        with self._lock:
            self._ready[key] = (base, words)
        return words

    def _swap(self, exporter: NixlExporter, held: numpy.ndarray | None, words: numpy.ndarray,
              kind: str, key: int, what: str, owner: object = None) -> bool:
        """Register ``words`` in place of ``held`` (deregistered first); False when UCX
        refuses: remembered for ``owner`` (``words`` by default; a weak reference: a new
        buffer, a new try), counted in ``words_refused[kind]``, a WARNING naming ``what``."""
        try:
            if held is not None:
                exporter.forget(held.ctypes.data, held.nbytes)
            exporter.register(words.ctypes.data, words.nbytes)
        except Exception as exc:
            log.warning("nixl: registering %s (not tried again for this buffer): %s", what, exc)
            with self._lock:
                self._refusals[(kind, key)] = weakref.ref(words if owner is None else owner)
                self.words_refused[kind] = self.words_refused.get(kind, 0) + 1
            return False
        with self._lock:
            self._refusals.pop((kind, key), None)
        return True

    def status(self) -> dict[str, object]:
        with self._lock:
            unoffered = {cause: n for cause, n in self.unoffered.items() if n}
            refused = dict(self.words_refused)
        return {"on": self.on, "off_reason": self.off_reason or None,
                "registered_bytes": self.registered_bytes, "offers": self.offers,
                "registrations": self.registrations, "unoffered": unoffered,
                # claims words / readiness maps UCX refused to register (once per buffer):
                # offers went without them
                "words_refused": refused}

    def wire_status(self) -> wire.NixlHolding:
        """``status()`` as a status reply carries it (``weightpub status``)."""
        with self._lock:
            unoffered = tuple((cause, n) for cause, n in self.unoffered.items() if n)
            refused = tuple((kind, n) for kind, n in self.words_refused.items() if n)
        return wire.NixlHolding(on=self.on, registrations=self.registrations,
                                registered_bytes=self.registered_bytes, offers=self.offers,
                                unoffered=unoffered[:16], words_refused=refused[:16])

    def close(self) -> None:
        exporter, self._exporter = self._exporter, None
        with self._lock:
            self._sizes.clear()
            self._words.clear()
            self._ready.clear()
            self._refusals.clear()
        if exporter is not None:
            exporter.close()


class RegisteringAllocator:
    """An ``Allocator`` that tells a ``NixlExport`` of each buffer made and dropped."""

    def __init__(self, export: NixlExport, inner: Allocator | None = None) -> None:
        self._export = export
        self._inner: Allocator = inner or HostAllocator()

    def allocate(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        buffer = self._inner.allocate(nbytes, pinned=pinned)
        self._export.registered(buffer)
        return buffer

    def free(self, key: int) -> None:
        self._export.freed(key)
        self._inner.free(key)


def _span(words: numpy.ndarray | None) -> tuple[int, int | None]:
    """(address, bytes) of registered words; (0, None) without."""
    return (0, None) if words is None else (words.ctypes.data, words.nbytes)
