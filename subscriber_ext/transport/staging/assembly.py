"""Staging: where a version's bytes land, are checked, and become usable tensors.

A version is received straight into one preallocated flat buffer laid out as
its manifest says, chunk by chunk (each one-frame reply's payload copied once,
from ZeroMQ's message into place: no intermediate buffer). Only
when every chunk has matched its checksum does it become a ``StagedVersion``,
whose tensors are zero-copy views into that buffer.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from weightpub_wire.buffers import BufferPool, byte_view
from weightpub_wire.checksums import chunk_checksum, copy_checksum
from weightpub_wire.chunk_order import priority_chunks
from weightpub_wire.dtypes import dtype_from_name
from weightpub_wire.errors import WeightPubError
from weightpub_wire.protocol import Manifest

__all__ = ["Assembly", "DeltaStart", "HeldBase", "SharedView", "StagedVersion", "TargetMaker",
           "tensor_views"]

_RELEASED = torch.empty(0, dtype=torch.uint8)


def tensor_views(manifest: Manifest, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every tensor of ``manifest`` as a zero-copy view into its flat ``buffer``."""
    if buffer.numel() < manifest.total_bytes:
        raise ValueError(f"buffer of {buffer.numel()} bytes is smaller than version "
                         f"{manifest.version} ({manifest.total_bytes} bytes)")
    tensors: dict[str, torch.Tensor] = {}
    for entry in manifest.tensors:
        raw = buffer[entry.offset: entry.offset + entry.nbytes]
        tensors[entry.name] = raw.view(dtype_from_name(entry.dtype)).view(entry.shape)
    return tensors


@dataclass(slots=True, weakref_slot=True)
class StagedVersion:
    """A complete, verified version. ``tensors`` are views into one host buffer.

    Call ``release()`` once the tensors are applied or copied: the buffer is
    then reused for a later version, so the views must not be used after it.
    A version dropped without ``release()`` stops counting against the staging
    budget when it is garbage-collected (its buffer is then never reused).
    """

    manifest: Manifest
    buffer: torch.Tensor
    tensors: dict[str, torch.Tensor]
    received_at: float
    fetch_seconds: float
    data_path: str = "zmq"  # how the bytes came: "zmq", "gloo", "nccl", "cuda_ipc"
    attempt: int = 0  # the reception it came from (``progress.PartialVersion.attempt``)
    _pool: BufferPool | None = field(default=None, repr=False)
    _released: bool = field(default=False, repr=False)
    _holds: int = field(default=1, repr=False)  # release() plus each retain()
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _finalizer: weakref.finalize | None = field(default=None, repr=False)

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def publisher_id(self) -> str:
        return self.manifest.publisher_id

    @property
    def total_bytes(self) -> int:
        return self.manifest.total_bytes

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.tensors.items())

    def release(self) -> None:
        """Give the buffer back for reuse (once no ``retain`` holds it either); idempotent."""
        if self._released:
            return
        self._released = True
        self.tensors = {}
        self._let_go()

    def retain(self) -> Callable[[], None]:
        """Keep the bytes beyond ``release()`` (a delta base); call the result to let go."""
        with self._lock:
            self._holds += 1
        done = threading.Event()

        def let_go() -> None:
            if not done.is_set():
                done.set()
                self._let_go()

        return let_go

    def _let_go(self) -> None:
        with self._lock:
            self._holds -= 1
            last = self._holds == 0
        if not last:
            return
        buffer, self.buffer = self.buffer, _RELEASED  # kept alive by nobody but the pool
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._pool is not None:
            self._pool.give(buffer)


@dataclass(slots=True)
class HeldBase:
    """The version deltas can start from: its manifest, digest and bytes (kept by a hold).

    ``plan``: the digest of the slice plan whose bytes alone it holds (a sliced
    subscriber's sparse version, ``sparse_delta.py``); None: every byte of the version."""

    manifest: Manifest
    digest: int
    buffer: torch.Tensor
    view: memoryview
    let_go: Callable[[], None]
    plan: str | None = None

    @property
    def version(self) -> int:
        return self.manifest.version


@dataclass(frozen=True, slots=True)
class DeltaStart:
    """What a version's deltas can start from here (``DeltaState.start_for``): the held
    base and the steps ``(version, its base)`` from it, or why not (``base`` None)."""

    base: HeldBase | None = None
    steps: tuple[tuple[int, int], ...] = ()
    #: None: a delta can start (or the manifest offers none); else why not: "refused"
    #: (this version's delta failed here already), "no_base" (no base held, or the one
    #: held is not in the chain, or of another layout or plan)
    why: str | None = None


