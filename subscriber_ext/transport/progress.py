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

from subscriber_ext.transport.delta import DeltaAssembly
from subscriber_ext.transport.staging import Assembly, StagedVersion, tensor_views
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
    """Follows the ``SyncClient``'s target and calls ``on_progress`` as tensors become final.

    Runs on the subscriber thread; ``on_progress`` must return quickly (hand the
    partial to another thread). It is called when more tensors are ready and once
    more when the reception is cancelled; a consumer error is logged, never raised.
    """

    def __init__(self, on_progress: Callable[[PartialVersion], None]) -> None:
        self._on_progress = on_progress
        self._target: Assembly | None = None
        self._partial: PartialVersion | None = None
        self._left: list[int] = []  # per tensor: chunks not verified yet
        self._by_chunk: list[list[int]] = []  # per chunk: the tensors it holds bytes of
        self._seen: set[int] = set()

    def begin(self, target: Assembly) -> None:
        """A reception starts (after any ``cancel`` of the one it replaces)."""
        manifest = target.manifest
        self._target = target
        self._partial = PartialVersion(manifest, target.buffer, next(_attempts))
        self._by_chunk = [[] for _ in range(manifest.num_chunks)]
        self._left = []
        for index, entry in enumerate(manifest.tensors):
            chunks = manifest.chunks_of(entry)
            self._left.append(len(chunks))
            for chunk in chunks:
                self._by_chunk[chunk].append(index)
        self._partial.mark_ready([i for i, left in enumerate(self._left) if not left])
        self._seen = set()

    def verified(self, target: Assembly, chunk: int) -> None:
        """``chunk`` of ``target`` was verified: notify if a tensor became final."""
        partial = self._partial
        if target is not self._target or partial is None or chunk in self._seen:
            return
        if isinstance(target, DeltaAssembly) and target.step < len(target.steps) - 1:
            return  # bytes of an intermediate delta step are rewritten by the next one
        if not target.missing:
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

    def cancel(self, target: Assembly) -> None:
        """``target`` is given up: anything built from its partial must be dropped."""
        if target is not self._target or self._partial is None:
            return
        partial, self._partial, self._target = self._partial, None, None
        partial.cancelled = True
        if self._seen:  # the consumer may have seen it: tell it to throw it away
            self._notify(partial)

    def complete(self, target: Assembly, staged: StagedVersion) -> None:
        """``target`` became ``staged``: it carries the attempt its partials had."""
        if target is self._target and self._partial is not None:
            staged.attempt = self._partial.attempt
        self._target = self._partial = None

    def _notify(self, partial: PartialVersion) -> None:
        try:
            self._on_progress(partial)
        except Exception:  # a consumer bug must not stop the subscriber
            log.exception("on_progress callback failed for version %d", partial.version)
