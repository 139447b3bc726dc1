"""A tiny shared-memory table: each worker rank's staged/applied versions, read by the engine core.

Why: the engine core must know, before every ``scheduler.schedule()``, whether all
ranks hold a common newer version, without a network round trip or a collective.
Workers write their slot when something changes (rare); the engine reads a
few int64 words per step (nanoseconds to microseconds).

Layout (little-endian int64 words)::

    0 magic | 1 nslots | 2 intent | 3 reserved | 4..4+n seq[rank] | slots...
    slot: pid_hash | applied | count | held[0..KEEP-1]

Each slot has one writer (the rank's ``CommitCoordinator`` under its lock); a
sequence counter (odd while writing) lets the reader detect torn reads.
``intent`` is the version the engine is about to commit: a rank does not release
it (see ``CommitCoordinator``). The file lives in ``/dev/shm`` and is unlinked by
the engine as soon as its workers have mapped it; a table left behind by an
engine killed before that is removed by the next engine's ``create``.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import secrets
import tempfile
import threading

from subscriber_ext.vllm_ext.commit.idle_wake import WakeSender, wake_address

__all__ = [
    "ENV",
    "KEEP",
    "SlotReader",
    "SlotTable",
    "SlotWriter",
    "common_version",
    "fence",
    "pid_hash",
]

ENV = "WEIGHTPUB_SLOTS"  # "<path>:<nslots>", set by the engine core for its workers
KEEP = 4  # held versions advertised per rank
_MAGIC = 0x57505331  # "WPS1"
_HDR = 4
_SLOT = 3 + KEEP
_fence_lock = threading.Lock()
_TABLE_NAME = re.compile(r"^weightpub-(\d+)-[0-9a-f]{12}$")


def fence() -> None:
    """A lock round trip: a full memory barrier between our store and a later load."""
    with _fence_lock:
        pass


def pid_hash(publisher_id: str | None) -> int:
    """Stable non-zero int64 for a publisher instance id (0 means "none")."""
    if not publisher_id:
        return 0
    h = int.from_bytes(hashlib.blake2b(publisher_id.encode(), digest_size=8).digest(), "little")
    h &= (1 << 63) - 1
    return h or 1


class SlotTable:
    """The mapped table (create in the engine core, attach in workers)."""

    def __init__(self, path: str, nslots: int, *, create: bool = False) -> None:
        size = 8 * (_HDR + nslots + nslots * _SLOT)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path = path
        self.nslots = nslots
        self.words = memoryview(self._mm).cast("q")
        if create:
            self.words[1] = nslots
            self.words[2] = -1
            self.words[0] = _MAGIC
        elif self.words[0] != _MAGIC or self.words[1] != nslots:
            raise ValueError(f"{path}: not a weightpub slot table for {nslots} ranks")

    @classmethod
    def create(cls, nslots: int) -> SlotTable:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        reap_stale_tables(base)
        path = os.path.join(base, f"weightpub-{os.getpid()}-{secrets.token_hex(6)}")
        return cls(path, nslots, create=True)

    @classmethod
    def from_env(cls, value: str | None = None) -> SlotTable | None:
        value = os.environ.get(ENV) if value is None else value
        if not value:
            return None
        path, _, n = value.rpartition(":")
        return cls(path, int(n))

    def env_value(self) -> str:
        return f"{self.path}:{self.nslots}"

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # intent: written by the engine only
    @property
    def intent(self) -> int:
        return self.words[2]

    @intent.setter
    def intent(self, version: int) -> None:
        self.words[2] = version


def reap_stale_tables(directory: str) -> list[str]:
    """Unlink slot tables whose engine process is gone (killed before it unlinked its own)."""
    reaped: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return reaped
    for name in names:
        match = _TABLE_NAME.match(name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # its engine is alive
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue  # someone else's process, or not a pid
        try:
            os.unlink(os.path.join(directory, name))
            reaped.append(name)
        except OSError:
            pass
    return reaped


class SlotWriter:
    """One rank's view: publish (pid_hash, applied, held versions).

    Every write also wakes the engine core if it sits idle (``idle_wake``): the
    engine then commits at once instead of at its next poll.
    """

    def __init__(self, table: SlotTable, index: int) -> None:
        if not 0 <= index < table.nslots:
            raise ValueError(f"slot {index} out of range (table has {table.nslots})")
        self.table = table
        self.index = index
        self._seq = _HDR + index
        self._base = _HDR + table.nslots + index * _SLOT
        self.waker = WakeSender(wake_address(table.path))

    def write(self, pid: int, applied: int | None, held: list[int]) -> None:
        w = self.table.words
        held = sorted(held)[-KEEP:]
        w[self._seq] += 1  # odd: writing
        b = self._base
        w[b] = pid
        w[b + 1] = -1 if applied is None else applied
        w[b + 2] = len(held)
        for i, v in enumerate(held):
            w[b + 3 + i] = v
        w[self._seq] += 1  # even: consistent
        self.waker.notify()


class SlotReader:
    """The engine core's view: cheap change detection and a consistent snapshot."""

    def __init__(self, table: SlotTable) -> None:
        self.table = table
        self._seq_bytes = slice(8 * _HDR, 8 * (_HDR + table.nslots))
        self._raw = memoryview(table._mm)

    def seqs(self) -> bytes:
        """All sequence counters as bytes: unchanged bytes mean nothing changed."""
        return self._raw[self._seq_bytes].tobytes()

    def snapshot(self, tries: int = 100) -> list[tuple[int, int, tuple[int, ...]]] | None:
        """``[(pid_hash, applied, held)]`` per rank, or None if writers kept racing us."""
        w = self.table.words
        n = self.table.nslots
        for _ in range(tries):
            before = [w[_HDR + i] for i in range(n)]
            if any(s & 1 for s in before):
                continue
            out = []
            for i in range(n):
                b = _HDR + n + i * _SLOT
                count = max(0, min(KEEP, w[b + 2]))
                out.append((w[b], w[b + 1], tuple(w[b + 3 + j] for j in range(count))))
            if [w[_HDR + i] for i in range(n)] == before:
                return out
        return None


def common_version(snapshot: list[tuple[int, int, tuple[int, ...]]]) -> tuple[int, int] | None:
    """``(pid_hash, version)``: newest version every rank holds from the same publisher."""
    pids = {pid for pid, _, _ in snapshot}
    if len(pids) != 1 or 0 in pids:
        return None
    common = set(snapshot[0][2])
    for _, _, held in snapshot[1:]:
        common &= set(held)
    return (pids.pop(), max(common)) if common else None
