"""``update_weights`` waits beside the engine's step loop, never inside it.

Why: vLLM's ``update_weights`` RPC means "every rank runs version >= v" with the
``weightpub`` backend, and v may not even be published yet. The engine core
handles a client's RPC on its busy-loop thread, between two steps; a wait there
stops every request and every other RPC until the version arrives (issue 28: a
generate call and a status RPC hung for 55 s). vLLM's engine core defers a
utility call that returns a ``concurrent.futures.Future`` until the future is
done (``EngineCoreProc._invoke_utility_method``), so the call becomes one entry
here: the step loop keeps running, and each pass (``serve``, from the step and
idle hooks in ``vllm_patches``) commits what every rank holds and finishes the
entries whose version is live or whose time is up, by forwarding the RPC to the
workers, which check and name each rank's state.

Bounds: a timeout above ``MAX_TIMEOUT_S`` is refused before anything waits (the
workers' parser names it); at most ``MAX_WAITING`` calls wait at once (one more is
refused with ``WeightPubError``). An engine core that cannot defer a call (an
in-process engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) waits on its own thread
at most ``BLOCKING_WAIT_S``; so do the workers of a replica without the engine
driver (``weight_transfer_backend``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from weightpub_wire.errors import WeightPubError

__all__ = ["BLOCKING_WAIT_S", "MAX_TIMEOUT_S", "MAX_WAITING", "WAIT_POLL_S", "UpdateWaits"]

logger = logging.getLogger("weightpub.engine")

#: the longest ``timeout`` an ``update_weights`` call may ask for (one day)
MAX_TIMEOUT_S = 86400.0
#: the longest a wait may hold the step loop where it cannot be deferred
BLOCKING_WAIT_S = 5.0
#: calls waiting at once (each holds a future and a few numbers)
MAX_WAITING = 64
#: how often an idle engine looks at its waits when nothing else wakes it
WAIT_POLL_S = 0.05


@dataclass(eq=False, slots=True)
class _Wait:
    version: int
    deadline: float
    future: Future[Any]
    finish: Callable[[], Any]  # forwards the RPC to the workers (they check, or raise)


class UpdateWaits:
    """The ``update_weights`` calls an engine core has deferred; used on its busy-loop thread."""

    def __init__(self) -> None:
        self._waits: list[_Wait] = []
        self.finished = 0

    def __len__(self) -> int:
        return len(self._waits)

    def add(self, version: int, wait_s: float, finish: Callable[[], Any]) -> Future[Any]:
        """Defer one call; ``finish`` runs on a later pass once ``version`` is live or
        ``wait_s`` has passed, and its result (or error) completes the returned future."""
        if len(self._waits) >= MAX_WAITING:
            raise WeightPubError(f"weightpub: {len(self._waits)} update_weights calls are "
                                 f"waiting already (at most {MAX_WAITING}); wait for one to "
                                 "return")
        future: Future[Any] = Future()
        self._waits.append(_Wait(version, time.monotonic() + wait_s, future, finish))
        return future

    def serve(self, live: int | None, stop: bool = False) -> None:
        """Finish every wait whose version is ``live`` (or older), whose time is up, or all
        of them when ``stop`` (the weights are offloaded: nothing can commit)."""
        if not self._waits:
            return
        now = time.monotonic()
        due = [w for w in self._waits
               if stop or now >= w.deadline or (live is not None and live >= w.version)]
        for wait in due:
            self._waits.remove(wait)
            self.finished += 1
            try:
                wait.future.set_result(wait.finish())
            except Exception as exc:  # the workers' error (named), handed to the caller
                wait.future.set_exception(exc)

    def poll_s(self, idle_poll: float | None) -> float | None:
        """How long an idle engine may block before it must look again (None: no bound)."""
        if not self._waits:
            return idle_poll
        soonest = min(w.deadline for w in self._waits) - time.monotonic()
        bound = max(0.0, min(WAIT_POLL_S, soonest))
        return bound if idle_poll is None else min(idle_poll, bound)