class Assembly:
    """A version being received: its buffer and which chunks are still missing."""

    #: the slice plan whose bytes alone it receives (``sparse_assembly.py``); None: all
    plan: str | None = None
    #: ``manifest.sums_follow``: each chunk's sum as it came over the ROUTER (None: not
    #: yet; set in ``__init__``), how far the publisher's run of sums is in
    #: (``sum_messages``: the next ``have``), and how many sums are known
    early_sums: list[int | None] | None = None
    early_have = 0
    early_known = 0
    #: why a delta step refused a chunk, and the CPU its decoding took (delta targets)
    error: WeightPubError | None = None
    decode_seconds: float = 0.0

    def __init__(self, manifest: Manifest, pool: BufferPool) -> None:
        self.manifest = manifest
        self.pool = pool
        self.buffer = pool.take(manifest.total_bytes)
        self.view = byte_view(self.buffer, manifest.total_bytes)
        self.missing: set[int] = set(range(manifest.num_chunks))
        self.order = priority_chunks(manifest)  # fetch order: the largest tensors first
        self.cursor = 0  # every chunk of ``order`` before it is verified
        self.started = time.monotonic()
        self.fetch_version = manifest.version  # what FetchRequests name (deltas: each step)
        self.fetch_base = 0  # FetchRequest.base: 0 = the version's own bytes
        self.data_path = "zmq"  # a collective round sets its backend
        self.attempt = 0  # this reception (``progress.ProgressFeed`` numbers it)
        #: payload bytes that arrived for this version, by source kind (``SOURCE_KINDS``)
        self.received_by: dict[str, int] = {}
        self.early_sums = [None] * manifest.num_chunks if manifest.sums_follow else None
        #: chunks whose bytes landed before their sum: chunk -> (digest, size, source, via)
        self.awaiting: dict[int, tuple[int, int, Any, Any]] = {}

    @property
    def done(self) -> bool:
        """Every chunk verified: none missing, none waiting for its sum."""
        return not self.missing and not self.awaiting

    def has_verified(self, chunk: int) -> bool:
        """Whether ``chunk``'s bytes are in place and matched their checksum."""
        return chunk not in self.missing and chunk not in self.awaiting

    def sum_known(self, chunk: int) -> bool:
        """Whether ``chunk`` can be verified now (its sum came, or was in the manifest)."""
        return self.early_sums is None or self.early_sums[chunk] is not None

    def learn_sum(self, chunk: int, value: int) -> bool:
        """Record a sum that followed the manifest; False if the chunk had another one."""
        assert self.early_sums is not None
        known = self.early_sums[chunk]
        if known is None:
            self.early_sums[chunk] = value
            self.early_known += 1
            return True
        return known == value

    @property
    def sums_in(self) -> bool:
        """Every chunk's sum is known (always, unless the manifest's sums follow)."""
        return self.early_sums is None or self.early_known == len(self.early_sums)

    def hold(self, chunk: int, digest: int, size: int, source: Any, via: Any) -> None:
        """A chunk's bytes landed before its sum: neither missing nor verified until it
        comes (``ChunkReceiver.sums_arrived``)."""
        self.missing.discard(chunk)
        self.awaiting[chunk] = (digest, size, source, via)

    def unhold(self, chunk: int) -> None:
        """A held chunk failed its sum: missing again (fetched anew)."""
        self.missing.add(chunk)
        self.cursor = 0  # ``next_chunks`` looks from the start once

    def count_received(self, kind: str, nbytes: int) -> None:
        """``nbytes`` of this version arrived from a source of ``kind`` (status, reports)."""
        self.received_by[kind] = self.received_by.get(kind, 0) + nbytes

    @property
    def done_fraction(self) -> float:
        total = self.manifest.num_chunks
        return 1.0 if total == 0 else 1.0 - len(self.missing) / total

    def chunk_target(self, chunk: int) -> memoryview:
        start, size = self.manifest.chunk_span(chunk)
        return self.view[start: start + size]

    def next_chunks(self, asked: set[int], limit: int) -> list[int]:
        """Up to ``limit`` missing chunks not in ``asked``, in fetch order.

        Costs about the chunks in flight plus ``limit``, not the whole version.
        """
        order, missing = self.order, self.missing
        index = self.cursor
        while index < len(order) and order[index] not in missing:
            index += 1
        self.cursor = index
        out: list[int] = []
        while index < len(order) and len(out) < limit:
            chunk = order[index]
            if chunk in missing and chunk not in asked:
                out.append(chunk)
            index += 1
        return out

    def accepts(self, chunk: int, size: int) -> bool:
        """Whether a chunk reply of ``size`` bytes can be what was asked for."""
        return size == self.manifest.chunk_span(chunk)[1]

    def place(self, chunk: int, payload: memoryview) -> int | None:
        """Copy a received chunk's bytes into place; their checksum when it was taken in
        the same pass (``verify`` then needs no second sweep), else None."""
        return copy_checksum(self.chunk_target(chunk)[: len(payload)], payload)

    def verify(self, chunk: int, size: int | None = None, digest: int | None = None) -> bool:
        """Check a received chunk against the manifest; mark it done when it matches.
        ``digest``: the checksum ``place`` took of the bytes in place."""
        if digest is None:
            digest = chunk_checksum(self.chunk_target(chunk))
        expected = self.manifest.checksums[chunk] if self.early_sums is None \
            else self.early_sums[chunk]
        ok = digest == expected
        if ok:
            self.missing.discard(chunk)
        return ok

    def in_place_bytes(self, chunk: int) -> int:
        """The bytes of ``chunk`` a one-sided read writes into place (the whole chunk)."""
        return self.manifest.chunk_span(chunk)[1]

    def abandon(self) -> None:
        self.view.release()
        self.pool.give(self.buffer)

    def finish(self) -> StagedVersion:
        if self.early_sums is not None:  # staged under the complete manifest: every sum
            self.manifest = self.manifest.with_sums(tuple(v or 0 for v in self.early_sums))
        self.view.release()
        tensors = tensor_views(self.manifest, self.buffer)
        staged = StagedVersion(manifest=self.manifest, buffer=self.buffer, tensors=tensors,
                               received_at=time.time(),
                               fetch_seconds=time.monotonic() - self.started,
                               data_path=self.data_path, attempt=self.attempt,
                               _pool=self.pool)
        staged._finalizer = weakref.finalize(staged, self.pool.forget, self.buffer.data_ptr())
        return staged


