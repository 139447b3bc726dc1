"""``PrepareBudget``: the bytes one rank's prepared shadows may hold, counted and shown.

Why: a prepared shadow (``prepare.py``) is a second copy of a layer's
kernel-format weights, held from its build until the commit swapped it in and the
old weights were freed; a replica preparing whole versions holds one to two extra
models that no staging budget sees. Each layer's shadow is charged here before it
is built (its checkpoint-format bytes, from vLLM's reload metadata); a layer that
does not fit is not prepared but written from the staged bytes at the commit
(``WeightApplier.swap``: the reload path, a longer pause, no extra copy). A
``Charge`` gives its bytes back when the prepared version holding it is dropped
(committed and retired, superseded, cancelled, failed).
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Charge", "PrepareBudget"]


class PrepareBudget:
    """A byte budget for shadows (``limit`` None: unbounded); thread-safe."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self.held = 0
        self.peak = 0
        self.layers_deferred = 0  # layers left to the commit because they did not fit

    def try_take(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` if they fit under the limit."""
        with self._lock:
            if self.limit is not None and self.held + nbytes > self.limit:
                self.layers_deferred += 1
                return False
            self.held += nbytes
            self.peak = max(self.peak, self.held)
            return True

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self.held = max(0, self.held - nbytes)

    @property
    def enabled(self) -> bool:
        """False when nothing can ever be prepared (a limit of 0)."""
        return self.limit is None or self.limit > 0

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"limit_bytes": self.limit, "held_bytes": self.held,
                    "peak_bytes": self.peak, "layers_deferred": self.layers_deferred}


class Charge:
    """Bytes one version's shadows took from a budget; returned when this object goes.

    Why an object: a version's shadows pass from its ``VersionPrep`` to its
    ``PreparedVersion`` and are freed wherever the last of them is dropped (the
    preparer thread, usually); both hold this, so the bytes come back exactly then.
    """

    def __init__(self, budget: PrepareBudget | None) -> None:
        self.budget = budget
        self.nbytes = 0

    def take(self, nbytes: int) -> bool:
        if self.budget is None:
            return True
        if not self.budget.try_take(nbytes):
            return False
        self.nbytes += nbytes
        return True

    def release(self) -> None:
        if self.budget is not None and self.nbytes:
            self.budget.give_back(self.nbytes)
        self.nbytes = 0

    def __del__(self) -> None:
        self.release()
