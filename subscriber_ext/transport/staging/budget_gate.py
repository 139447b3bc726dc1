"""Whether a version may start staging now: the host-memory budget, before any allocation.

Why a gate in front of the staging buffer: a subscriber holds whole versions in
host memory (the one arriving, the delta base, the ones its consumer has not
released yet); allocating past what the host can give gets the process
OOM-killed. The pool (``weightpub_wire.buffers.BufferPool``) counts what is
alive; this gate turns its answer into the subscriber's three outcomes:

* **start**: the buffer fits now (the delta base is given up first if only it
  stands in the way: the version is then fetched in full);
* **wait**: it fits once buffers the consumer still holds come back; the
  version is kept (``waiting``) and tried again on every tick;
* **refuse**: it can never fit; ``StagingBudgetError`` names the sizes and the
  option, is reported, and the version is not tried again (a newer one is).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from subscriber_ext.transport.staging.delta_assembly import DeltaState
from weightpub_wire import protocol as wire
from weightpub_wire.buffers import BufferPool
from weightpub_wire.errors import StagingBudgetError

__all__ = ["BudgetGate"]

log = logging.getLogger("weightpub.subscriber")


class BudgetGate:
    """The budget's decision for each version a ``SyncClient`` wants to start."""

    def __init__(self, pool: BufferPool, deltas: DeltaState,
                 size: Callable[[wire.Manifest], int] | None = None) -> None:
        """``size(manifest)``: the staging a version costs (default: its total bytes; a
        slice plan's: the pages it touches)."""
        self.pool = pool
        self._size = size or (lambda manifest: manifest.total_bytes)
        self.deltas = deltas
        self.waiting: wire.Manifest | None = None  # fits once held buffers come back
        self.refused: StagingBudgetError | None = None  # the newest refusal, until a staging
        self._refused_key: tuple[str, int] | None = None  # (publisher_id, version)

    def admit(self, manifest: wire.Manifest) -> bool:
        """True: allocate now. False: it waits (``waiting``) or was refused (``refused``)."""
        self.waiting = None
        try:
            size = self._size(manifest)
            fits = self.pool.room_for(size)
            if not fits and self.deltas.base is not None:
                self.deltas.drop_base()  # the one buffer we can give up ourselves
                fits = self.pool.room_for(size)
        except StagingBudgetError as exc:
            self.refused = StagingBudgetError(
                f"version {manifest.version} refused before allocating: {exc}")
            self._refused_key = (manifest.publisher_id, manifest.version)
            log.warning("%s", self.refused)
            return False
        if not fits:
            log.info("version %d waits for staging memory (%d bytes held)", manifest.version,
                     self.pool.held_bytes)
            self.waiting = manifest
        return fits

    def is_refused(self, manifest: wire.Manifest) -> bool:
        return (manifest.publisher_id, manifest.version) == self._refused_key

    def held_back(self, instance: str | None) -> int:
        """The newest version of ``instance`` known but not fetched: waiting or refused."""
        waiting = self.waiting.version if self.waiting is not None else 0
        refused = self._refused_key[1] if self._refused_key and \
            self._refused_key[0] == instance else 0
        return max(waiting, refused)

    def take_waiting(self) -> wire.Manifest | None:
        waiting, self.waiting = self.waiting, None
        return waiting

    def staged(self) -> StagingBudgetError | None:
        """A version was staged: the refusal is history (returned, to clear it elsewhere)."""
        refused, self.refused = self.refused, None
        return refused