class TargetMaker(Protocol):
    """Makes a client's targets of another kind (``SyncClient(targets=...)``): a slice
    plan's sparse ones (``sparse_assembly.py``)."""

    def staged_bytes(self, manifest: Manifest) -> int:
        """What staging ``manifest`` costs against the staging budget."""
        ...

    @property
    def delta_plan(self) -> str | None:
        """The slice plan whose staged versions its later targets rebuild from as delta
        bases (``sparse_delta.py``); None: it keeps no delta base."""
        ...

    def assembly(self, manifest: Manifest, pool: BufferPool, start: DeltaStart) -> Assembly:
        """The target for ``manifest`` (``ProtocolError``: it cannot be staged here);
        ``start``: what a delta could start from (``DeltaState.start_for``)."""
        ...


class SharedView:
    """One local rank's hold on a version staged once per node (``node_staging.py``).

    Same surface as ``StagedVersion`` for a consumer (``manifest``, ``version``,
    ``publisher_id``, ``tensors``, ``total_bytes``, ``release``); the buffer behind ``tensors`` is
    shared with the node's other ranks and reused only after every rank released it.
    """

    __slots__ = ("_on_release", "attempt", "data_path", "fetch_seconds", "manifest",
                 "publisher_id", "tensors", "total_bytes", "version")

    def __init__(self, manifest: Manifest, tensors: dict[str, torch.Tensor],
                 on_release: Callable[[], None], fetch_seconds: float | None = None,
                 data_path: str = "zmq", attempt: int = 0) -> None:
        self.manifest = manifest  # e.g. ``adapters``: a version of LoRA adapters
        self.version = manifest.version
        self.data_path = data_path  # how the node received it
        self.attempt = attempt  # the node owner's reception (matches its partials)
        self.fetch_seconds = fetch_seconds  # how long the node took to receive it
        self.publisher_id = manifest.publisher_id
        self.total_bytes = manifest.total_bytes
        self.tensors = tensors
        self._on_release: Callable[[], None] | None = on_release

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.tensors.items())

    def release(self) -> None:
        """Drop this rank's views and tell the owner; idempotent."""
        on_release, self._on_release = self._on_release, None
        self.tensors = {}
        if on_release is not None:
            on_release()
