"""The slices a sliced member's peer server gathered: gathered once, served many times.

Why: a plan's bytes of a chunk lie scattered in the member's sparse staging (a row
range of every tensor the chunk holds); serving them to a peer takes a gather, a copy of
only those bytes (about 1 ms/MiB of CPU). The server looks a chunk up again on every
pass while the asking client's pipe is full, and every same-plan peer asks for the same
slices, so without a cache one slice is gathered many times.

What is kept: a slice more than one ask may want. The member says whether more than one
other member of its plan may ask it (``put(keep=True)``: the tracker's group of the plan
is above two); else a slice is kept only once it is asked again (a re-ask, or another
asker), the keys of slices gathered once being remembered (no bytes). Keeping every
slice in a pair of members costs about a tenth more serving CPU (kept arrays are pages
the allocator cannot reuse) for no hit. The gathered bytes are keyed by (publisher,
version, plan, chunk), least recently used first out. They are only ever verified bytes
(the lookup gathers a chunk once it matched its sums), and a version's bytes never
change while it is held, so an entry is right as long as its version is held; ``keep``
drops the entries of every other version (the member calls it when a version starts,
completes or is dropped) and the lookup serves an entry only for a version it still
holds.

Bounds: ``max_bytes`` (and ``max_entries``); every kept byte is counted in the
subscriber's staging budget (``BufferPool.hold``): a slice the budget has no room for is
served but not kept, and the pool sheds the whole cache (``clear``) before a version
would wait for staging memory. An entry evicted while ZeroMQ still sends it stays alive
through that send until it ends (no longer counted here; the server's
``max_queued_bytes`` bounds such bytes). Used on the subscriber's thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from weightpub_wire.buffers import BufferPool

__all__ = ["SliceCache", "SliceKey"]

#: (publisher_id, version, plan digest, chunk)
SliceKey = tuple[str, int, str, int]


class SliceCache:
    """Gathered slices, bounded in bytes and entries, counted in a pool's budget."""

    def __init__(self, max_bytes: int, pool: BufferPool | None = None, *,
                 max_entries: int = 4096) -> None:
        if max_bytes < 0 or max_entries < 1:
            raise ValueError(f"SliceCache: max_bytes {max_bytes} must be >= 0 and max_entries "
                             f"{max_entries} >= 1")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.pool = pool
        self._entries: OrderedDict[SliceKey, np.ndarray] = OrderedDict()
        self._seen: OrderedDict[SliceKey, None] = OrderedDict()  # gathered once, not kept
        self.nbytes = 0
        self.hits = 0
        self.misses = 0  # each one a gather
        self.not_kept = 0  # gathered but not kept: over max_bytes, or no room in the budget
        self.sheds = 0  # times the pool took the whole cache back for staging

    def get(self, key: SliceKey) -> memoryview | None:
        """The kept bytes of ``key`` (a hit), or None (a miss: gather, then ``put``)."""
        data = self._entries.get(key)
        if data is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return memoryview(data.data).cast("B")

    def put(self, key: SliceKey, data: np.ndarray, keep: bool = True) -> memoryview:
        """Keep freshly gathered ``data`` (contiguous uint8) if it fits and ``keep`` (more
        than one ask may want it) or it was gathered before; its bytes."""
        view = memoryview(data.data).cast("B")
        size = data.nbytes
        if not keep and key not in self._seen:
            self._seen[key] = None
            while len(self._seen) > self.max_entries:
                self._seen.popitem(last=False)
            return view
        self._seen.pop(key, None)
        if key in self._entries or size > self.max_bytes:
            self.not_kept += key not in self._entries
            return view
        while self._entries and (self.nbytes + size > self.max_bytes
                                 or len(self._entries) >= self.max_entries):
            self._evict(next(iter(self._entries)))
        if self.pool is not None and not self.pool.hold(size):
            self.not_kept += 1
            return view
        self._entries[key] = data
        self.nbytes += size
        return view

    def keep(self, versions: Iterable[tuple[str, int]]) -> None:
        """Drop every entry whose (publisher_id, version) is not in ``versions``."""
        held = set(versions)
        for key in [k for k in self._entries if (k[0], k[1]) not in held]:
            self._evict(key)
        for key in [k for k in self._seen if (k[0], k[1]) not in held]:
            del self._seen[key]

    def clear(self) -> None:
        for key in list(self._entries):
            self._evict(key)
        self._seen.clear()

    def shed(self) -> None:
        """The pool needs the room for staging (``BufferPool.shed``)."""
        if self._entries:
            self.sheds += 1
        self.clear()

    def _evict(self, key: SliceKey) -> None:
        data = self._entries.pop(key)
        self.nbytes -= data.nbytes
        if self.pool is not None:
            self.pool.unhold(data.nbytes)

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        return {"slice_cache_bytes": self.nbytes, "slice_cache_max_bytes": self.max_bytes,
                "slice_cache_entries": len(self._entries), "slice_cache_hits": self.hits,
                "slice_cache_misses": self.misses, "slice_cache_not_kept": self.not_kept,
                "slice_cache_sheds": self.sheds}
