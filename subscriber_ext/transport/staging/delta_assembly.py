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
bytes) and rebuilds only those bytes (``sparse_delta.py``); both rebuilds share
``DeltaRebuild``'s skeleton. ``start_for`` tells a target maker what a version's
deltas can start from, or why not.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from subscriber_ext.transport.staging.assembly import Assembly, DeltaStart, HeldBase, StagedVersion
from weightpub_wire.buffers import BufferPool, byte_view
from weightpub_wire.checksums import chunk_checksum
from weightpub_wire.delta_codec import decode_chunk, version_digest
from weightpub_wire.errors import ChecksumError, ProtocolError, WeightPubError
from weightpub_wire.protocol import Manifest

__all__ = ["DeltaAssembly", "DeltaRebuild", "DeltaStart", "DeltaState", "HeldBase"]

_REFUSED_KEEP = 16


class DeltaRebuild(Assembly):
    """The skeleton of a version rebuilt from ``base`` through ``steps`` ((version, its
    base) per delta fetched): each payload is received into ``payload`` (``place``),
    decoded over the source's chunk (the base on the first step, the bytes the previous
    step wrote after it) into ``decode_target``, then kept (``keep``: where the decoded
    bytes go, and on the last step their check). ``error`` says why a chunk was refused.

    A subclass calls ``_start_rebuild`` after its own ``Assembly`` set-up and overrides
    ``keep`` (and ``decode_target`` where the chunk is decoded in place, not in
    ``scratch``)."""

    base: HeldBase
    steps: Sequence[tuple[int, int]]
    step: int
    payload: memoryview  # one payload as it came
    scratch: memoryview  # a whole chunk, decoded (empty where decoded in place)

    def _start_rebuild(self, base: HeldBase, steps: Sequence[tuple[int, int]], *,
                       scratch: bool) -> None:
        """Hold ``base`` and ``steps``, and the payload (and decode ``scratch``) chunks."""
        self.base = base
        self.steps = steps
        self.step = 0
        self.fetch_version, self.fetch_base = steps[0]
        span = min(self.manifest.chunk_size, self.manifest.total_bytes)
        self.payload = memoryview(bytearray(span))
        self.scratch = np.empty(span if scratch else 0, dtype=np.uint8).data

    @property
    def last_step(self) -> bool:
        return self.step == len(self.steps) - 1

    def step_chunks(self) -> set[int]:
        """What each step fetches (every chunk here; a plan's touched chunks sparse)."""
        return set(range(self.manifest.num_chunks))

    def place(self, chunk: int, payload: memoryview) -> int | None:
        """Copy a delta payload into ``payload`` (``verify`` decodes it); no digest: the
        rebuilt bytes are checked, not the payload."""
        self.payload[: len(payload)] = payload
        return None

    def admit(self, chunk: int, size: int | None) -> bool:
        """Whether the payload placed for ``chunk`` may be decoded (refusing says why)."""
        return True

    def decode_target(self, chunk: int) -> memoryview:
        """Where ``chunk`` is decoded to: a scratch chunk (``keep`` takes it from there)."""
        return self.scratch[: self.manifest.chunk_span(chunk)[1]]

    def decoded(self, chunk: int, payload: memoryview) -> memoryview | None:
        """``payload`` decoded over the source's chunk (None: it did not decode)."""
        start, span = self.manifest.chunk_span(chunk)
        out = self.decode_target(chunk)
        source = (self.base.view if self.step == 0 else self.view)[start: start + span]
        cpu = time.thread_time()
        try:
            decode_chunk(payload, source, out)
        except ProtocolError as exc:
            self.refuse("decode", exc)
            return None
        finally:
            self.decode_seconds += time.thread_time() - cpu
        return out

    def keep(self, chunk: int, decoded: memoryview) -> bool:
        """Put ``chunk``'s ``decoded`` bytes where they belong; on the last step check
        them (False, after ``refuse``: they do not match)."""
        raise NotImplementedError

    def refuse(self, cause: str, error: WeightPubError) -> bool:
        """A chunk failed the delta (``cause``: "decode", "checksum", ...): False."""
        self.error = error
        return False

    def verify(self, chunk: int, size: int | None = None, digest: int | None = None) -> bool:
        """Decode the payload placed for ``chunk`` (``size`` bytes; None: a whole chunk)
        and keep it; ``digest`` (of the payload) is never given: the rebuilt bytes are
        checked. The last chunk of a step that is not the last starts the next one."""
        if not self.admit(chunk, size):
            return False
        span = self.manifest.chunk_span(chunk)[1]
        decoded = self.decoded(chunk, self.payload[: span if size is None else size])
        if decoded is None or not self.keep(chunk, decoded):
            return False
        self.missing.discard(chunk)
        if not self.missing and not self.last_step:  # the next delta of the chain
            self.step += 1
            self.fetch_version, self.fetch_base = self.steps[self.step]
            self.missing = self.step_chunks()
            self.cursor = 0
        return True

    def abandon(self) -> None:
        self._release_rebuild()
        super().abandon()

    def finish(self) -> StagedVersion:
        self._release_rebuild()
        return super().finish()

    def _release_rebuild(self) -> None:
        self.payload.release()
        self.scratch.release()


class DeltaAssembly(DeltaRebuild):
    """A whole version rebuilt from ``base`` through ``steps`` (``DeltaRebuild``): each
    chunk is decoded straight into the staging buffer and, on the last step, checked
    against the manifest's checksum."""

    def __init__(self, manifest: Manifest, pool: BufferPool, base: HeldBase,
                 steps: list[tuple[int, int]]) -> None:
        super().__init__(manifest, pool)
        self._start_rebuild(base, steps, scratch=False)

    @property
    def done_fraction(self) -> float:
        total = self.manifest.num_chunks * len(self.steps)
        done = self.manifest.num_chunks * self.step + self.manifest.num_chunks - len(self.missing)
        return 1.0 if total == 0 else done / total

    def chunk_target(self, chunk: int) -> memoryview:
        return self.payload[: self.manifest.chunk_span(chunk)[1]]

    def accepts(self, chunk: int, size: int) -> bool:
        return size <= self.manifest.chunk_span(chunk)[1]

    def decode_target(self, chunk: int) -> memoryview:
        """In place: the chunk of the staging buffer (a later step reads it there)."""
        start, span = self.manifest.chunk_span(chunk)
        return self.view[start: start + span]

    def keep(self, chunk: int, decoded: memoryview) -> bool:
        """Already in place; checked on the last step."""
        if self.last_step and chunk_checksum(decoded) != self.manifest.checksums[chunk]:
            return self.refuse("checksum", ChecksumError(
                f"chunk {chunk} of version {self.manifest.version} rebuilt "
                f"from base {self.base.version} fails its checksum"))
        return True


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
