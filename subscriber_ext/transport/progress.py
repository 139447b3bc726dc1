"""Versions still arriving: which tensors are already final, so work on them can start.

Why: a replica that waits for the whole version before it turns the bytes into
kernel-format weights adds that work to every update. The subscriber verifies
each chunk as it lands; once every chunk under a tensor is verified, those
bytes never change again in this reception. ``ProgressFeed`` tells the consumer
(``WeightSubscriber(on_progress=...)``) as the verified prefix of the version
grows, with a ``PartialVersion`` whose ``ready()`` tensors may be read.

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
    ones). ``ready_bytes`` is the verified prefix of the flat layout. ``attempt``
    identifies this reception (``StagedVersion.attempt`` of the version it becomes).
    """

    __slots__ = ("_ends", "attempt", "buffer", "cancelled", "manifest", "ready_bytes", "tensors")

    def __init__(self, manifest: Manifest, buffer: torch.Tensor, attempt: int,
                 tensors: dict[str, torch.Tensor] | None = None) -> None:
        self.manifest = manifest
        self.buffer = buffer
        self.attempt = attempt
        self.tensors = tensor_views(manifest, buffer) if tensors is None else tensors
        self.ready_bytes = 0
        self.cancelled = False
        self._ends = sorted((e.offset + e.nbytes, e.name) for e in manifest.tensors)

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def publisher_id(self) -> str:
        return self.manifest.publisher_id

    def ready_count(self) -> int:
        """How many tensors lie wholly in the verified prefix."""
        lo, hi = 0, len(self._ends)
        while lo < hi:  # first end beyond the prefix
            mid = (lo + hi) // 2
            if self._ends[mid][0] <= self.ready_bytes:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def ready(self) -> list[str]:
        """Names of the tensors whose every byte is verified (in layout order)."""
        return [name for _, name in self._ends[: self.ready_count()]]


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
        self._next_chunk = 0
        self._ready = 0

    def begin(self, target: Assembly) -> None:
        """A reception starts (after any ``cancel`` of the one it replaces)."""
        self._target = target
        self._partial = PartialVersion(target.manifest, target.buffer, next(_attempts))
        self._next_chunk = 0
        self._ready = 0

    def verified(self, target: Assembly) -> None:
        """A chunk of ``target`` was verified: notify if the ready prefix covers more tensors."""
        partial = self._partial
        if target is not self._target or partial is None:
            return
        if isinstance(target, DeltaAssembly) and target.step < len(target.steps) - 1:
            return  # bytes of an intermediate delta step are rewritten by the next one
        manifest, missing = target.manifest, target.missing
        if not missing:
            return  # complete: the staged version itself follows at once
        chunk = self._next_chunk
        while chunk < manifest.num_chunks and chunk not in missing:
            chunk += 1
        self._next_chunk = chunk
        partial.ready_bytes = min(chunk * manifest.chunk_size, manifest.total_bytes)
        ready = partial.ready_count()
        if ready > self._ready:
            self._ready = ready
            self._notify(partial)

    def cancel(self, target: Assembly) -> None:
        """``target`` is given up: anything built from its partial must be dropped."""
        if target is not self._target or self._partial is None:
            return
        partial, self._partial, self._target = self._partial, None, None
        partial.cancelled = True
        if self._ready:  # the consumer saw it: tell it to throw it away
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
