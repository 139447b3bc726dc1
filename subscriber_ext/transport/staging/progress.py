"""Versions still arriving: which tensors are already final, so work on them can start.

Why: a replica that waits for the whole version before it turns the bytes into
kernel-format weights adds that work to every update. The subscriber verifies
each chunk as it lands; once every chunk under a tensor is verified, those
bytes never change again in this reception. ``ProgressFeed`` tells the consumer
(``WeightSubscriber(on_progress=...)``) as tensors become final, with a
``PartialVersion`` whose ``ready()`` tensors may be read.

Nothing here makes a version usable: only the complete, verified
``StagedVersion`` (which carries the same ``attempt``) may be committed. If a
reception is given up (conflated, failed, restarted in full) its
``PartialVersion`` is ``cancelled`` and whatever was built from it must be thrown
away: its buffer may be reused by the next version at once.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch

from subscriber_ext.transport.staging.assembly import Assembly, tensor_views
from subscriber_ext.transport.staging.chunk_listener import final_bytes
from weightpub_wire.protocol import Manifest

__all__ = ["PartialVersion", "ProgressFeed"]

log = logging.getLogger("weightpub.subscriber")
_attempts = itertools.count(1)


class PartialVersion:
    """A version being received; ``ready()`` names the tensors whose bytes are final.

    ``tensors`` are views into the staging ``buffer`` (all tensors; read only the ready
    ones). Chunks arrive largest tensors first (``weightpub_wire.chunk_order``), so
    tensors become ready out of layout order: ``ready_order`` lists their indices in
    the order they did. ``attempt`` identifies this reception
    (``StagedVersion.attempt`` of the version it becomes).
    """

    __slots__ = ("_ready", "attempt", "buffer", "cancelled", "manifest", "ready_order",
                 "tensors")

    def __init__(self, manifest: Manifest, buffer: torch.Tensor, attempt: int,
                 tensors: dict[str, torch.Tensor] | None = None) -> None:
        self.manifest = manifest
        self.buffer = buffer
        self.attempt = attempt
        self.tensors = tensor_views(manifest, buffer) if tensors is None else tensors
        self.ready_order: list[int] = []
        self._ready: set[int] = set()
        self.cancelled = False

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def publisher_id(self) -> str:
        return self.manifest.publisher_id

    def mark_ready(self, indices: list[int] | tuple[int, ...]) -> None:
        """Tensors (indices into ``manifest.tensors``) whose every chunk is verified."""
        count = len(self.manifest.tensors)
        for index in indices:
            if 0 <= index < count and index not in self._ready:
                self._ready.add(index)
                self.ready_order.append(index)

    def ready_count(self) -> int:
        return len(self.ready_order)

    def ready(self) -> list[str]:
        """Names of the tensors whose every byte is verified (in the order they became so)."""
        entries = self.manifest.tensors
        return [entries[i].name for i in self.ready_order]


class ProgressFeed:
    """A ``ChunkListener`` that calls ``on_progress`` as tensors of the target become final.

    Registered first in ``SyncClient.listeners``, so it hears the target's start,
    each chunk whose final bytes verified (never an intermediate delta step:
    ``listener.final_bytes``), completion and drop like every other listener.
    Hooks carry the manifest only; ``current_target`` names the ``Assembly`` they
    are about (the client's target). Runs on the subscriber thread; ``on_progress``
    must return quickly (hand the partial to another thread). It is called when
    more tensors are ready and once more when the reception is cancelled; a
    consumer error is logged, never raised.
    """

    def __init__(self, on_progress: Callable[[PartialVersion], None],
                 current_target: Callable[[], Assembly | None]) -> None:
        self._on_progress = on_progress
        self._current_target = current_target
        self._target: Assembly | None = None
        self._partial: PartialVersion | None = None
        self._left: list[int] = []  # per tensor: chunks not verified yet
        self._by_chunk: list[list[int]] = []  # per chunk: the tensors it holds bytes of
        self._seen: set[int] = set()

    def target_started(self, manifest: Manifest) -> None:
        """A reception starts (after any ``target_dropped`` of the one it replaces); the
        ``Assembly`` carries the attempt into the ``StagedVersion`` it becomes."""
        target = self._current_target()
        if target is None:
            return
        self._target = target
        self._partial = PartialVersion(manifest, target.buffer, next(_attempts))
        target.attempt = self._partial.attempt
        self._by_chunk = [[] for _ in range(manifest.num_chunks)]
        self._left = []
        for index, entry in enumerate(manifest.tensors):
            chunks = manifest.chunks_of(entry)
            self._left.append(len(chunks))
            for chunk in chunks:
                self._by_chunk[chunk].append(index)
        self._partial.mark_ready([i for i, left in enumerate(self._left) if not left])
        self._seen = set()

    def chunk_verified(self, manifest: Manifest, chunk: int, data: memoryview) -> None:
        """``chunk`` of the target holds its final bytes: notify if a tensor became final."""
        target, partial = self._target, self._partial
        if target is None or partial is None or target is not self._current_target() \
                or chunk in self._seen:
            return
        if not final_bytes(target):
            return  # bytes of an intermediate delta step are rewritten by the next one
        if target.done:
            return  # complete: the staged version itself follows at once
        self._seen.add(chunk)
        newly = []
        for index in self._by_chunk[chunk]:
            self._left[index] -= 1
            if self._left[index] == 0:
                newly.append(index)
        if newly:
            partial.mark_ready(newly)
            self._notify(partial)

    def target_dropped(self, manifest: Manifest) -> None:
        """The target is given up: anything built from its partial must be dropped."""
        if self._partial is None or self._target is None \
                or self._target is not self._current_target():
            return
        partial, self._partial, self._target = self._partial, None, None
        partial.cancelled = True
        if self._seen:  # the consumer may have seen it: tell it to throw it away
            self._notify(partial)

    def target_completed(self, manifest: Manifest) -> None:
        """The target became a ``StagedVersion`` (its ``attempt`` came from the assembly)."""
        if self._target is not None and self._target.manifest is manifest:
            self._target = self._partial = None

    def follow(self, assembly: Assembly) -> ProgressFeed:
        """A feed with the same consumer for a reception outside the client's target (a
        collective round assembling a version): its hooks must run on the subscriber
        thread too."""
        return ProgressFeed(self._on_progress, lambda: assembly)

    def _notify(self, partial: PartialVersion) -> None:
        try:
            self._on_progress(partial)
        except Exception:  # a consumer bug must not stop the subscriber
            log.exception("on_progress callback failed for version %d", partial.version)
