"""The subscriber's NIXL agent, made on a thread of its own.

Why not on the client's loop: importing NIXL and making the agent (UCX's backend)
takes about half a second here; made there at the first manifest offering NIXL, it
stalled everything the loop does (other versions, frames, heartbeats, reports, peers'
``peer_nixl`` answers) that long. The agent's bindings release the GIL while UCX
starts, so the loop keeps turning (the import itself holds it ~0.1 s). The picker
(``nixl_source.NixlPicker``) starts it as soon as it knows it will use NIXL (the
``nixl`` option True: at once; auto: the first manifest offering it) and takes the
reader once ``done``; nothing here blocks without a bound.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from weightpub_wire.nixl_link import NixlReader

__all__ = ["AgentStart"]

#: tests only: called on the starting thread before the agent is made (a gate that makes
#: the start slow deterministically, or a raise that makes it fail)
BEFORE_START: Callable[[], None] | None = None


class AgentStart:
    """One start of a ``NixlReader`` on a daemon thread: ``done``, then ``reader`` (or
    ``error``: why NIXL cannot run here). ``close`` before it is done closes the reader
    the thread makes, when it makes it."""

    def __init__(self, prefix: str, check: Callable[[], str | None]) -> None:
        """``check``: why NIXL cannot run here, or None (``nixl_link.nixl_error``: imports
        NIXL, so it runs on the thread too)."""
        self.began = time.monotonic()
        self.took: float | None = None  # seconds the start took, once done
        self.reader: NixlReader | None = None
        self.error: str | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, args=(prefix, check),
                                        name="weightpub-nixl-agent", daemon=True)
        self._thread.start()

    def _run(self, prefix: str, check: Callable[[], str | None]) -> None:
        reader: NixlReader | None = None
        try:
            hook = BEFORE_START
            if hook is not None:
                hook()
            self.error = check()
            if self.error is None:
                reader = NixlReader(prefix)
        except Exception as exc:  # a broken backend, UCX refusing: frames then
            self.error = f"its NIXL agent did not start ({type(exc).__name__}: {exc})"
        with self._lock:
            if self._closed and reader is not None:
                reader.close()
                reader = None
            self.reader = reader
            self.took = time.monotonic() - self.began
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def take(self) -> NixlReader | None:
        """The reader made (once: the taker owns it), or None (``error`` says why)."""
        with self._lock:
            reader, self.reader = self.reader, None
        return reader

    def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds; True once done."""
        return self._done.wait(timeout)

    def close(self) -> None:
        """The picker closed: a reader made (or still being made) is closed."""
        with self._lock:
            self._closed = True
            reader, self.reader = self.reader, None
        if reader is not None:
            reader.close()
