"""Hold one rank's staged versions and commit exactly the version a strategy names.

Why: a replica must never run a half-updated model. The subscriber stages
versions on each rank independently (its own thread); this class keeps the
newest ``keep`` of them, optionally prepares each off the step path, and
commits one when its ``CommitStrategy`` (``strategies.py``) says so: the
engine core (engine-driven) or the ranks' own agreement. Every rank then
commits the same version before the same step.

vLLM 0.32 splits a step into ``execute_model`` (may return None) and
``sample_tokens``; a worker runs its RPCs strictly in order, so the start of
``execute_model`` (and any RPC of ours) is between two steps on that rank.

A version the engine announced as its ``intent`` is never released before the
commit, so every rank still holds it when the engine's commit RPC arrives.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from subscriber_ext.vllm_ext.apply.prepare import PreparedVersion
from subscriber_ext.vllm_ext.apply.preparer import Preparer
from subscriber_ext.vllm_ext.apply.progressive import VersionPrep
from subscriber_ext.vllm_ext.commit.shared_slots import pid_hash
from subscriber_ext.vllm_ext.commit.strategies import CommitStrategy
from weightpub_wire.heap_trim import HeapTrimmer

__all__ = ["CommitCoordinator", "StagedLike"]

logger = logging.getLogger("weightpub.commit")


class StagedLike(Protocol):
    """What the transport hands over (``subscriber_ext.transport.StagedVersion``); read only."""

    @property
    def version(self) -> int: ...
    @property
    def publisher_id(self) -> str: ...
    @property
    def tensors(self) -> dict[str, torch.Tensor]: ...
    @property
    def total_bytes(self) -> int: ...

    def release(self) -> None: ...


def is_adapters(staged: Any) -> bool:
    """A version of LoRA adapters (``Manifest.adapters``): committed by ``apply_adapters``,
    never prepared (nothing to build off the step path: a few MB)."""
    return bool(getattr(getattr(staged, "manifest", None), "adapters", None))


def _release(staged: StagedLike) -> None:
    try:
        staged.release()
    except Exception:
        logger.exception("weightpub: release of version %s failed", staged.version)


class CommitCoordinator:
    """Holds the last ``keep`` staged versions of one rank and commits them.

    ``apply`` is called with the staged tensors (``WeightApplier.apply``).
    ``on_commit`` runs after a successful commit and ``on_failure`` after a
    rejected one (the extension forwards both to the publisher).

    ``prepare`` (optional, ``WeightApplier.prepare``-like) builds a version's
    kernel-format state on a background thread; a version is then advertised as
    committable only once that attempt finished, and its commit calls
    ``apply_prepared(prepared, staged.tensors)`` (a swap; the staged tensors write the
    layers a prepare budget left out) instead of ``apply``. A failed preparation falls
    back to ``apply`` at commit. ``prepare_policy="auto"`` prepares only while the
    engine is busy (a step ran in the last ``BUSY_WINDOW_S``): an idle engine has
    no step loop to stall and reaches the new version sooner by a direct reload.

    ``start_progressive`` (optional, ``WeightApplier.start_progressive``-like) lets
    the preparer build each layer while the version is still arriving (``progress``,
    from the transport); such a version is prepared busy or idle, since most of the
    work is done by the time its last byte is verified, and its commit only swaps.

    ``apply_adapters`` (optional) commits a version of LoRA adapters (``is_adapters``)
    instead of ``apply``: through the same strategy, so every rank switches at one step.
    """

    BUSY_WINDOW_S = 0.5

    def __init__(
        self,
        apply: Callable[[dict[str, torch.Tensor]], Any],
        strategy: CommitStrategy,
        *,
        keep: int = 2,
        log_size: int = 4096,
        on_commit: Callable[[int], None] | None = None,
        on_failure: Callable[[int, Exception], None] | None = None,
        prepare: Callable[[StagedLike], PreparedVersion] | None = None,
        apply_prepared: Callable[[PreparedVersion, dict[str, torch.Tensor]], Any] | None = None,
        prepare_policy: str = "auto",
        start_progressive: Callable[[Any], VersionPrep | None] | None = None,
        trim_heap: bool = True,
        apply_adapters: Callable[[StagedLike], Any] | None = None,
    ) -> None:
        self._apply = apply
        self._apply_adapters = apply_adapters
        self.strategy = strategy
        self._keep = max(1, keep)
        self._lock = threading.Lock()
        self._held: collections.OrderedDict[int, StagedLike] = collections.OrderedDict()
        self._on_commit = on_commit
        self._on_failure = on_failure
        self.applied_version: int | None = None
        self.applied_data_path: str | None = None  # how the applied version reached the node
        self.publisher_id: str | None = None
        self.last_error: str | None = None
        self.step = 0
        self.commit_log: collections.deque[dict[str, Any]] = collections.deque(maxlen=log_size)
        self.commit_count = 0
        self.last_commit_s: float | None = None
        self._failed: set[int] = set()
        self._pinned: dict[int, StagedLike] = {}  # dropped, but the engine's intent: kept
        self._unready: set[int] = set()  # held, preparation still running
        self._prepare_policy = prepare_policy
        self._last_step_at = float("-inf")
        self._apply_prepared = apply_prepared
        self._preparer: Preparer | None = None
        self._offered_at: dict[int, float] = {}  # version -> when it was staged here
        #: gives the heap memory each commit frees back to the OS (``weightpub_wire/heap_trim.py``)
        self.heap_trim = HeapTrimmer(trim_heap)
        if prepare is not None and apply_prepared is not None:
            self._preparer = Preparer(prepare, self._on_prepared, start_progressive,
                                      after_free=self.heap_trim.request)
        self._advertise_locked()

    @property
    def driven(self) -> bool:
        return self.strategy.driven

    # --------------------------------------------------------- producer side
    def progress(self, partial: Any) -> None:
        """Transport thread: a version still arriving (``transport.progress.PartialVersion``)."""
        preparer = self._preparer
        if preparer is None or not preparer.progressive or is_adapters(partial):
            return
        with self._lock:
            if self.applied_version is not None and partial.version <= self.applied_version \
                    and partial.publisher_id == self.publisher_id:
                return
        preparer.progress(partial)

    def offer(self, staged: StagedLike) -> None:
        """Called from the subscriber thread with a complete, verified version."""
        with self._lock:
            dropped: list[StagedLike] = []
            if self.publisher_id is not None and staged.publisher_id != self.publisher_id:
                # a restarted publisher counts versions from its own start
                dropped.extend(self._held.values())
                self._held.clear()
                self._failed.clear()  # version numbers of the old publisher mean nothing now
                self.applied_version = None
            submit = False
            if (self.applied_version is not None and staged.version <= self.applied_version) or (
                staged.version in self._held
            ):
                _release(staged)
            else:
                self._held[staged.version] = staged
                self._held = collections.OrderedDict(sorted(self._held.items()))
                while len(self._held) > self._keep:
                    dropped.append(self._held.popitem(last=False)[1])
                self.publisher_id = staged.publisher_id
                self._offered_at[staged.version] = time.monotonic()
                while len(self._offered_at) > 16:  # bounded, whatever never commits
                    self._offered_at.pop(next(iter(self._offered_at)))
                if self._preparer is not None and staged.version in self._held and \
                        not is_adapters(staged) and (
                        self._busy() or self._preparer.has_progress(
                            staged.publisher_id, staged.version,
                            getattr(staged, "attempt", 0))):
                    self._unready.add(staged.version)
                    submit = True
            for d in dropped:
                self._unready.discard(d.version)
            self._advertise_locked()
            self._release_or_pin_locked(dropped)
        if self._preparer is not None:
            for d in dropped:
                self._preparer.discard(d.version)
            if submit:
                self._preparer.submit(staged)

    def _busy(self) -> bool:
        if self._prepare_policy == "always":
            return True
        return time.monotonic() - self._last_step_at < self.BUSY_WINDOW_S

    def _on_prepared(self, version: int) -> None:
        """Preparer thread: the attempt for ``version`` ended; it may be committed now."""
        with self._lock:
            if version in self._unready:
                self._unready.discard(version)
                self._advertise_locked()

    def _advertise_locked(self) -> None:
        held = [v for v in self._held if v not in self._failed and v not in self._unready]
        self.strategy.advertise(self.publisher_id, self.applied_version, held)

    def _release_or_pin_locked(self, dropped: list[StagedLike]) -> None:
        """Release dropped versions, except the one the engine is committing right now.

        Why: the engine reads the slots, writes ``intent`` and reads again before the
        RPC; we advertise the drop first and read ``intent`` after (with a fence), so
        either the engine sees the version gone or we see the intent and keep it.
        """
        if not dropped:
            return
        intent = self.strategy.intent()
        for staged in dropped:
            if staged.version == intent:
                old = self._pinned.pop(staged.version, None)
                if old is not None and old is not staged:
                    _release(old)
                self._pinned[staged.version] = staged
            else:
                _release(staged)

    def staged_version(self) -> int | None:
        with self._lock:
            return next(reversed(self._held)) if self._held else None

    # --------------------------------------------------------- step side
    def before_step(self) -> None:
        """Run at the start of every ``execute_model``."""
        self.step += 1
        self._last_step_at = time.monotonic()
        self.strategy.before_step(self.commit)

    def commit_pending(self) -> int | None:
        """Make the newest version every rank holds live now; returns the applied version."""
        self.strategy.commit_now(self.commit)
        return self.applied_version

    def commit(self, version: int, publisher_hash: int | None = None) -> int | None:
        """Apply exactly ``version`` (named by the strategy or the engine); no collective.

        Returns the applied version afterwards (``version`` on success).
        """
        with self._lock:
            staged = self._held.get(version)
            if staged is not None and publisher_hash not in (None, pid_hash(self.publisher_id)):
                staged = None
            if staged is None:
                staged = self._pinned.get(version)
        if staged is None:
            if self.applied_version != version:
                self.last_error = f"version {version}: not staged on this rank"
                logger.error("weightpub: asked to commit version %d, not staged here", version)
            return self.applied_version
        self._commit(version, staged)
        return self.applied_version

    def _commit(self, choice: int, staged: StagedLike) -> None:
        prepared = None
        adapters = is_adapters(staged)
        if self._preparer is not None and not adapters:
            prepared = self._preparer.take(choice, staged.publisher_id)
            if prepared is None:
                # idle engine (prepare="auto"), or preparation failed (logged by the preparer)
                logger.info("weightpub: version %d not prepared; reloading at commit", choice)
        start = time.perf_counter()
        try:
            if adapters:
                if self._apply_adapters is None:
                    raise ValueError("a version of LoRA adapters, and this rank applies "
                                     "none (no adapter handler)")
                self._apply_adapters(staged)
            elif prepared is not None and self._apply_prepared is not None:
                self._apply_prepared(prepared, staged.tensors)
            else:
                self._apply(staged.tensors)
        except Exception as exc:  # any failure: keep the old weights, report, go on
            self._fail(choice, exc)
            return
        self.last_commit_s = time.perf_counter() - start
        with self._lock:
            self.applied_version = choice
            self.applied_data_path = getattr(staged, "data_path", None)
            self.last_error = None
            if self.publisher_id != staged.publisher_id:  # a pinned version of an old publisher
                self.applied_version = None
            for v in [v for v in self._held if v <= choice]:
                _release(self._held.pop(v))
            for pinned in self._pinned.values():
                _release(pinned)
            self._pinned.clear()
            self.commit_count += 1
            offered = self._offered_at.pop(choice, None)
            for v in [v for v in self._offered_at if v <= choice]:
                del self._offered_at[v]
            self.commit_log.append({
                "step": self.step, "version": choice, "seconds": self.last_commit_s,
                "prepared": prepared is not None, "data_path": self.applied_data_path,
                # the work of turning staged bytes into weights, on or off the step path
                "apply_seconds": prepared.seconds if prepared is not None
                else self.last_commit_s,
                # layers prepared while the version was still arriving
                "early_layers": prepared.early_layers if prepared is not None else 0,
                # layers past the prepare budget, written from staging in this pause
                "deferred_layers": len(prepared.deferred) if prepared is not None else 0,
                # from "complete and verified here" to "live": preparation + waiting
                "staged_to_commit_s": None if offered is None
                else time.monotonic() - offered,
            })
            self._unready = {v for v in self._unready if v > choice}
            self._advertise_locked()
        logger.info("weightpub committed version %d before step %d in %.3f s", choice,
                    self.step, self.last_commit_s)
        if self._preparer is not None:
            if prepared is not None:
                self._preparer.retire(prepared)  # it holds the old weights: free them there
            del prepared
            self._preparer.discard_upto(choice)
        self.heap_trim.request()  # the reload's transients (or the retired weights, later)
        if self._on_commit is not None:
            self._on_commit(choice)

    def _fail(self, version: int, exc: Exception) -> None:
        self.last_error = f"version {version}: {exc}"
        logger.error("weightpub: version %d not applied, keeping old weights: %s", version, exc)
        with self._lock:
            self._failed.add(version)
            self._unready.discard(version)
            staged = self._held.pop(version, None)
            pinned = self._pinned.pop(version, None)
            self._advertise_locked()
        for s in (staged, pinned):
            if s is not None:
                _release(s)
        if self._preparer is not None:
            self._preparer.discard(version)
        if self._on_failure is not None:
            self._on_failure(version, exc)

    def drop_staged(self) -> None:
        """Release every staged (uncommitted) version; the applied version stays known."""
        with self._lock:
            while self._held:
                _release(self._held.popitem()[1])
            while self._pinned:
                _release(self._pinned.popitem()[1])
            self._unready.clear()
            self._advertise_locked()
        if self._preparer is not None:
            self._preparer.discard_upto(2**62)

    def close(self) -> None:
        """``drop_staged`` and stop the preparer thread; the coordinator is done."""
        self.drop_staged()
        if self._preparer is not None:
            self._preparer.close()
        self.heap_trim.close()

    def prepare_status(self) -> dict[str, Any] | None:
        """Preparer state for ``weight_status`` (None when preparation is off)."""
        p = self._preparer
        if p is None:
            return None
        with self._lock:
            unready = sorted(self._unready)
        return {
            "preparing": unready,
            "prepared": p.prepared_versions(),
            "failures": p.failures,
            "last_error": p.last_error,
            "early_layers": p.early_layers,  # built while their version arrived, in all
        }
