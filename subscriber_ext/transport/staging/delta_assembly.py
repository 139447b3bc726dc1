"""Delta versions, subscriber side: rebuild a version from the base this subscriber holds.

The subscriber keeps its newest staged version as the *base* (``StagedVersion.retain``:
the bytes stay put after the consumer releases them, until a newer version
replaces the base), when the publisher announces that deltas follow
(``Manifest.deltas_follow``; a publisher without deltas costs no second buffer).
When a manifest offers deltas (``Manifest.delta``) and the
base is one of its chain, the version is rebuilt in a fresh staging buffer,
never in the live weights or the base: the first step reads the base, each
later step (a subscriber that missed versions of the chain) is applied in
place, step by step over the whole version. Every chunk of the last step is
checked against the full version's checksum as it is written; only a version
whose every chunk matched is staged. A payload that does not decode or a
chunk that does not match makes the caller fetch the version in full instead.

A sliced subscriber (``SyncClient(targets=...)`` whose maker names a ``delta_plan``)
holds its last sparse version the same way (``HeldBase.plan``: only that plan's
bytes) and rebuilds only those bytes (``sparse_delta.py``); ``start_for`` tells a
target maker what a version's deltas can start from, or why not.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from subscriber_ext.transport.staging.assembly import Assembly, DeltaStart, HeldBase, StagedVersion
from weightpub_wire.buffers import BufferPool, byte_view
from weightpub_wire.checksums import chunk_checksum
from weightpub_wire.delta_codec import decode_chunk, version_digest
from weightpub_wire.errors import ChecksumError, ProtocolError, WeightPubError
from weightpub_wire.protocol import Manifest

__all__ = ["DeltaAssembly", "DeltaStart", "DeltaState", "HeldBase"]

_REFUSED_KEEP = 16


class DeltaAssembly(Assembly):
    """A version rebuilt from ``base`` through ``steps`` ((version, its base) per delta fetched).

    Payloads are received into one scratch chunk, decoded into the staging
    buffer, and (last step) checked. ``error`` says why a chunk was refused.
    """

    def __init__(self, manifest: Manifest, pool: BufferPool, base: HeldBase,
                 steps: list[tuple[int, int]]) -> None:
        super().__init__(manifest, pool)
        self.base = base
        self.steps = steps
        self.step = 0
        self.fetch_version, self.fetch_base = steps[0]
        self.scratch = memoryview(bytearray(min(manifest.chunk_size, manifest.total_bytes)))
        self.error: WeightPubError | None = None
        self.decode_seconds = 0.0

    @property
    def done_fraction(self) -> float:
        total = self.manifest.num_chunks * len(self.steps)
        done = self.manifest.num_chunks * self.step + self.manifest.num_chunks - len(self.missing)
        return 1.0 if total == 0 else done / total

    def chunk_target(self, chunk: int) -> memoryview:
        return self.scratch[: self.manifest.chunk_span(chunk)[1]]

    def accepts(self, chunk: int, size: int) -> bool:
        return size <= self.manifest.chunk_span(chunk)[1]

    def place(self, chunk: int, payload: memoryview) -> int | None:
        """Copy a delta payload into ``scratch`` (``verify`` decodes it into place)."""
        self.chunk_target(chunk)[: len(payload)] = payload
        return None

    def verify(self, chunk: int, size: int | None = None, digest: int | None = None) -> bool:
        """Decode the payload in ``scratch`` into place; check it on the last step
        (``digest`` is of the payload, never given here: the rebuilt bytes are checked)."""
        start, span = self.manifest.chunk_span(chunk)
        out = self.view[start: start + span]
        source = self.base.view[start: start + span] if self.step == 0 else out
        cpu = time.thread_time()
        try:
            decode_chunk(self.scratch[: span if size is None else size], source, out)
        except ProtocolError as exc:
            self.error = exc
            return False
        finally:
            self.decode_seconds += time.thread_time() - cpu
        if self.step == len(self.steps) - 1 and \
                chunk_checksum(out) != self.manifest.checksums[chunk]:
            self.error = ChecksumError(f"chunk {chunk} of version {self.manifest.version} rebuilt "
                                       f"from base {self.base.version} fails its checksum")
            return False
        self.missing.discard(chunk)
        if not self.missing and self.step < len(self.steps) - 1:  # next delta of the chain
            self.step += 1
            self.fetch_version, self.fetch_base = self.steps[self.step]
            self.missing = set(range(self.manifest.num_chunks))
            self.cursor = 0
        return True

    def abandon(self) -> None:
        self.scratch.release()
        super().abandon()

    def finish(self) -> StagedVersion:
        self.scratch.release()
        return super().finish()


class DeltaState:
    """The held base, the choice between a delta and a full fetch, and the byte counters."""

    def __init__(self) -> None:
        self.base: HeldBase | None = None
        # peer sharing serves the newest staged version from the base: keep it always
        self.keep_newest = False
        # a client whose targets cannot rebuild from a base of theirs: keep none
        self.no_bases = False
        self._refused: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.bytes_received_full = 0
        self.bytes_received_delta = 0
        self.versions_full = 0
        self.versions_delta = 0
        self.fallbacks = 0
        self.decode_seconds = 0.0

    def start_for(self, manifest: Manifest, plan: str | None = None) -> DeltaStart:
        """What ``manifest``'s deltas can start from: the held base (of ``plan``: the
        slice plan a sparse target receives, None for a whole one) and the steps from it,
        or why not (``DeltaStart.why``; None too when the manifest offers no delta)."""
        base, info = self.base, manifest.delta
        if info is None:
            return DeltaStart()
        if (manifest.publisher_id, manifest.version) in self._refused:
            return DeltaStart(why="refused")
        if base is None or base.plan != plan or \
                (base.manifest.total_bytes, base.manifest.chunk_size) != \
                (manifest.total_bytes, manifest.chunk_size):
            return DeltaStart(why="no_base")
        links = [(link.version, link.digest) for link in info.chain]
        if (base.version, base.digest) not in links:
            return DeltaStart(why="no_base")
        first = links.index((base.version, base.digest))
        versions = [v for v, _ in links[first:]] + [manifest.version]
        return DeltaStart(base, tuple(zip(versions[1:], versions[:-1], strict=True)))

    def assembly_for(self, manifest: Manifest, pool: BufferPool) -> DeltaAssembly | None:
        """A delta rebuild of ``manifest`` if the held base is in its chain, else None."""
        start = self.start_for(manifest)
        if start.base is None:
            return None
        return DeltaAssembly(manifest, pool, start.base, list(start.steps))

    def refuse(self, target: Assembly) -> None:
        """The delta failed: the next start of this version fetches it in full."""
        self.fallbacks += 1
        self.decode_seconds += target.decode_seconds
        self._refused[(target.manifest.publisher_id, target.manifest.version)] = None
        while len(self._refused) > _REFUSED_KEEP:
            self._refused.popitem(last=False)

    def count(self, target: Assembly, size: int) -> None:
        """Payload bytes of one chunk reply, by the path it came on."""
        if target.fetch_base:
            self.bytes_received_delta += size
        else:
            self.bytes_received_full += size

    def completed(self, target: Assembly, staged: StagedVersion) -> None:
        """A version was staged: it becomes the base (the previous base is let go).

        Only when its publisher serves deltas (``Manifest.deltas_follow``) or peers
        fetch it from us (``keep_newest``): a base nobody will ever send a delta against
        or ask for would double the staging memory (and its first-touch page faults)
        for nothing.
        """
        if target.fetch_base:  # a delta target ends on a delta step
            self.versions_delta += 1
            self.decode_seconds += target.decode_seconds
        else:
            self.versions_full += 1
        self.drop_base()
        manifest = staged.manifest
        if self.no_bases:
            return
        if not (manifest.deltas_follow or manifest.delta is not None or self.keep_newest):
            return
        self.base = HeldBase(
            manifest=manifest,
            digest=version_digest(manifest.total_bytes, manifest.chunk_size, manifest.checksums),
            buffer=staged.buffer, view=byte_view(staged.buffer, manifest.total_bytes),
            let_go=staged.retain(), plan=target.plan)

    def drop_base(self) -> None:
        if self.base is not None:
            base, self.base = self.base, None
            base.let_go()

    def stats(self) -> dict[str, int | float | None]:
        return {
            "bytes_received_full": self.bytes_received_full,
            "bytes_received_delta": self.bytes_received_delta,
            "versions_full": self.versions_full,
            "versions_delta": self.versions_delta,
            "delta_fallbacks": self.fallbacks,
            "delta_decode_cpu_seconds": round(self.decode_seconds, 4),
            "delta_base_version": None if self.base is None else self.base.version,
        }
