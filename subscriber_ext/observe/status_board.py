"""Per-rank status files a replica's front end can read without asking the workers.

Why: ``vllm serve`` answers ``/metrics`` from its API-server process, while the
versions, bytes and timings live in the worker processes (and an RPC per scrape
would wait behind generation steps). Each rank therefore writes a small JSON
snapshot of its state into one directory (in ``/dev/shm``), atomically
(write, then rename); the front end reads the directory when scraped. The
directory is created by the first process of a replica (the front end) and
named in ``WEIGHTPUB_STATUS_DIR``, which the engine core and workers inherit.
Files are bounded (``MAX_FILE_BYTES``) and removed with the directory at exit;
a directory left by a front end that was killed (no exit handler ran) carries its
pid in the name and is removed by the next replica's ``create``.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["ENV", "MAX_FILE_BYTES", "STALE_AFTER_S", "StatusBoard", "reap_orphaned_boards"]

ENV = "WEIGHTPUB_STATUS_DIR"
_PREFIX = "weightpub-status-"
_NAME = re.compile(rf"^{_PREFIX}(\d+)-")
MAX_FILE_BYTES = 64 << 10
#: a rank that has not written for this long is gone (writers refresh every second)
STALE_AFTER_S = 30.0


class StatusBoard:
    """One replica's directory of ``rank<N>.json`` files."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls) -> StatusBoard:
        """A fresh directory, removed at exit, exported to child processes."""
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        reap_orphaned_boards(base)
        board = cls(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=base))
        atexit.register(shutil.rmtree, board.path, True)
        os.environ[ENV] = str(board.path)
        return board

    @classmethod
    def from_env(cls) -> StatusBoard | None:
        value = os.environ.get(ENV)
        return cls(value) if value and os.path.isdir(value) else None

    def write(self, rank: int, state: dict[str, Any]) -> None:
        """Replace this rank's snapshot (readers never see a half-written file)."""
        data = json.dumps(state, separators=(",", ":"), default=str).encode()
        if len(data) > MAX_FILE_BYTES:
            data = json.dumps({"rank": rank, "error": "status too large"}).encode()
        tmp = self.path / f".rank{rank}.{os.getpid()}.tmp"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.path / f"rank{rank}.json")
        except OSError:
            tmp.unlink(missing_ok=True)  # the directory went away: the replica is stopping

    def read(self) -> dict[int, dict[str, Any]]:
        """Every live rank's latest snapshot; stale, unreadable or oversized files are skipped."""
        out: dict[int, dict[str, Any]] = {}
        try:
            entries = list(self.path.glob("rank*.json"))
        except OSError:
            return out
        now = time.time()
        for entry in entries:
            try:
                rank = int(entry.stem[4:])
                info = entry.stat()
                if info.st_size > MAX_FILE_BYTES or now - info.st_mtime > STALE_AFTER_S:
                    continue
                state = json.loads(entry.read_bytes())
            except (OSError, ValueError):
                continue
            if isinstance(state, dict):
                out[rank] = state
        return out


def reap_orphaned_boards(directory: str) -> None:
    """Remove status directories whose front-end process is gone (it was killed)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        match = _NAME.match(name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # its front end is alive
        except ProcessLookupError:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        except (PermissionError, OverflowError):
            continue
