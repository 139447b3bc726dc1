"""Delta versions, trainer side: which versions get deltas, encoding them off the trainer's path.

A version is an *anchor* (full only) every ``anchor_every`` versions, when its
layout differs from the previous one, or when the chain's deltas already add
up to a full version (replaying them would cost more than fetching in full).
Otherwise its manifest offers deltas against the previous version, and the
chain back to the anchor (``Manifest.delta``), so a subscriber holding any
version of the chain catches up through at most ``anchor_every - 1`` deltas;
one holding nothing fetches the newest version in full (always cheaper than an
anchor plus deltas, and always held).

The manifest goes out as soon as it is hashed, as for any version; encoding
happens afterwards on background threads, chunk by chunk in order, and the
server holds back a delta chunk until it is encoded (the full bytes are
served at once to whoever asks for them). If a newer version arrives before
an encoding ends, the rest of the old one is marked raw (served from its full
bytes) so the encoder never falls behind the trainer.

Memory: the encoded deltas of at most ``anchor_every - 1`` versions, together
at most one full version's bytes (oldest dropped first); chunks where a delta
does not pay are not copied but served from the version's own buffer. The base
must stay whole beside the new version, so deltas need ``keep_versions`` >= 2
(``PublisherOptions``: one more snapshot in ``host_budget_bytes``). Nothing is
pinned: a chunk whose base or new bytes a newer snapshot began to overwrite while
it was encoded (``PublishedVersion.intact``, checked after) is served raw.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from publisher.store.version_store import PublishedVersion
from weightpub_wire import protocol as wire
from weightpub_wire.delta_codec import encode_chunk, version_digest
from weightpub_wire.dtypes import dtype_from_name, itemsize
from weightpub_wire.errors import ConfigError

__all__ = ["DeltaPublisher", "EncodedDelta", "chunk_widths"]

log = logging.getLogger("weightpub.publisher")

RAW = b""  # a chunk served from the version's full bytes (a valid encoding is never empty)
MAX_ANCHOR_EVERY = wire.MAX_DELTA_CHAIN
_WINDOW = 8  # chunks encoding at once per version


@dataclass(slots=True)
class EncodedDelta:
    """The chunks of one version as deltas against ``base_version``; filled in the background.

    ``payloads[i]`` is None until chunk ``i`` is encoded, ``RAW`` where the full
    bytes are sent, else the payload. Once ``finished``, a None also means raw.
    """

    version: int
    base_version: int
    payloads: list[bytes | None]
    finished: bool = False
    nbytes: int = 0
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def payload(self, chunk: int) -> bytes | None:
        """The chunk's payload, ``RAW``, or None while it is still being encoded."""
        payload = self.payloads[chunk]
        if payload is None and self.finished:
            return RAW
        return payload

    def _set(self, chunk: int, payload: bytes, cpu: float) -> None:
        with self._lock:
            self.payloads[chunk] = payload
            self.nbytes += len(payload)
            self.cpu_seconds += cpu


def chunk_widths(manifest: wire.Manifest) -> list[int]:
    """Per chunk, the itemsize of the dtype covering most of its bytes (the sparse word size)."""
    best: list[tuple[int, int]] = [(0, 1)] * manifest.num_chunks  # (bytes covered, itemsize)
    size = manifest.chunk_size
    for entry in manifest.tensors:
        width = itemsize(dtype_from_name(entry.dtype))
        for chunk in manifest.chunks_of(entry):
            start = max(entry.offset, chunk * size)
            stop = min(entry.offset + entry.nbytes, (chunk + 1) * size)
            if stop - start > best[chunk][0]:
                best[chunk] = (stop - start, width)
    return [width for _, width in best]


_Job = tuple[EncodedDelta, PublishedVersion, PublishedVersion]


