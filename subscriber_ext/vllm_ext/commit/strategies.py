"""When every rank of a replica commits: the two ways ranks agree on a version.

Why two: only the engine core sees the scheduler, so when our vLLM plugin is
loaded it decides (``EngineDriven``): each rank advertises what it holds in a
shared-memory slot and the engine, before scheduling a step, names the version
every rank commits. Without the plugin (``WEIGHTPUB_ENGINE_DRIVER=0``, no
``/dev/shm``, or a world that is not TP x PP) the ranks agree among themselves
at the start of ``execute_model`` with one tiny all_gather on vLLM's CPU groups
(``RankAgreement``). Either way every rank commits the same version before the
same step; the ``CommitCoordinator`` that holds the versions does not care which.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from subscriber_ext.vllm_ext.commit.shared_slots import SlotWriter, fence, pid_hash

__all__ = ["CommitStrategy", "EngineDriven", "RankAgreement"]

Commit = Callable[[int], object]


class CommitStrategy(Protocol):
    """Decides when the coordinator commits, and which version."""

    driven: bool
    collectives: int

    def advertise(self, publisher_id: str | None, applied: int | None,
                  held: list[int]) -> None:
        """The versions this rank could commit now changed (called under the holder's lock)."""

    def intent(self) -> int | None:
        """A version an outside driver is committing right now; it must not be released."""

    def before_step(self, commit: Commit) -> None:
        """Start of every ``execute_model``: commit here if this strategy decides per step."""

    def commit_now(self, commit: Commit) -> None:
        """``commit_pending()``: make the newest version every rank holds live, now."""


class EngineDriven:
    """The engine core decides (``commit.vllm_patches``); ranks only advertise.

    The engine commits before it forwards our RPCs and before each step, so
    nothing is left to do here: no per-step work, no collective.
    """

    driven = True
    collectives = 0

    def __init__(self, slot: SlotWriter) -> None:
        self.slot = slot

    def advertise(self, publisher_id: str | None, applied: int | None,
                  held: list[int]) -> None:
        self.slot.write(pid_hash(publisher_id), applied, held)

    def intent(self) -> int | None:
        fence()  # our advertisement is visible before we read the engine's intent
        value = self.slot.table.intent
        return None if value < 0 else value

    def before_step(self, commit: Commit) -> None:
        return None

    def commit_now(self, commit: Commit) -> None:
        return None


class RankAgreement:
    """Ranks agree among themselves on vLLM's CPU (gloo) groups, TP then PP.

    A world of one needs no collective and only looks when something new was
    offered; a larger world runs one all_gather of ``keep`` int64 per group and
    step, because every rank must join the same collectives in the same order.
    """

    driven = False

    def __init__(self, groups: Sequence[Any], keep: int) -> None:
        self._groups = [g for g in groups if g is not None and g.size() > 1]
        self._world = 1
        for group in self._groups:
            self._world *= group.size()
        self._keep = max(1, keep)
        self._held: list[int] = []
        self._dirty = False
        self.collectives = 0

    def advertise(self, publisher_id: str | None, applied: int | None,
                  held: list[int]) -> None:
        self._held = list(held)
        self._dirty = True

    def intent(self) -> int | None:
        return None

    def before_step(self, commit: Commit) -> None:
        if self._world == 1 and not self._dirty:
            return
        self.commit_now(commit)

    def commit_now(self, commit: Commit) -> None:
        self._dirty = False
        choice = self._agree(list(self._held))
        if choice is not None:
            commit(choice)

    def _agree(self, mine: list[int]) -> int | None:
        if self._world == 1:
            return max(mine) if mine else None
        common = set(mine)
        for group in self._groups:
            slots = [-1] * self._keep
            for i, v in enumerate(sorted(common, reverse=True)[: self._keep]):
                slots[i] = v
            local = torch.tensor(slots, dtype=torch.int64)
            gathered = [torch.empty_like(local) for _ in range(group.size())]
            torch.distributed.all_gather(gathered, local, group=group)
            self.collectives += 1
            common = set(gathered[0].tolist())
            for other in gathered[1:]:
                common &= set(other.tolist())
            common.discard(-1)
        return max(common) if common else None
