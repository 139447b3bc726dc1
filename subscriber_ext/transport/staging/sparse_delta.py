"""A sliced version rebuilt from deltas: only one plan's bytes, from the sparse base held.

Why it works with only the planned bytes of the base: every delta encoding is
byte-local (``weightpub_wire.delta_codec``): RAW carries the chunk's bytes, SAME
copies the base, XOR_ZSTD and SPARSE XOR new bytes onto the base's at the same
offsets. So a whole-chunk delta payload (tiny between RL steps) decoded over a base
that is right on the planned ranges and anything elsewhere is right on the planned
ranges; the rest is garbage and never kept. Each payload is decoded into a scratch
chunk and only its planned bytes are scattered into the sparse staging buffer
(``SliceLayout.scatter``), so staging still touches only the plan's pages. The fetch
names the plan (``FetchRequest.plan``): where a chunk's delta would not be shorter than
the plan's bytes of it, the publisher sends those bytes instead, told apart by their
size (exactly the planned size; a delta payload it sends is shorter), and they are
scattered as they came.

Steps: the first reads the held base (a ``SparseAssembly`` staged under the same plan,
``HeldBase.plan``), each later one (a subscriber that missed versions of the chain)
the planned bytes the previous step wrote. After the last step each touched chunk's
planned bytes are checked against the version's ``slice_sums`` (or the manifest's
checksum where the plan covers the chunk whole), the same check raw slices get; a
chunk that does not decode or does not match, or a chunk with no sum to check it
against, fails the delta (``cause``): the client fetches that version as raw slices
(``SyncClient._delta_failed``), so a wrong byte is never staged.

Bytes: so each chunk costs the smaller of its delta and its slice. A publisher that
does not know the plan (one before this, or the plan evicted) sends whole-chunk
payloads only, and a chunk it sent raw, or a plan touching chunks thinly, costs more
than the slice: such a delta is given up for raw slices once it has cost
``LOSS_SLACK_CHUNKS`` chunks more than they would (``too_big``), so the loss is
bounded by that and what was in flight. (A delta payload of exactly the planned size
from such a publisher is read as a slice, fails the check, and falls back too.)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import xxhash

from subscriber_ext.transport.staging.assembly import HeldBase
from subscriber_ext.transport.staging.delta_assembly import DeltaRebuild
from subscriber_ext.transport.staging.sparse_assembly import SparseAssembly
from weightpub_wire.buffers import BufferPool
from weightpub_wire.errors import ChecksumError, WeightPubError
from weightpub_wire.protocol import Manifest
from weightpub_wire.slice_layout import SliceLayout

__all__ = ["LOSS_SLACK_CHUNKS", "SparseDeltaAssembly"]

#: a delta that has cost this many chunks more than the raw slices of the same chunks
#: is given up for raw slices (``too_big``): whole-chunk payloads of chunks the plan
#: touches thinly, or chunks the encoder sent raw (the delta did not pay), can cost up
#: to the chunk over the plan's share of it
LOSS_SLACK_CHUNKS = 2


class SparseDeltaAssembly(DeltaRebuild, SparseAssembly):
    """One plan's bytes of a version rebuilt from ``base`` through ``steps`` (module text;
    the skeleton is ``DeltaRebuild``'s, the staging buffer ``SparseAssembly``'s)."""

    def __init__(self, manifest: Manifest, pool: BufferPool, layout: SliceLayout, digest: str,
                 base: HeldBase, steps: tuple[tuple[int, int], ...], *,
                 on_bytes: Callable[[int], None] | None = None,
                 on_failed: Callable[[str], None] | None = None) -> None:
        """``on_bytes(nbytes)``: each delta payload; ``on_failed(cause)``: a chunk failed
        the delta ("decode", "checksum", "sums" or "too_big", counted by the caller)."""
        super().__init__(manifest, pool, layout, digest)
        self._start_rebuild(base, steps, scratch=True)
        self._on_delta_bytes = on_bytes
        self._on_failed = on_failed
        self.cause: str | None = None  # why the delta failed (None: it did not)
        #: delta payload bytes so far (every step) against the planned bytes of the same
        #: chunks (once): past ``LOSS_SLACK_CHUNKS`` chunks more, raw slices are cheaper
        self.delta_bytes = 0
        self.planned_bytes = 0
        self._slack = LOSS_SLACK_CHUNKS * manifest.chunk_size

    @property
    def done_fraction(self) -> float:
        total = len(self.layout.chunks) * len(self.steps)
        done = len(self.layout.chunks) * (self.step + 1) - len(self.missing)
        return 1.0 if total == 0 else done / total

    def step_chunks(self) -> set[int]:
        return set(self.layout.chunks)

    def accepts(self, chunk: int, size: int) -> bool:
        return chunk in self.layout.sizes and 0 < size <= self.manifest.chunk_span(chunk)[1]

    def place(self, chunk: int, payload: memoryview) -> int | None:
        """Keep the payload (``verify`` decodes it) and count its bytes."""
        super().place(chunk, payload)
        self.delta_bytes += len(payload)
        if self.step == 0:
            self.planned_bytes += self.layout.sizes[chunk]
        if self._on_delta_bytes is not None:
            self._on_delta_bytes(len(payload))
        return None

    def admit(self, chunk: int, size: int | None) -> bool:
        """Not read in place (``size`` None: a delta never is), not past the loss slack,
        and on the last step a sum to check the rebuilt bytes against."""
        if size is None:
            return False
        if self.delta_bytes > self.planned_bytes + self._slack:
            return self.refuse("too_big", WeightPubError(
                f"version {self.manifest.version}: the delta has cost {self.delta_bytes} "
                f"bytes for {self.planned_bytes} planned bytes"))
        if self.last_step and not self.readable_in_place(chunk):
            return self.refuse("sums", ChecksumError(
                f"chunk {chunk} of version {self.manifest.version}: no slice sum to check "
                "its rebuilt bytes against"))
        return True

    def decoded(self, chunk: int, payload: memoryview) -> memoryview | None:
        """A payload of exactly the planned size is the plan's bytes of the chunk, sent
        as a slice: kept as it came; any other is decoded over the whole chunk."""
        if len(payload) == self.layout.sizes[chunk]:
            return payload
        return super().decoded(chunk, payload)

    def keep(self, chunk: int, decoded: memoryview) -> bool:
        """Scatter the planned bytes into staging (``decoded``: the slice, or the whole
        chunk); on the last step check them against the slice sum (or the checksum)."""
        data = np.frombuffer(decoded, dtype=np.uint8)
        if len(decoded) == self.layout.sizes[chunk]:  # the slice (or a chunk covered whole)
            self.layout.scatter(chunk, data, self._array)
        else:
            self.layout.scatter(chunk, data, self._array,
                                chunk_start=self.manifest.chunk_span(chunk)[0])
        if self.last_step:
            if self.layout.whole(self.manifest, chunk):
                got = xxhash.xxh3_64_intdigest(self.chunk_target(chunk))
                want: int | None = self.manifest.checksums[chunk]
            else:
                got = xxhash.xxh3_64_intdigest(self.layout.gather(chunk, self._array).data)
                want = None if self.sums is None else self.sums.get(chunk)
            if got != want:
                return self.refuse("checksum", ChecksumError(
                    f"chunk {chunk} of version {self.manifest.version} rebuilt from base "
                    f"{self.base.version} fails its slice checksum"))
        return True

    def refuse(self, cause: str, error: WeightPubError) -> bool:
        if self.cause is None:
            self.cause = cause
            if self._on_failed is not None:
                self._on_failed(cause)
        return super().refuse(cause, error)
