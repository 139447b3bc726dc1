"""One rank's own receiver that fetches only this rank's slices of each version (issue 30).

Why: with node staging a replica's node receives every version whole through one
receiver. Here every rank runs its own ``WeightSubscriber`` with its own slice plan
(``apply/slice_plan.py``, recorded from this rank's weight loaders), so the ranks
pull their bytes in parallel and together about one version. The staged version
looks as always (full shapes; bytes outside the plan undefined, never read by this
rank's loaders) and goes to this rank's ``CommitCoordinator``: the commit stays
atomic across ranks because a version is committed only once every rank holds it.

A plan depends on the published names, shapes and dtypes (the *layout*). The first
plan comes from what the worker knows at start (the checkpoint's layout, else none:
then the first version is fetched whole); when a version starts arriving with
another layout, this receiver records the plan for it (cached by layout) and
restarts its subscription with it, on its own thread (``weightpub-slice-replan``):
the new subscription asks for the latest version at once (late join), so nothing
is missed. A staged version whose layout is not the plan's is never offered.

``receive: auto`` without a checkpoint layout at start decides at the first version
(``decide``): this receiver fetches it whole on its own subscription while the first
layout's plan is recorded; then either it slices from then on (replanning for later
layouts as above) or it stays whole for good: later layouts are not decided again.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from subscriber_ext.transport.staging.progress import PartialVersion
from subscriber_ext.transport.subscriber import WeightSubscriber
from subscriber_ext.transport.subscriber_options import SubscriberOptions
from subscriber_ext.vllm_ext.apply.slice_plan import SlicePlan
from subscriber_ext.vllm_ext.receive_choice import Layout
from weightpub_wire import slice_plan as wire_slices
from weightpub_wire.protocol import Manifest

__all__ = ["SliceReceiver", "layout_key", "manifest_layout"]

logger = logging.getLogger("weightpub.slices")
#: how long a replan's new subscription holds a staged version until it has taken over
#: (the old subscription's close is bounded by ``subscriber.CLOSE_WAIT_SECONDS``, 10 s)
SWITCH_WAIT_S = 15.0



def manifest_layout(manifest: Manifest) -> Layout:
    return tuple((e.name, e.dtype, tuple(int(n) for n in e.shape)) for e in manifest.tensors)


def layout_key(layout: Sequence[tuple[str, str, Sequence[int]]]) -> str:
    """What a plan depends on, as a short key (names, dtypes, shapes; order ignored)."""
    text = "\n".join(sorted(f"{n}|{d}|{','.join(map(str, s))}" for n, d, s in layout))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _LayoutWatch:
    """A ``ChunkListener``: hears each version start (or its refusal when the plan does not
    fit it), so another layout is noticed at once."""

    def __init__(self, owner: SliceReceiver, generation: int) -> None:
        self._owner = owner
        self._generation = generation  # which of the owner's subscriptions this one hears

    def target_started(self, manifest: Manifest) -> None:
        self._owner.layout_seen(manifest, self._generation)

    def chunk_verified(self, manifest: Manifest, chunk: int, data: memoryview) -> None:
        return None

    def target_completed(self, manifest: Manifest) -> None:
        return None

    def target_dropped(self, manifest: Manifest) -> None:
        return None

    def target_refused(self, manifest: Manifest) -> None:
        """The plan does not fit this version (it names a tensor the version lacks, or
        a run past a tensor's end): the same replan as for any other layout."""
        self._owner.layout_seen(manifest, self._generation)


class SliceReceiver:
    """This rank's ``VersionSource``: its own subscription, fetching its own slices.

    ``plan_for(layout)`` records (or returns the cached) plan of this rank for a
    layout; it may raise, and the receiver then fetches whole versions until the
    next layout (counted in ``status()["replan_failures"]``). ``layout``: the one
    expected first (None: unknown, the first version tells). ``decide(layout)``: given,
    the receiver has not decided yet whether to slice at all (``layout`` must be None):
    it is asked once, with the first layout seen; False: whole versions for good.
    """

    def __init__(self, endpoint: str, *, rank: int, label: str, options: SubscriberOptions,
                 plan_for: Callable[[Layout], SlicePlan],
                 on_version: Callable[[Any], None],
                 on_progress: Callable[[PartialVersion], None] | None = None,
                 layout: Layout | None = None,
                 decide: Callable[[Layout], bool] | None = None) -> None:
        if decide is not None and layout is not None:
            raise ValueError("SliceReceiver: decide is for a receiver without a layout yet")
        self.endpoint = endpoint
        self.rank = rank
        self.label = label  # the plan's layout tag: "tp2/rank0"
        self._options = options
        self._plan_for = plan_for
        self._on_version = on_version
        self._on_progress = on_progress
        self._lock = threading.Lock()
        self._closed = False
        self._key: str | None = None  # the layout the running subscription's plan is for
        self._plan: SlicePlan | None = None
        self._wanted: Layout | None = None  # a layout a replan thread will switch to
        self._replanner: threading.Thread | None = None
        self._generation = 0
        self.replans = 0
        self.replan_failures = 0
        self.last_replan_error: str | None = None
        self._applied: int | None = None
        self._decide = decide
        #: None: not decided yet (``decide``); True: slices; False: whole for good
        self.slicing: bool | None = None if decide is not None else True
        self._ready = threading.Event()  # a replan waits until the first subscription is ours
        self._subscriber, switched = self._subscribe(layout)
        switched.set()
        self._ready.set()

    # ------------------------------------------------------------ VersionSource
    def status(self) -> dict[str, Any]:
        with self._lock:
            sub, plan, key = self._subscriber, self._plan, self._key
        out = dict(sub.status())
        out["slices"] = {
            "label": self.label, "layout": key,
            "needed_bytes": plan.needed_bytes if plan else None,
            "total_bytes": plan.total_bytes if plan else None,
            "needed_fraction": round(plan.needed_bytes / plan.total_bytes, 4)
            if plan and plan.total_bytes else None,
            "whole": sorted(plan.whole) if plan else [],
            "replans": self.replans, "replan_failures": self.replan_failures,
            "last_replan_error": self.last_replan_error,
            "slicing": self.slicing,  # None: decides at the first version (``decide``)
        }
        return out

    def mark_applied(self, version: int, error: Any = None) -> None:
        with self._lock:
            sub = self._subscriber
            if not error:
                self._applied = version
        sub.mark_applied(version, error)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sub, replanner = self._subscriber, self._replanner
        sub.close()
        if replanner is not None:
            replanner.join(timeout=15)

    # ------------------------------------------------------------ layouts
    def layout_seen(self, manifest: Manifest, generation: int) -> None:
        """Subscriber thread: a version starts; another layout needs another plan."""
        layout = manifest_layout(manifest)
        with self._lock:
            if self._closed or self.slicing is False or generation != self._generation \
                    or layout_key(layout) == self._key \
                    or (self._wanted is not None and layout_key(self._wanted)
                        == layout_key(layout)):
                return
            self._wanted = layout
            if self._replanner is None:
                self._replanner = threading.Thread(target=self._replan,
                                                   name="weightpub-slice-replan", daemon=True)
                self._replanner.start()

    def _replan(self) -> None:
        """Replan thread: record the plan for the newest layout seen, then resubscribe."""
        self._ready.wait(timeout=60)
        while True:
            with self._lock:
                layout, self._wanted = self._wanted, None
                if layout is None or self._closed:
                    self._replanner = None
                    return
                decide, self._decide = self._decide, None
            if decide is not None and not self._decided(decide, layout):
                with self._lock:  # whole for good: the running subscription goes on
                    self._wanted = None
                    self._replanner = None
                return
            try:
                new, switched = self._subscribe(layout)
            except Exception:
                logger.exception("weightpub: rank %d could not resubscribe", self.rank)
                continue
            with self._lock:
                old, self._subscriber = self._subscriber, new
                closed, applied = self._closed, self._applied
            if closed:  # its versions go nowhere: let its thread end before closing it
                switched.set()
            try:
                old.close()
                if closed:
                    new.close()
                else:  # what runs here, and what the versions the old one staged cost
                    new.carry_from(old, applied)
                self.replans += 1
            finally:
                switched.set()  # its versions go out now, with the record carried over

    def _decided(self, decide: Callable[[Layout], bool], layout: Layout) -> bool:
        """Ask ``decide`` once, with the first layout; anything but True: whole."""
        try:
            slicing = decide(layout) is True
        except Exception:
            logger.exception("weightpub: rank %d could not decide how to receive", self.rank)
            slicing = False
        self.slicing = slicing
        return slicing

    def _subscribe(self, layout: Layout | None) -> tuple[WeightSubscriber, threading.Event]:
        """A subscription for ``layout``'s plan, and the event that lets its versions out
        (set once it has taken over: ``replans`` counted, the old record carried)."""
        plan: SlicePlan | None = None
        if layout is not None:
            try:
                plan = self._plan_for(layout)
            except Exception as exc:  # fetch whole versions of this layout: never too little
                self.replan_failures += 1
                self.last_replan_error = f"{type(exc).__name__}: {exc}"
                logger.warning("weightpub: rank %d slice plan failed (%s); whole tensors",
                               self.rank, exc)
        wire_plan = None if plan is None else wire_slices.from_ranges(self.label, plan.ranges)
        with self._lock:  # before it starts: its first version is judged by this plan
            self._generation += 1
            generation = self._generation
            self._plan = plan
            self._key = None if layout is None else layout_key(layout)
        switched = threading.Event()
        sub = WeightSubscriber(self.endpoint, options=self._options.replace(slice_plan=wire_plan),
                               on_version=lambda staged: self._deliver(staged, generation,
                                                                       switched),
                               on_progress=lambda partial: self._progress(partial, generation),
                               chunk_listener=_LayoutWatch(self, generation))
        sub.set_ranks((self.rank,))
        return sub, switched

    def _current(self, manifest: Manifest, generation: int) -> bool:
        """Whether a version came through the running subscription and fits its plan."""
        with self._lock:
            key, current = self._key, self._generation
        return generation == current and (key is None or key == layout_key(
            manifest_layout(manifest)))

    def _deliver(self, staged: Any, generation: int, switched: threading.Event) -> None:
        # a new subscription may stage a version before the replan thread has closed the
        # old one and carried its record over: that version waits (bounded by the old
        # one's close), so status never shows it without ``replans`` and the record
        deadline = time.monotonic() + SWITCH_WAIT_S
        while not switched.wait(timeout=0.1) and not self._closed \
                and time.monotonic() < deadline:
            pass  # a close meanwhile ends the wait: ``close`` waits for this thread
        if self._closed or not self._current(staged.manifest, generation):
            staged.release()
            return
        with self._lock:
            sub = self._subscriber if generation == self._generation else None
        if sub is not None:
            sub.settle()  # the carried record in place before anyone is told of the version
        self._on_version(staged)

    def _progress(self, partial: PartialVersion, generation: int) -> None:
        if self._on_progress is not None and self._current(partial.manifest, generation):
            self._on_progress(partial)