class DeltaPublisher:
    """Anchor policy, the bounded store of encoded deltas, and the background encoder."""

    def __init__(self, anchor_every: int = 1, *, threads: int | None = None) -> None:
        if not 1 <= anchor_every <= MAX_ANCHOR_EVERY:
            raise ConfigError(f"delta_anchor_every: {anchor_every} is outside "
                              f"[1, {MAX_ANCHOR_EVERY}] (1 = every version in full)")
        self.anchor_every = anchor_every
        self._chain: list[wire.DeltaBase] = []
        self._deltas: OrderedDict[int, EncodedDelta] = OrderedDict()
        self._lock = threading.Lock()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._executor: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.encoded_versions = 0
        self.cpu_seconds = 0.0
        if anchor_every > 1:
            threads = threads or max(2, min(8, (os.cpu_count() or 2) // 2))
            self._executor = ThreadPoolExecutor(threads, thread_name_prefix="weightpub-delta-chunk")
            self._thread = threading.Thread(target=self._encode_loop, name="weightpub-delta-encode",
                                            daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self.anchor_every > 1

    # -- policy (the preparing thread, one version at a time, in order) --------------------------
    def plan(self, version: int, entries: list[wire.TensorEntry], total_bytes: int,
             chunk_size: int, checksums: tuple[int, ...],
             previous: PublishedVersion | None) -> wire.DeltaInfo | None:
        """The manifest's ``delta`` field for a new version (None: an anchor)."""
        me = wire.DeltaBase(version=version,
                            digest=version_digest(total_bytes, chunk_size, checksums))
        with self._lock:
            chain_bytes = sum(self._deltas[b.version].nbytes for b in self._chain[1:]
                              if b.version in self._deltas)
        chained = (
            self.enabled and previous is not None and not previous.failed and self._chain
            and previous.manifest.version == self._chain[-1].version
            and previous.manifest.total_bytes == total_bytes
            and previous.manifest.chunk_size == chunk_size
            and previous.manifest.tensors == tuple(entries)
            and len(self._chain) < self.anchor_every
            and chain_bytes < total_bytes
        )
        info = wire.DeltaInfo(chain=tuple(self._chain)) if chained else None
        self._chain = [*self._chain, me] if chained else [me]
        return info

    def start(self, new: PublishedVersion, base: PublishedVersion | None) -> None:
        """Queue the encoding of ``new`` against ``base`` (each chunk checked after)."""
        if new.manifest.delta is None or base is None or self._closed:
            return
        if base.lent:  # the base's buffer is already being reused: no delta this time
            return
        delta = EncodedDelta(version=new.manifest.version, base_version=base.manifest.version,
                             payloads=[None] * new.manifest.num_chunks)
        with self._lock:
            self._deltas[delta.version] = delta
            self._evict_locked(new.manifest.total_bytes)
        self._jobs.put((delta, new, base))

    def lookup(self, version: int, base: int) -> EncodedDelta | None:
        with self._lock:
            delta = self._deltas.get(version)
        return delta if delta is not None and delta.base_version == base else None

    def held(self) -> tuple[int, int]:
        """(deltas held, their bytes): at most ``anchor_every - 1`` and one version's size."""
        with self._lock:
            return len(self._deltas), sum(d.nbytes for d in self._deltas.values())

    def close(self) -> None:
        self._closed = True
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def _evict_locked(self, budget: int) -> None:
        """At most ``anchor_every - 1`` deltas, at most ``budget`` bytes; the newest is kept."""
        while len(self._deltas) > 1 and (
            len(self._deltas) > self.anchor_every - 1
            or sum(d.nbytes for d in self._deltas.values()) > budget
        ):
            self._deltas.popitem(last=False)

    # -- encoding (one thread feeding a small pool; zstd and numpy release the GIL) ------------
    def _encode_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            delta, new, base = job
            try:
                self._encode(delta, new, base)
            except Exception:  # the chunks not encoded are served raw
                log.exception("encoding the delta of version %d failed", delta.version)
            finally:
                delta.finished = True
                with self._lock:
                    self._evict_locked(new.manifest.total_bytes)

    def _encode(self, delta: EncodedDelta, new: PublishedVersion,
                base: PublishedVersion) -> None:
        assert self._executor is not None
        started = time.monotonic()
        widths = chunk_widths(new.manifest)
        running: list[Future[None]] = []
        for chunk, width in enumerate(widths):
            if self._closed or not self._jobs.empty() or new.failed:
                log.info("version %d: a newer version is waiting; %d of %d chunks of the "
                         "delta stay raw", delta.version, len(widths) - chunk, len(widths))
                break
            while not new.chunk_ready(chunk):  # the manifest may precede the copy's end
                time.sleep(0.001)
                if new.failed or self._closed:
                    return
            running.append(self._executor.submit(self._encode_chunk, delta, new, base, chunk,
                                                 width))
            if len(running) >= _WINDOW:
                running.pop(0).result()
        for future in running:
            future.result()
        delta.wall_seconds = time.monotonic() - started
        self.encoded_versions += 1
        self.cpu_seconds += delta.cpu_seconds
        log.debug("version %d: delta of %d bytes (%.4fx) in %.3fs, %.3f CPU s", delta.version,
                  delta.nbytes, delta.nbytes / max(1, new.manifest.total_bytes),
                  delta.wall_seconds, delta.cpu_seconds)

    @staticmethod
    def _encode_chunk(delta: EncodedDelta, new: PublishedVersion, base: PublishedVersion,
                      chunk: int, width: int) -> None:
        cpu = time.thread_time()
        payload = encode_chunk(new.chunk_view(chunk), base.chunk_view(chunk), width)
        if not (new.intact(chunk) and base.intact(chunk)):
            payload = None  # a newer snapshot overwrote bytes it read: served raw (or not)
        delta._set(chunk, RAW if payload is None else payload, time.thread_time() - cpu)
