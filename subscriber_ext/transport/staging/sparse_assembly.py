"""A version staged sparsely: only the bytes of one slice plan, in a full-size buffer.

Why full size: the consumer (a vLLM rank's loaders) reads the published tensors by
name and shape exactly as from a whole version (``StagedVersion.tensors``), and the
bytes it reads are exactly the plan's. The buffer is anonymous memory
(``BufferPool.take_sparse``): pages the plan never writes cost nothing and read as
zeros (a buffer is reused only for the same plan in the same layout, which writes the
same bytes again: no page faults after the first version); the staging budget counts
the pages the plan touches (``SliceLayout.resident_bytes``), not the version.

What is missing is the chunks the plan touches (a chunk it does not touch is never
asked). A chunk arrives in one of two forms, told apart by its size: the plan's bytes
of that chunk gathered back to back (a ``slice_fetch`` reply), checked against the
publisher's ``slice_sums`` for this plan and version; or the whole chunk (a fallback:
a publisher without slices, a trainer rank of a sharded version), checked against
the manifest's chunk checksum. Either way the digest is taken of the bytes as they
came, and only the planned bytes are written into place: a version is staged only
when every touched chunk verified, as for a whole version. A staged one is the delta
base of the next version (``sparse_delta.py`` rebuilds only the planned bytes).

A one-sided reader (NIXL, ``client/nixl_source.py``) READs the planned byte ranges
(``read_pieces``) straight to where they belong, the same offsets in the holder's
flat buffer and in this one; ``verify`` then hashes them there, gathered back to
back as the publisher hashed them for ``slice_sums`` (or the whole chunk against
the manifest where the plan covers it): the same check as a ZeroMQ slice reply.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import xxhash

from subscriber_ext.transport.staging.assembly import Assembly, StagedVersion
from weightpub_wire.buffers import BufferPool, byte_view
from weightpub_wire.chunk_order import priority_chunks
from weightpub_wire.protocol import Manifest
from weightpub_wire.slice_layout import SliceLayout

__all__ = ["SparseAssembly"]


class SparseAssembly(Assembly):
    """A version being received as one plan's slices (module text)."""

    def __init__(self, manifest: Manifest, pool: BufferPool, layout: SliceLayout,
                 digest: str, on_bytes: Callable[[bool, int], None] | None = None) -> None:
        """``on_bytes(whole, nbytes)``: each reply's payload, by form (for status)."""
        # not Assembly.__init__: the buffer is sparse and only touched chunks are missing
        self.manifest = manifest
        self.pool = pool
        self.layout = layout
        self.digest = digest  # the plan's, named in every slice request
        self.plan = digest  # a delta base of this plan once staged (``sparse_delta.py``)
        # reused for the same plan in the same layout: only planned bytes were ever written
        reuse = (digest, manifest.total_bytes, manifest.chunk_size,
                 tuple((t.name, t.offset) for t in manifest.tensors))
        self.buffer = pool.take_sparse(manifest.total_bytes, layout.resident_bytes, reuse)
        self.view = byte_view(self.buffer, manifest.total_bytes)
        self._array = np.frombuffer(self.view, dtype=np.uint8) if manifest.total_bytes \
            else np.empty(0, dtype=np.uint8)
        self.missing: set[int] = set(layout.chunks)
        touched = set(layout.chunks)
        self.order = [chunk for chunk in priority_chunks(manifest) if chunk in touched]
        self.cursor = 0
        self.started = time.monotonic()
        self.fetch_version = manifest.version
        self.fetch_base = 0  # the version's own bytes (deltas: ``sparse_delta.py``)
        self.data_path = "slices"
        self.attempt = 0
        self.received_by: dict[str, int] = {}
        self.awaiting = {}  # never: a sliced target waits for the complete manifest
        #: per touched chunk, xxh3 of its planned bytes (``slice_sums``); None: not yet
        self.sums: dict[int, int] | None = None
        #: the chunks still come whole (the cause, for status); None: as slices
        self.whole_cause: str | None = None
        self._whole: set[int] = set()  # chunks placed from a whole-chunk reply
        self._on_bytes = on_bytes

    @property
    def done_fraction(self) -> float:
        total = len(self.layout.chunks)
        return 1.0 if total == 0 else 1.0 - len(self.missing) / total

    def set_sums(self, sums: tuple[int, ...], chunks: tuple[int, ...] | None = None) -> None:
        """The sums of ``chunks`` (default: every touched chunk), added to those held (a
        sharded version's come from each trainer rank for its own chunks)."""
        given = dict(zip(self.layout.chunks if chunks is None else chunks, sums, strict=True))
        self.sums = given if self.sums is None else {**self.sums, **given}

    def has_sums(self, chunks: tuple[int, ...]) -> bool:
        """Whether the sums of every one of ``chunks`` are in."""
        held = self.sums
        return held is not None and all(chunk in held for chunk in chunks)

    def chunk_target(self, chunk: int) -> memoryview:
        start, size = self.manifest.chunk_span(chunk)
        return self.view[start: start + size]

    def accepts(self, chunk: int, size: int) -> bool:
        planned = self.layout.sizes.get(chunk)
        return planned is not None and size in (planned, self.manifest.chunk_span(chunk)[1])

    def place(self, chunk: int, payload: memoryview) -> int | None:
        """Hash the reply as it came, then write its planned bytes into place."""
        digest = xxhash.xxh3_64_intdigest(payload)
        data = np.frombuffer(payload, dtype=np.uint8)
        start, span = self.manifest.chunk_span(chunk)
        whole = len(payload) == span
        if whole and self.layout.sizes[chunk] != span:
            self.layout.scatter(chunk, data, self._array, chunk_start=start)
            self._whole.add(chunk)
        else:
            self.layout.scatter(chunk, data, self._array)
            self._whole.discard(chunk)
        if self._on_bytes is not None:
            self._on_bytes(chunk in self._whole, len(payload))
        return digest

    def verify(self, chunk: int, size: int | None = None, digest: int | None = None) -> bool:
        """``digest`` None: the planned bytes were read into place (``read_pieces``)."""
        if digest is None:
            if not self.readable_in_place(chunk):
                return False
            self._whole.discard(chunk)
            if self.layout.whole(self.manifest, chunk):
                digest = xxhash.xxh3_64_intdigest(self.chunk_target(chunk))
            else:
                digest = xxhash.xxh3_64_intdigest(self.layout.gather(chunk, self._array).data)
            if self._on_bytes is not None:
                self._on_bytes(False, self.layout.sizes[chunk])
        if chunk in self._whole or self.layout.whole(self.manifest, chunk):
            expected: int | None = self.manifest.checksums[chunk]
        else:
            expected = None if self.sums is None else self.sums.get(chunk)
        ok = digest == expected
        if ok:
            self.missing.discard(chunk)
        return ok

    def readable_in_place(self, chunk: int) -> bool:
        """Whether ``chunk``'s planned bytes, read into place, can be verified: the plan
        covers it whole (the manifest's checksum), or its slice sum is here."""
        return self.layout.whole(self.manifest, chunk) or (
            self.sums is not None and chunk in self.sums)

    def read_pieces(self, chunk: int) -> list[tuple[int, int]]:
        """The planned byte ranges of ``chunk`` as ``(flat offset, length)``, rows that
        touch merged (a column slice is one piece per row, a whole tensor one piece)."""
        if self.layout.whole(self.manifest, chunk):
            return [self.manifest.chunk_span(chunk)]
        pieces: list[tuple[int, int]] = []
        for start, length, stride, count in self.layout.blocks[chunk]:
            if stride == length or count == 1:
                rows = [(start, length * count)]
            else:
                rows = [(start + i * stride, length) for i in range(count)]
            for offset, size in rows:
                if pieces and pieces[-1][0] + pieces[-1][1] == offset:
                    pieces[-1] = (pieces[-1][0], pieces[-1][1] + size)
                else:
                    pieces.append((offset, size))
        return pieces

    def slice_targets(self, chunk: int) -> list[memoryview]:
        """Where the planned bytes of ``chunk`` go, as views of this buffer in the order
        the publisher gathers them (a stream's scatter read lands them there; ``verify``
        with the digest taken as they landed, checked against the slice sum)."""
        self._whole.discard(chunk)
        return [self.view[offset: offset + size] for offset, size in self.read_pieces(chunk)]

    def count_slice(self, nbytes: int) -> None:
        """A slice's bytes landed in place (for status, as ``place`` counts a reply's)."""
        if self._on_bytes is not None:
            self._on_bytes(False, nbytes)

    def in_place_bytes(self, chunk: int) -> int:
        return self.layout.sizes[chunk]

    def abandon(self) -> None:
        self._array = np.empty(0, dtype=np.uint8)
        super().abandon()

    def finish(self) -> StagedVersion:
        self._array = np.empty(0, dtype=np.uint8)
        return super().finish()
