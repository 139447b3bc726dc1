"""The background thread that prepares versions off the step path, newest wins.

Two kinds of work arrive in order on one queue: a version still arriving
(``progress``: build each layer whose tensors are final, ``progressive.py``) and a
complete version (``submit``: finish what the partial work left, or build it
all). The result waits in ``take`` for the commit; anything superseded, failed
or cancelled is dropped. Work for a version runs only while someone still
wants it, and every shadow is freed on this thread, never on the step path.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from subscriber_ext.vllm_ext.apply.prepare import PreparedVersion
from subscriber_ext.vllm_ext.apply.progressive import VersionPrep

__all__ = ["Preparer"]

logger = logging.getLogger("weightpub.prepare")

PROGRESSIVE_KEPT = 2  # versions prepared while arriving, at most, at once (memory)
_PENDING = object()  # announced by ``progress``, not started yet
Key = tuple[str, int, int]  # (publisher_id, version, attempt)


@dataclass
class _Retired:
    prepared: PreparedVersion


@dataclass
class _Progress:
    partial: Any  # ``transport.progress.PartialVersion``-like


class Preparer:
    """One background thread preparing offered versions, newest wins.

    ``build(staged)`` returns a ``PreparedVersion`` (or raises: the version is then
    committed by the reload path). ``on_done(version)`` is called after each
    attempt, success or not, so the coordinator can advertise the version.
    ``start(partial)`` (optional) returns a ``VersionPrep`` for a version still
    arriving, or None when it cannot be prepared layer by layer.
    """

    def __init__(
        self,
        build: Callable[[Any], PreparedVersion],
        on_done: Callable[[int], None],
        start: Callable[[Any], VersionPrep | None] | None = None,
        after_free: Callable[[], None] | None = None,
    ) -> None:
        self._build = build
        self._after_free = after_free  # e.g. ``HeapTrimmer.request``
        self._on_done = on_done
        self._start = start
        self._lock = threading.Lock()
        self._ready: dict[int, PreparedVersion] = {}
        self._wanted: set[int] = set()
        self._progressive: dict[Key, Any] = {}  # VersionPrep, _PENDING or None (not possible)
        self._queue: queue.Queue[Any] = queue.Queue()
        self.failures = 0
        self.last_error: str | None = None
        self.early_layers = 0  # layers built while their version was arriving, in all
        self._thread = threading.Thread(target=self._run, name="weightpub-apply-prepare",
                                        daemon=True)
        self._thread.start()

    @property
    def progressive(self) -> bool:
        return self._start is not None

    def progress(self, partial: Any) -> None:
        """A version still arriving (transport thread): prepare its final layers now."""
        if self._start is None:
            return
        key = (partial.publisher_id, partial.version, partial.attempt)
        with self._lock:
            if partial.cancelled:
                self._progressive.pop(key, None)
                return
            if key not in self._progressive:
                self._progressive[key] = _PENDING
                while len(self._progressive) > PROGRESSIVE_KEPT:
                    self._progressive.pop(next(iter(self._progressive)))
        self._queue.put(_Progress(partial))

    def has_progress(self, publisher_id: str, version: int, attempt: int) -> bool:
        """Whether layers of this reception are (being) prepared while it arrives."""
        with self._lock:
            state = self._progressive.get((publisher_id, version, attempt))
        return state is not None

    def submit(self, staged: Any) -> None:
        with self._lock:
            self._wanted.add(staged.version)
        self._queue.put(staged)

    def take(self, version: int, publisher_id: str | None) -> PreparedVersion | None:
        """The prepared state of ``version`` (removed from here), or None."""
        with self._lock:
            self._wanted.discard(version)
            got = self._ready.pop(version, None)
        if got is not None and got.publisher_id != publisher_id:
            return None
        return got

    def discard(self, version: int) -> None:
        """Free the shadow of a superseded / failed version (or stop preparing it)."""
        self.discard_upto(version, only=True)

    def discard_upto(self, version: int, *, only: bool = False) -> None:
        def gone(v: int) -> bool:
            return v == version if only else v <= version

        with self._lock:
            self._wanted = {v for v in self._wanted if not gone(v)}
            for v in [v for v in self._ready if gone(v)]:
                del self._ready[v]
            for key in [k for k in self._progressive if gone(k[1])]:
                del self._progressive[key]

    def retire(self, prepared: PreparedVersion) -> None:
        """Drop a swapped-in version (and the old weights it holds) on this thread.

        Why: freeing a model's worth of tensors and kernel handles takes tens of ms.
        """
        self._queue.put(_Retired(prepared))

    def prepared_versions(self) -> list[int]:
        with self._lock:
            return sorted(self._ready)

    def close(self) -> None:
        with self._lock:
            self._wanted.clear()
            self._ready.clear()
            self._progressive.clear()
        self._queue.put(None)

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, _Retired):
                del job
                self._freed()
                continue
            if isinstance(job, _Progress):
                self._advance(job.partial)
                continue
            self._complete(job)
            self._freed()  # the preparation's transient tensors

    def _freed(self) -> None:
        if self._after_free is not None:
            self._after_free()

    def _advance(self, partial: Any) -> None:
        """Build every layer of ``partial`` whose tensors are final and not built yet."""
        key = (partial.publisher_id, partial.version, partial.attempt)
        with self._lock:
            state = self._progressive.get(key)
        if state is _PENDING and self._start is not None:
            try:
                state = self._start(partial)
            except Exception as exc:
                logger.warning("weightpub: version %d cannot be prepared while it arrives: %s",
                               partial.version, exc)
                state = None
            with self._lock:
                if key not in self._progressive:
                    return  # discarded or cancelled meanwhile
                self._progressive[key] = state
        if not isinstance(state, VersionPrep):
            return
        for layer in state.ready_layers(set(partial.ready())):
            with self._lock:
                current = self._progressive.get(key) is state
            if not current or partial.cancelled:
                return  # superseded or given up: what was built is dropped with it
            try:
                state.build(layer, partial.tensors, early=True)
            except Exception as exc:
                logger.warning("weightpub: preparing %s of version %d failed; the version "
                               "is prepared again once complete: %s", layer, partial.version,
                               exc)
                with self._lock:
                    if key in self._progressive:
                        self._progressive[key] = None
                return

    def _complete(self, staged: Any) -> None:
        version = staged.version
        key = (staged.publisher_id, version, getattr(staged, "attempt", 0))
        with self._lock:
            state = self._progressive.pop(key, None)
            if version not in self._wanted:
                return
        try:
            if isinstance(state, VersionPrep):
                prepared = state.finish(staged.tensors)  # the same bytes the partial showed
            else:
                prepared = self._build(staged)
        except Exception as exc:
            self.failures += 1
            self.last_error = f"version {version}: {exc}"
            logger.warning(
                "weightpub: preparing version %d failed, it will be reloaded at commit: %s",
                version, exc,
            )
            prepared = None
        if prepared is not None:
            with self._lock:
                if version in self._wanted:
                    self._ready[version] = prepared
                    self.early_layers += prepared.early_layers
            logger.info(
                "weightpub: prepared version %d (%d layers, %d while arriving, %.1f MB) in "
                "%.3f s", version, len(prepared.swaps), prepared.early_layers,
                prepared.nbytes / 1e6, prepared.seconds,
            )
        del prepared, state
        try:
            self._on_done(version)
        except Exception:
            logger.exception("weightpub: on_done of version %d failed", version)
