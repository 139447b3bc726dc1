"""Which announced version a ``SyncClient`` fetches next, and which it leaves alone.

Split from ``sync_client.py``: the policy over one manifest is a list of
reasons not to start it (another publisher instance, already staged or waiting
for budget, never fits the budget, failed recently, this node's collective group
will receive it) and then conflation: a newer manifest replaces a target less
than ``switch_below_fraction`` received, otherwise it waits as the one queued.
Another data path (a collective round) may hand over a whole version instead.
A version given up is retried only after a growing back-off (1 s .. 30 s).

The target's life (start, complete, drop) is the client's (``TargetLife``); this
part decides, and keeps the newest staged version and the one queued.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from subscriber_ext.transport.client.instance_following import InstanceFollower
from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.budget_gate import BudgetGate
from subscriber_ext.transport.staging.request_table import VersionBackoff
from weightpub_wire import protocol as wire

__all__ = ["TargetLife", "VersionChoice"]

log = logging.getLogger("weightpub.subscriber")


class TargetLife(Protocol):
    """What the choice drives: the version being fetched (``SyncClient``)."""

    @property
    def target(self) -> Assembly | None: ...

    def start_target(self, manifest: wire.Manifest) -> None: ...

    def complete_target(self, target: Assembly) -> None: ...

    def drop_target(self) -> None: ...

    def sums_from(self, manifest: wire.Manifest) -> None: ...


class VersionChoice:
    """Conflation over the announced versions of the followed publisher instance."""

    def __init__(self, life: TargetLife, follower: InstanceFollower, gate: BudgetGate,
                 backoff: VersionBackoff, *, switch_below_fraction: float,
                 defer: Callable[[wire.Manifest], bool]) -> None:
        """``defer(manifest)``: True when another data path (this node's collective
        group) will bring it, so it is not fetched now."""
        self.current_version = 0  # the newest version staged
        self.queued: wire.Manifest | None = None  # newer than a target too far along to drop
        self._life = life
        self._follower = follower
        self._gate = gate
        self._backoff = backoff
        self._switch_below = switch_below_fraction
        self._defer = defer

    def consider(self, manifest: wire.Manifest, *, confirmed: bool = False) -> None:
        """Decide whether a manifest becomes the target (conflation, publisher restarts).

        ``confirmed``: it came in a ``latest`` reply from the ROUTER this client dialled,
        which is the only thing that may make it follow another publisher instance.
        """
        follower = self._follower
        if manifest.publisher_id != follower.instance:
            if not confirmed:
                follower.unknown_instance(manifest.publisher_id, f"manifest v{manifest.version}")
                return
            follower.follow(manifest.publisher_id)
        follower.saw(manifest.version)
        gate = self._gate
        if manifest.version <= max(self.current_version,
                                   gate.waiting.version if gate.waiting else 0):
            return
        if gate.is_refused(manifest):
            return  # does not fit the budget; it never will
        if self._backoff.waiting(manifest.publisher_id, manifest.version, time.monotonic()):
            return  # failed recently; a newer version or the back-off expiring retries it
        if self._defer(manifest):
            return  # this node's group will receive it (fetched here only if that fails)
        target = self._life.target
        if target is not None:
            if manifest.version == target.manifest.version and target.manifest.sums_follow \
                    and not manifest.sums_follow:
                self._life.sums_from(manifest)  # its sums, all at once
            if manifest.version <= target.manifest.version:
                return
            if target.done_fraction >= self._switch_below:
                if self.queued is None or manifest.version > self.queued.version:
                    self.queued = manifest
                return
            log.info("conflating: version %d replaces %d (%.0f%% received)", manifest.version,
                     target.manifest.version, 100 * target.done_fraction)
            self._life.drop_target()
        self._life.start_target(manifest)

    def deliver(self, assembly: Assembly) -> None:
        """A version assembled and verified by another data path (a collective round):
        stage it exactly like a fetched one. An older fetch in progress gives way."""
        if assembly.manifest.version <= self.current_version:
            assembly.abandon()
            return
        target = self._life.target
        if target is not None and target.manifest.version <= assembly.manifest.version:
            self._life.drop_target()
        self._life.complete_target(assembly)

    def yield_target(self, version: int) -> bool:
        """Give up an ongoing fetch older than ``version`` (a broadcast brings a newer one);
        False when the fetch in progress is of ``version`` or newer."""
        target = self._life.target
        if target is None:
            return True
        if target.manifest.version >= version:
            return False
        self._life.drop_target()
        return True

    def staged(self, version: int) -> None:
        """``version`` is staged: older announcements are ignored from now on."""
        self.current_version = version

    def take_queued(self) -> wire.Manifest | None:
        """The version that waited behind the one just staged (to be considered now)."""
        queued, self.queued = self.queued, None
        return queued

    def switched(self, restarted: bool) -> None:
        """The client follows another instance: its versions mean nothing here (an
        ongoing fetch of a restarted one is dropped, nothing waits)."""
        if restarted:
            self._life.drop_target()
            self.queued = None
        self.current_version = 0
