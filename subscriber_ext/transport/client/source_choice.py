"""Which ``ChunkSource``s serve a version: chosen once per manifest, by pickers in order.

Why a registry of pickers instead of branches in the fetch loop: the kinds of
source grow (publisher, sharded trainer ranks, peers; slice sources and NIXL
readers next), and each one knows by itself which manifests it can serve. A
picker (``chunk_source.SourcePicker``) looks at a manifest and returns its
sources, or None. Pickers are asked in order; an answer counts only if all its
sources are ``usable``; first sources in an answer join the client's own (peers)
and the search goes on; the first answer with serving sources ends it, and when
none has any, the publisher serves. First sources are asked ahead of whichever
serving sources were picked. New sources are put on the
client's poller when first picked; a source takes itself off when it closes.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import zmq

from subscriber_ext.transport.staging.chunk_source import ChunkSource, SourcePicker, SourceSink
from weightpub_wire import protocol as wire

__all__ = ["SourceChoice"]


class SourceChoice:
    """The pickers, the first sources, and the sources picked for the current manifest."""

    def __init__(self, pickers: Sequence[SourcePicker], fallback: ChunkSource,
                 sink: SourceSink, firsts: Sequence[ChunkSource] = ()) -> None:
        """``pickers``: asked in order; ``fallback``: the serving source when none of them
        answers (the publisher); ``sink``: the client's, handed to every picker;
        ``firsts``: asked before every serving source (peers)."""
        self.pickers = list(pickers)
        self.sink = sink
        self.fallback = fallback
        self.firsts = list(firsts)
        self._manifest: wire.Manifest | None = None
        self._picked_firsts: list[ChunkSource] = []
        self._serving: list[ChunkSource] = [fallback]
        self._poller: zmq.Poller | None = None
        self._registered: weakref.WeakSet[ChunkSource] = weakref.WeakSet()

    def sources(self, manifest: wire.Manifest) -> tuple[list[ChunkSource], list[ChunkSource]]:
        """(first sources, serving sources) of ``manifest``, picked on its first call."""
        if manifest is not self._manifest:
            self._manifest = manifest
            self._picked_firsts, self._serving = self._pick(manifest)
            for source in (*self._picked_firsts, *self._serving):
                self._register(source)
        return [*self.firsts, *self._picked_firsts], self._serving

    def serving(self, manifest: wire.Manifest) -> list[ChunkSource]:
        return self.sources(manifest)[1]

    def _pick(self, manifest: wire.Manifest) -> tuple[list[ChunkSource], list[ChunkSource]]:
        firsts: list[ChunkSource] = []
        for picker in self.pickers:
            sources = picker(manifest, self.sink)
            if not sources or not all(source.usable(manifest) for source in sources):
                continue
            firsts += [source for source in sources if source.first]
            serving = [source for source in sources if not source.first]
            if serving:
                return firsts, serving
        return firsts, [self.fallback]

    def live(self) -> list[ChunkSource]:
        """Every source that may have requests out: the firsts, the current serving
        sources and the fallback (each once, in that order)."""
        out: list[ChunkSource] = []
        for source in (*self.firsts, *self._picked_firsts, *self._serving, self.fallback):
            if source not in out:
                out.append(source)
        return out

    def close(self) -> None:
        """Close every picker that has a ``close`` (they close the sources they made)."""
        self._manifest = None
        self._picked_firsts, self._serving = [], [self.fallback]
        for picker in self.pickers:
            close = getattr(picker, "close", None)
            if callable(close):
                close()

    # -- the poller ----------------------------------------------------------------------------
    def register(self, poller: zmq.Poller) -> None:
        self._poller = poller
        for source in self.live():
            self._register(source)

    def _register(self, source: ChunkSource) -> None:
        if self._poller is not None and source not in self._registered:
            source.register(self._poller)
            self._registered.add(source)

    def on_events(self, events: dict[Any, int], now: float) -> None:
        for source in self.live():
            source.on_events(events, now)
