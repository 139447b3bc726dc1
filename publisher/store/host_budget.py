"""The trainer's host budget: a snapshot that cannot fit is refused before it is allocated.

Why: ``publish()`` copies each version into host memory and the publisher keeps
``keep_versions`` snapshots (each new version copied over the oldest one held,
``publisher/store/version_store.py``; plus one while a long reader, a collective round or a
relay still filling, pins the oldest). On a trainer host that already holds the
model, the optimizer and the data loader, one more version past what is left gets
the trainer OOM-killed, which loses the training run, not just a version. So
every snapshot is checked
against ``host_budget_bytes`` first: ``StagingBudgetError`` naming the budget and
the bytes, raised by ``publish()`` before any allocation; the versions already
published stay served. The reply scratch (chunk frames ZeroMQ still holds, idle
send buffers) counts against the same budget: a snapshot waits (``wait_s``) for
queued replies to drain, and the serving thread queues replies only within what
the snapshots leave (``connection_credit.PeerTable``).

The derived budget (``host_budget_bytes`` None) is ``DEFAULT_FRACTION`` of the
host memory available when the publisher starts (``weightpub_wire.host_memory``:
``MemAvailable`` and the cgroup's headroom, the smaller). More than the
subscriber's half: a trainer's own weights are usually resident by then, and a
trainer prepares nothing off a step path.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from weightpub_wire.buffers import BufferPool
from weightpub_wire.errors import StagingBudgetError
from weightpub_wire.host_memory import derive_budget

__all__ = ["BUDGET_NAME", "DEFAULT_FRACTION", "HostBudget", "derive_host_budget"]

DEFAULT_FRACTION = 0.75
BUDGET_NAME = "host_budget_bytes"
#: how long a publish waits for evicted versions' sends to finish before it gives up
RETIRE_WAIT_S = 2.0


def derive_host_budget(fraction: float = DEFAULT_FRACTION) -> int:
    """The host budget a publisher uses when none is given."""
    return derive_budget(fraction)


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


class HostBudget:
    """Checks one snapshot against the pool's budget; the caller's lock serializes calls.

    ``held`` says which versions hold memory now (for the message); ``recycle``
    returns evicted buffers no long reader pins any more; ``retiring`` counts the
    evicted versions still pinned (only they are worth waiting for).
    """

    def __init__(self, pool: BufferPool, *, keep_versions: int,
                 held: Callable[[], tuple[int, ...]], recycle: Callable[[], None],
                 retiring: Callable[[], int], wait_s: float = RETIRE_WAIT_S,
                 scratch: Callable[[], int] = lambda: 0,
                 drop_idle_scratch: Callable[[], None] = lambda: None) -> None:
        """``scratch``: the reply scratch's bytes (the pool counts them too, as
        ``outside``); ``drop_idle_scratch`` frees its idle part when a snapshot needs it."""
        if pool.budget_bytes is None:
            raise ValueError("HostBudget needs a pool with a budget")
        self.budget_bytes: int = pool.budget_bytes
        self._pool = pool
        self._keep = keep_versions
        self._held = held
        self._recycle = recycle
        self._retiring = retiring
        self._wait_s = wait_s
        self._scratch = scratch
        self._drop_idle_scratch = drop_idle_scratch

    def admit(self, version: int, nbytes: int) -> None:
        """Return once a snapshot of ``nbytes`` fits; else raise ``StagingBudgetError``."""
        budget = self.budget_bytes
        what = f"version {version}: its snapshot needs {nbytes} bytes ({_gib(nbytes)})"
        if nbytes > budget:
            raise StagingBudgetError(
                f"{what}, more than the publisher's host budget of {budget} bytes "
                f"({_gib(budget)}; {BUDGET_NAME}); publish refused, still serving "
                f"{list(self._held()) or 'nothing'}")
        deadline = time.monotonic() + self._wait_s
        while not self._pool.room_for(nbytes):  # drops idle pooled buffers first
            self._drop_idle_scratch()
            if self._pool.room_for(nbytes):
                break
            if (not self._retiring() and not self._scratch()) \
                    or time.monotonic() >= deadline:
                held, scratch = self._pool.held_bytes, self._scratch()
                raise StagingBudgetError(
                    f"{what} but {held} bytes ({_gib(held)}) of the publisher's host "
                    f"budget of {budget} bytes ({_gib(budget)}; {BUDGET_NAME}) are held by "
                    f"versions {list(self._held())} (keep_versions={self._keep}) and "
                    f"{self._retiring()} evicted version(s) still being sent, and "
                    f"{scratch} bytes by replies queued to subscribers; publish refused "
                    f"(raise {BUDGET_NAME} or lower keep_versions)")
            time.sleep(0.01)
            self._recycle()
