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

import time
from collections.abc import Callable

import numpy as np
import xxhash

from subscriber_ext.transport.staging.assembly import HeldBase, StagedVersion
from subscriber_ext.transport.staging.sparse_assembly import SparseAssembly
from weightpub_wire.buffers import BufferPool
from weightpub_wire.delta_codec import decode_chunk
from weightpub_wire.errors import ChecksumError, ProtocolError, WeightPubError
from weightpub_wire.protocol import Manifest
from weightpub_wire.slice_layout import SliceLayout

__all__ = ["LOSS_SLACK_CHUNKS", "SparseDeltaAssembly"]

#: a delta that has cost this many chunks more than the raw slices of the same chunks
#: is given up for raw slices (``too_big``): whole-chunk payloads of chunks the plan
#: touches thinly, or chunks the encoder sent raw (the delta did not pay), can cost up
#: to the chunk over the plan's share of it
LOSS_SLACK_CHUNKS = 2


class SparseDeltaAssembly(SparseAssembly):
    """One plan's bytes of a version rebuilt from ``base`` through ``steps`` (module text)."""

    def __init__(self, manifest: Manifest, pool: BufferPool, layout: SliceLayout, digest: str,
                 base: HeldBase, steps: tuple[tuple[int, int], ...], *,
                 on_bytes: Callable[[int], None] | None = None,
                 on_failed: Callable[[str], None] | None = None) -> None:
        """``on_bytes(nbytes)``: each delta payload; ``on_failed(cause)``: a chunk failed
        the delta ("decode", "checksum", "sums" or "too_big", counted by the caller)."""
        super().__init__(manifest, pool, layout, digest)
        self.base = base
        self.steps = steps
        self.step = 0
        self.fetch_version, self.fetch_base = steps[0]
        span = min(manifest.chunk_size, manifest.total_bytes)
        self._payload = memoryview(bytearray(span))  # one payload as it came
        self._decoded = np.empty(span, dtype=np.uint8)  # a whole chunk, decoded
        self._base_array = np.frombuffer(base.view, dtype=np.uint8)
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

    def accepts(self, chunk: int, size: int) -> bool:
        return chunk in self.layout.sizes and 0 < size <= self.manifest.chunk_span(chunk)[1]

    def place(self, chunk: int, payload: memoryview) -> int | None:
        """Keep the payload (``verify`` decodes it); no digest: the result is checked."""
        self._payload[: len(payload)] = payload
        self.delta_bytes += len(payload)
        if self.step == 0:
            self.planned_bytes += self.layout.sizes[chunk]
        if self._on_delta_bytes is not None:
            self._on_delta_bytes(len(payload))
        return None

    def verify(self, chunk: int, size: int | None = None, digest: int | None = None) -> bool:
        """Decode the payload over the base's chunk, keep its planned bytes, and on the
        last step check them (``size`` None: read in place, which a delta never is)."""
        if size is None:
            return False
        last = self.step == len(self.steps) - 1
        if self.delta_bytes > self.planned_bytes + self._slack:
            return self._fail("too_big", WeightPubError(
                f"version {self.manifest.version}: the delta has cost {self.delta_bytes} "
                f"bytes for {self.planned_bytes} planned bytes"))
        if last and not self.readable_in_place(chunk):
            return self._fail("sums", ChecksumError(
                f"chunk {chunk} of version {self.manifest.version}: no slice sum to check "
                "its rebuilt bytes against"))
        start, span = self.manifest.chunk_span(chunk)
        if size == self.layout.sizes[chunk]:  # the plan's bytes of the chunk, as a slice
            payload = np.frombuffer(self._payload, dtype=np.uint8, count=size)
            self.layout.scatter(chunk, payload, self._array)
        else:
            source = self._base_array if self.step == 0 else self._array
            out = self._decoded[:span]
            cpu = time.thread_time()
            try:
                decode_chunk(self._payload[:size], source[start: start + span].data, out.data)
            except ProtocolError as exc:
                return self._fail("decode", exc)
            finally:
                self.decode_seconds += time.thread_time() - cpu
            self.layout.scatter(chunk, out, self._array, chunk_start=start)
        if last:
            if self.layout.whole(self.manifest, chunk):
                got = xxhash.xxh3_64_intdigest(self.chunk_target(chunk))
                want: int | None = self.manifest.checksums[chunk]
            else:
                got = xxhash.xxh3_64_intdigest(self.layout.gather(chunk, self._array).data)
                want = None if self.sums is None else self.sums.get(chunk)
            if got != want:
                return self._fail("checksum", ChecksumError(
                    f"chunk {chunk} of version {self.manifest.version} rebuilt from base "
                    f"{self.base.version} fails its slice checksum"))
        self.missing.discard(chunk)
        if not self.missing and not last:  # the next delta of the chain
            self.step += 1
            self.fetch_version, self.fetch_base = self.steps[self.step]
            self.missing = set(self.layout.chunks)
            self.cursor = 0
        return True

    def _fail(self, cause: str, error: WeightPubError) -> bool:
        if self.cause is None:
            self.cause = cause
            if self._on_failed is not None:
                self._on_failed(cause)
        self.error = error
        return False

    def abandon(self) -> None:
        self._release_scratch()
        super().abandon()

    def finish(self) -> StagedVersion:
        self._release_scratch()
        return super().finish()

    def _release_scratch(self) -> None:
        self._payload.release()
        self._decoded = np.empty(0, dtype=np.uint8)
        self._base_array = np.empty(0, dtype=np.uint8)
